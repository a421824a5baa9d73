"""What the self-tuning strategies (Speculative.auto(), Cascade.auto()) price their drafts with:
what a forward costs by its width on this platform and a drafter's forward relative to the
target's. The choice itself, from counted acceptance rates, is kernels/draft_budget.py.

Costs are in target forwards of one token. Nothing here is timed: a row's decision follows
its own counts only, so a seeded request gives the same tokens whatever shares its batch and
however often it runs.
"""
import torch

from csd_engine import ops
from csd_engine.checks import is_number
from csd_engine.models.quant import TORCH_CPU_PACKED_SLOWDOWN, on_torch_cpu_ops, parse_scheme
from csd_engine.strategies.base import Models


def check_pricing(owner: str, prior, prior_rate, model_cost, width_cost) -> None:
    """The pricing settings Speculative.auto() and Cascade.auto() share; `owner` names the
    strategy in the error."""
    if not is_number(prior) or not prior > 0:
        raise ValueError(f"{owner}(prior=...) must be a number > 0 (drafts' worth), got {prior!r}")
    if not is_number(prior_rate) or not 0 <= prior_rate < 1:
        raise ValueError(f"{owner}(prior_rate=...) must be a number in [0, 1), got {prior_rate!r}")
    for name, value in (("model_cost", model_cost), ("width_cost", width_cost)):
        if value is not None and (not is_number(value) or not 0 <= value < float("inf")):
            raise ValueError(f"{owner}({name}=...) must be a number >= 0 (relative to one target forward) or None "
                             f"(the platform's default), got {value!r}")


# A forward's cost by width (tokens fed) relative to a one-token forward where a bf16 target runs
# on csd_engine's CPU kernel (no native bf16): the Qwen 1.5B's forwards on a 2-core AVX2 EPYC,
# the mean of two interleaved runs (bench/measured/forward-cost-qwen-bf16-int8-interleaved-avx2-cpu-2026-11-26*.json;
# 2 tokens measured 0.98x, kept at 1). Flat while streaming the weights dominates (to 4 tokens),
# then compute-bound; the step at 7 is where the kernel splits x's rows into two tiles (6 + 1 -> 4 + 3).
KERNEL_WIDTH_COSTS = ((1, 1.0), (2, 1.0), (3, 1.07), (4, 1.13), (5, 1.36), (6, 1.48), (7, 1.85), (8, 1.95),
                      (9, 2.19), (11, 2.66), (13, 2.95), (17, 3.87))
# The same where the kernel runs on a CPU with native bf16 (its AVX-512 tiles, faster than torch's
# oneDNN path there): the Qwen 1.5B on a 2-core AVX-512 EPYC, 300 tokens of context, median of 3
# (bench/measured/forward-cost-qwen-bf16-avx512-kernel-cpu-2026-11-27.json; 2 tokens measured 1.14x,
# min 1.11x, kept at 3's). A one-token forward is half of oneDNN's there, wide ones cost the same.
AVX512_KERNEL_WIDTH_COSTS = ((1, 1.0), (2, 1.1), (3, 1.1), (5, 1.12), (7, 1.49), (9, 1.65), (11, 1.85),
                             (13, 2.24), (17, 2.68))
# The same on a CPU with AMX, where the kernel's one-token forward is 0.56x torch's (oneDNN's AMX
# tiles, flat to 13 tokens) but its wide ones cost more: the Qwen 1.5B on a 2-core Sapphire Rapids
# Xeon, 300 tokens of context, median of 5 (bench/measured/forward-cost-qwen-bf16-amx-kernel-vs-torch-cpu-2026-12-01.json)
# averaged with an ad hoc interleaved run of the same widths (docs/measurements.md).
AMX_KERNEL_WIDTH_COSTS = ((1, 1.0), (2, 1.09), (3, 1.16), (4, 1.22), (5, 1.36), (7, 2.02), (9, 2.17), (13, 3.28),
                          (17, 3.61))
# The same where the kernel runs AMX's bf16 tiles (csrc/bf16_linear.cpp's matmul_amx; the two
# curves above are its FMA tiles): the Qwen 1.5B on a 2-core Sapphire Rapids Xeon, 300 tokens of
# context, median of 5 (bench/measured/forward-cost-qwen-bf16-amx-tiles-cpu-2026-12-06.json). A
# call's matmuls cost about what one row's do up to 16 rows; what grows is the rest of the forward,
# and at 17 a second tile of rows.
AMX_TILE_WIDTH_COSTS = ((1, 1.0), (2, 1.02), (3, 1.03), (5, 1.15), (7, 1.26), (9, 1.28), (13, 1.34), (17, 1.73))

