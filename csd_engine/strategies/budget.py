"""The cost model the self-tuning strategies share (Speculative.auto(), Cascade.auto()): counted
acceptance rates, the expected tokens of a draft whose tokens are accepted at a per-token rate,
and what one more token of width adds to a target forward on this platform.

Costs are in target forwards of one token. Nothing here is timed: a row's decision follows
its own counts only, so a seeded request gives the same tokens whatever shares its batch and
however often it runs.
"""
import torch

from csd_engine import ops
from csd_engine.strategies.base import Models


def counted_rate(accepted: torch.Tensor, counted: torch.Tensor, prior: float, prior_rate: float = 0.5) -> torch.Tensor:
    """accepted / counted per row, with the prior rate `prior_rate` worth `prior` tokens."""
    return (accepted + prior_rate * prior) / (counted + prior)


def geometric(rate: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """1 + rate + ... + rate^n: the tokens a step emits when each of n draft tokens is accepted
    at `rate`, given the ones before it were (the bonus / correction token included)."""
    return (1 - rate ** (n + 1)) / (1 - rate).clamp_min(1e-6)


def platform_width_cost(models: Models) -> float:
    """What one more token adds to a target forward, relative to a one-token forward: 0.15 on a
    CPU where csd_engine's bf16 kernel runs (no native bf16: the Qwen 1.5B's 5-token forward cost
    1.52-1.63x its 1-token one on a 2-core AVX2 EPYC, bench/forward_cost.py), else 0.02 (AVX-512:
    17 tokens 1.18x; a GPU's forward is flat far wider)."""
    target = models.target
    kernel = (models.device.type == "cpu" and getattr(target, "dtype", None) == torch.bfloat16
              and ops.bf16_kernel_pays())
    return 0.15 if kernel else 0.02


def parameter_ratio(models: Models, drafter: int) -> float:
    """A drafter's forward cost relative to the target's, from parameter counts (decoding at
    small batch streams the weights once per forward)."""
    return models.drafters[drafter].num_params / models.target.num_params


def chain_budget(rate: torch.Tensor, max_tokens: int, model_cost: float, width_cost: float) -> torch.Tensor:
    """[B] draft length a <= max_tokens of a chain drafter that maximises tokens per cost,
    geometric(rate, a) / (1 + (width_cost + model_cost) a): each draft token costs one drafter
    forward and one token of the target's width. 0 (plain decoding) once no length pays."""
    a = torch.arange(max_tokens + 1, device=rate.device)
    value = geometric(rate[:, None], a.to(rate.dtype)) / (1 + (width_cost + model_cost) * a)
    return a[value.argmax(1)]  # the first best (fewest drafts) on ties
