"""Checks every strategy must pass: greedy equal to plain greedy decoding token for token,
and sampled output following the target's own distribution."""
import torch

from csd_engine import Autoregressive, Engine, SamplingParams
from tests.stats import assert_distribution


def processed_probs(logits, temperature, top_k=0, top_p=1.0):
    """The target's sampling distribution, computed independently of the engine."""
    z = logits.double() / temperature
    if top_k:
        z = torch.where(z >= z.topk(top_k).values[-1], z, -torch.inf)
    p = torch.softmax(z, -1)
    if top_p < 1:
        sorted_p, order = p.sort(descending=True)
        before = sorted_p.cumsum(0) - sorted_p  # mass strictly above each entry
        keep = torch.zeros_like(p, dtype=torch.bool)
        keep[order] = before < top_p
        p = torch.where(keep, p, 0)
    return p / p.sum()


def assert_greedy_equals_autoregressive(engine: Engine, prompts, strategy, max_new_tokens=24):
    params = SamplingParams(max_new_tokens=max_new_tokens)
    plain = engine.generate(prompts, params, strategy=Autoregressive())
    fast = engine.generate(prompts, params, strategy=strategy)
    for i, (a, b) in enumerate(zip(plain, fast)):
        assert b.token_ids == a.token_ids, f"row {i}: {strategy} diverged from greedy decoding"
        assert b.finish_reason == a.finish_reason
    return fast


def assert_samples_follow_target(engine: Engine, target_model, prompt, strategy, temperature=1.0, top_k=0,
                                 top_p=1.0, draws=2000):
    """The first two sampled tokens of `draws` requests (one batched generate, one seed per
    row) follow the target: the first token's marginal, and the second token conditioned on
    the most frequent first token."""
    base = int(torch.randint(0, 2**31, (1,)))
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=2, seed=base + i)
              for i in range(draws)]
    results = engine.generate([prompt] * draws, params, strategy=strategy)
    first = torch.tensor([r.token_ids[0] for r in results])
    with torch.no_grad():
        logits = target_model(torch.tensor([prompt])).logits[0, -1]
    assert_distribution(first, processed_probs(logits, temperature, top_k, top_p))
    top = int(first.mode().values)
    second = torch.tensor([r.token_ids[1] for r in results if r.token_ids[0] == top])
    with torch.no_grad():
        logits2 = target_model(torch.tensor([prompt + [top]])).logits[0, -1]
    assert_distribution(second, processed_probs(logits2, temperature, top_k, top_p))
    return results