# A float32 target on the CPU whose weights stream from memory (torch's matmuls: a one-token forward
# takes the matrix-vector path, every wider one the matrix-matrix path, which costs about twice as
# much at any width up to 17): the Qwen 1.5B on a 2-core AVX-512 EPYC, 300 tokens of context,
# median of 3, 2026-12-01 (bench/measured/forward-cost-qwen-1.5b-float32-cpu-2026-12-01.json).
FLOAT32_CPU_WIDTH_COSTS = ((1, 1.0), (2, 2.15), (3, 3.04), (4, 2.09), (5, 2.24), (7, 2.98), (9, 2.64), (13, 2.44),
                           (17, 2.71))
# Weights past any CPU's last-level cache, which every forward streams from memory: below it (a
# model of a few MB) a wide forward costs about what a one-token one does.
STREAMED_WEIGHT_BYTES = 256 << 20


def on_bf16_kernel(models: Models) -> bool:
    """The target's bf16 forwards run on csd_engine's CPU kernel on a CPU without native bf16 (where
    KERNEL_WIDTH_COSTS and the parameter price were measured)."""
    return (models.device.type == "cpu" and getattr(models.target, "dtype", None) == torch.bfloat16
            and ops.kernel_without_native_bf16())


def on_kernel_with_native_bf16(models: Models) -> bool:
    """The target's bf16 forwards run on csd_engine's CPU kernel on a CPU with native bf16."""
    return (models.device.type == "cpu" and getattr(models.target, "dtype", None) == torch.bfloat16
            and ops.bf16_kernel_pays() and not ops.kernel_without_native_bf16())


def width_costs(models: Models, width_cost: float | None, n: int) -> torch.Tensor:
    """[n + 1] float32 on the models' device: a forward over w tokens relative to a one-token
    forward, for w = 0..n (0 costs as 1). 1 + width_cost (w - 1) where width_cost is given; else
    the platform's: KERNEL_WIDTH_COSTS, AVX512_KERNEL_WIDTH_COSTS or AMX_KERNEL_WIDTH_COSTS
    (interpolated, extended at its last slope) where csd_engine's bf16 kernel runs the target, FLOAT32_CPU_WIDTH_COSTS for a
    float32 target on the CPU of STREAMED_WEIGHT_BYTES or more, 1 + 0.02 (w - 1) elsewhere
    (torch's bf16 matmul on the AVX-512 EPYC, bench/draft_policy.py's timing: 9 / 17 tokens
    1.15-1.18 / 1.35-1.44x one, the line 1.16 / 1.32; a GPU's forward is flat far wider)."""
    w = torch.arange(n + 1, dtype=torch.float64).clamp(min=1)
    float32_cpu = (models.device.type == "cpu" and getattr(models.target, "dtype", None) == torch.float32
                   and (getattr(models.target, "weight_bytes", None) or 0) >= STREAMED_WEIGHT_BYTES)
    native_bf16_curve = AMX_TILE_WIDTH_COSTS if ops.bf16_kernel_on_amx() else \
        AMX_KERNEL_WIDTH_COSTS if torch.cpu._is_amx_tile_supported() else AVX512_KERNEL_WIDTH_COSTS
    curve = KERNEL_WIDTH_COSTS if on_bf16_kernel(models) else \
        native_bf16_curve if on_kernel_with_native_bf16(models) else \
        FLOAT32_CPU_WIDTH_COSTS if float32_cpu else None
    if width_cost is None and curve is not None:
        x, y = (torch.tensor(v, dtype=torch.float64) for v in zip(*curve))
        i = (torch.searchsorted(x, w, right=True) - 1).clamp(0, len(x) - 2)
        cost = y[i] + (w - x[i]) * (y[i + 1] - y[i]) / (x[i + 1] - x[i])
    else:
        cost = 1 + (0.02 if width_cost is None else width_cost) * (w - 1)
    return cost.to(models.device, torch.float32)


def cost_ratio(models: Models, drafter: int) -> float:
    """A drafter's forward cost relative to the target's: decoding at small batch streams the
    weights once per forward, so the ratio of the bytes streamed (a quantized drafter's packed
    weights). The ratio of parameter counts where a runner does not say its bytes, and where
    csd_engine's bf16 kernel runs the target: its kernels widen every weight to fp32 and cost
    more than their bytes (2-core AVX2 EPYC: the Qwen 0.5B's int8 one-token forward 0.31 of
    the 1.5B's, its bytes 0.16; the parameter price is what the strategies were tuned with there).
    A drafter quantized for float32 or float16 activations on the CPU runs torch's packed ops:
    the parameter ratio times their measured slowdown (quant.TORCH_CPU_PACKED_SLOWDOWN)."""
    d, t = models.drafters[drafter], models.target
    scheme = getattr(d, "quantize", None)
    if scheme and on_torch_cpu_ops(d.device, d.dtype):
        return d.num_params / t.num_params * TORCH_CPU_PACKED_SLOWDOWN[parse_scheme(scheme)[0]]
    if getattr(d, "weight_bytes", None) and getattr(t, "weight_bytes", None) and not on_bf16_kernel(models):
        return d.weight_bytes / t.weight_bytes
    return d.num_params / t.num_params
