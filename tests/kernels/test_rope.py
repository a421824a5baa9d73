"""rope_and_cache (Triton) against its PyTorch reference: rotated q, and k / v written to the right
cache slots (negative lengths wrap to the end of the row) with every other slot untouched."""
import time

import pytest
import torch

from csd_engine.kernels.rope import rope_and_cache, rope_and_cache_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(batch, n, q_heads, kv_heads, head_dim, capacity, lengths, dtype, gen):
    qkv = torch.randn(batch, n, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    positions = torch.tensor(lengths)[:, None].clamp(min=0) + torch.arange(n)[None, :] + 100
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    cache = torch.randn(2, batch, kv_heads, capacity, head_dim, generator=gen).to(DEVICE, dtype)
    return qkv, positions.to(DEVICE), inv_freq.to(DEVICE), cache, torch.tensor(lengths).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [
    dict(batch=1, n=1, q_heads=4, kv_heads=2, head_dim=16, lengths=[7]),
    dict(batch=3, n=5, q_heads=4, kv_heads=4, head_dim=32, lengths=[0, 12, 3]),
    dict(batch=2, n=3, q_heads=6, kv_heads=2, head_dim=64, lengths=[-1, 20]),  # a padded row (graphs.py)
], ids=["decode", "chain-mha", "padded-row"])
def test_matches_reference(dtype, case):
    seed = time.time_ns() % 2**31
    gen = torch.Generator().manual_seed(seed)
    heads = (case["q_heads"], case["kv_heads"], case["head_dim"])
    qkv, positions, inv_freq, cache, lengths = make_case(case["batch"], case["n"], *heads, 32, case["lengths"],
                                                         dtype, gen)
    ours, ref = cache.clone(), cache.clone()
    q = rope_and_cache(qkv, positions, inv_freq, 1.0, ours[0], ours[1], lengths, *heads)
    q_ref = rope_and_cache_ref(qkv, positions, inv_freq, 1.0, ref[0], ref[1], lengths, *heads)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-2)
    torch.testing.assert_close(q, q_ref, **tol, msg=f"q (seed {seed})")
    torch.testing.assert_close(ours, ref, **tol, msg=f"caches (seed {seed})")
    assert (ours != cache).any(dim=-1).sum() == (ref != cache).any(dim=-1).sum(), f"same slots written (seed {seed})"


def test_rejects_a_qkv_of_the_wrong_width():
    gen = torch.Generator().manual_seed(0)
    qkv, positions, inv_freq, cache, lengths = make_case(1, 2, 4, 2, 16, 8, [0], torch.float32, gen)
    with pytest.raises(ValueError, match="qkv's last dimension"):
        rope_and_cache(qkv[..., :-16], positions, inv_freq, 1.0, cache[0], cache[1], lengths, 4, 2, 16)
