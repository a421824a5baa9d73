"""cache_attention (Triton, flash-decoding) against its PyTorch SDPA reference.

Every case hands the kernel a cache whose unread slots (past each row's valid length, and
all of a padded row) hold NaN, so a kernel that reads outside the valid range fails loudly;
the reference gets the clean cache.
"""

import pytest
import torch

from csd_engine.kernels.attention import cache_attention, cache_attention_ref
from tests.stats import fresh_seed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs CPU tensors only

FP32_TOLERANCE = 1e-5  # relative to the largest output magnitude
# Kernel error <= these multiples of PyTorch's own error in the same dtype. The kernel rounds
# the softmax weights to bf16/fp16 for its second matmul (as flash attention does): measured
# ratios over 168 random bf16 cases reached 2.35 for the max error and 1.7 for the mean.
MAX_ERROR_FACTOR = 4.0
MEAN_ERROR_FACTOR = 2.5


def random_tree_mask(batch: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, n, n] ancestor masks (self included) of random parent arrays; parent -1 hangs
    a node directly under the committed prefix, so a row may hold several trees."""
    mask = torch.zeros(batch, n, n, dtype=torch.bool)
    for b in range(batch):
        for i in range(n):
            parent = int(torch.randint(-1, i, (), generator=gen))
            if parent >= 0:
                mask[b, i] = mask[b, parent]
            mask[b, i, i] = True
    return mask


def make_case(cache_lens: list[int], n: int, q_heads: int, kv_heads: int, head_dim: int, capacity: int,
              tree: bool, gen: torch.Generator):
    """Clean fp32 inputs (q, k_cache, v_cache, cache_lens, tree_mask or None)."""
    batch = len(cache_lens)
    q = torch.randn(batch, n, q_heads, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, capacity, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, capacity, head_dim, generator=gen)
    lens = torch.tensor(cache_lens, dtype=torch.int64)
    mask = random_tree_mask(batch, n, gen) if tree else None
    return q, k, v, lens, mask


def poison_unread(q, k, v, lens):
    """Copies with NaN wherever the kernel must not read: slots >= lens[b] + n, padded rows."""
    q, k, v = q.clone(), k.clone(), v.clone()
    n = q.shape[1]
    for b, length in enumerate(lens.tolist()):
        if length < 0:
            q[b] = k[b] = v[b] = float("nan")
        else:
            k[b, :, length + n:] = v[b, :, length + n:] = float("nan")
    return q, k, v


def run_kernel(q, k, v, lens, mask, dtype, device=DEVICE, num_splits=None, block_rows=None):
    q, k, v = (t.to(device, dtype) for t in poison_unread(q, k, v, lens))
    lens = lens.to(device)
    mask = None if mask is None else mask.to(device)
    return cache_attention(q, k, v, lens, mask, num_splits=num_splits, block_rows=block_rows).cpu()


def run_reference(q, k, v, lens, mask, dtype):
    return cache_attention_ref(q.to(dtype), k.to(dtype), v.to(dtype), lens, mask).cpu()


def assert_fp32_close(out, q, k, v, lens, mask, seed):
    ref = run_reference(q, k, v, lens, mask, torch.float64)
    err = (out.double() - ref).abs()
    bound = FP32_TOLERANCE * ref.abs().max().item()
    print(f"fp32 max err {err.max().item():.3g} mean {err.mean().item():.3g} bound {bound:.3g}")
    assert torch.isfinite(out).all(), f"seed={seed}"
    assert err.max().item() <= bound, f"seed={seed}: max error {err.max().item():.3g} > {bound:.3g}"
    padded = lens < 0
    assert (out[padded] == 0).all(), f"seed={seed}: padded rows must be zeros"


def assert_low_precision_close(out, q, k, v, lens, mask, dtype, seed):
    exact = run_reference(q, k, v, lens, mask, torch.float64)
    torch_err = (run_reference(q, k, v, lens, mask, dtype).double() - exact).abs()
    kernel_err = (out.double() - exact).abs()
    print(f"{dtype} kernel max {kernel_err.max().item():.3g} mean {kernel_err.mean().item():.3g}; "
          f"torch max {torch_err.max().item():.3g} mean {torch_err.mean().item():.3g}")
    for stat, factor in ((torch.amax, MAX_ERROR_FACTOR), (torch.mean, MEAN_ERROR_FACTOR)):
        assert stat(kernel_err) <= factor * stat(torch_err), (
            f"seed={seed}: kernel {stat.__name__} error {stat(kernel_err).item():.3g} vs torch "
            f"{stat(torch_err).item():.3g} in {dtype}")


@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("n", [1, 4, 9])
def test_fp32_matches_reference(n, q_heads, kv_heads, head_dim, tree):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    capacity = int(torch.randint(64, 201, (), generator=gen))
    # An empty prefix, a ragged one and a padded row in one batch.
    lens = [0, int(torch.randint(1, capacity - n + 1, (), generator=gen)), -1]
    case = make_case(lens, n, q_heads, kv_heads, head_dim, capacity, tree, gen)
    # Two splits: every case goes through the merge; the default count is tested below.
    assert_fp32_close(run_kernel(*case, torch.float32, num_splits=2), *case, seed)


@pytest.mark.parametrize("batch", [1, 2])
def test_small_batches(batch):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 120, (batch,), generator=gen).tolist()
    case = make_case(lens, 4, 8, 2, 32, 128, True, gen)
    assert_fp32_close(run_kernel(*case, torch.float32), *case, seed)


@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
def test_many_queries_span_several_row_tiles(tree):
    # 33 tokens x 4 heads per group = 132 rows: three 64-row tiles, the last one partial.
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    case = make_case([0, 90], 33, 8, 2, 16, 128, tree, gen)
    assert_fp32_close(run_kernel(*case, torch.float32), *case, seed)


def test_query_that_sees_nothing_gets_zeros():
    # Not a tree mask (a tree node always sees itself), but the contract holds for any mask.
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    q, k, v, lens, mask = make_case([0, 40], 4, 4, 4, 16, 64, True, gen)
    mask[:, 2] = False
    out = run_kernel(q, k, v, lens, mask, torch.float32)
    assert (out[0, 2] == 0).all(), f"seed={seed}"
    assert_fp32_close(out, q, k, v, lens, mask, seed)


@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 16])
def test_num_splits(num_splits, tree):
    # capacity 200 in 64-slot blocks: 16 splits leave most chunks past the capacity, and the
    # short row (length 3 + 4 new) leaves every split but the first with an empty range.
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    case = make_case([190 - 4, 3], 4, 8, 2, 16, 200, tree, gen)
    assert_fp32_close(run_kernel(*case, torch.float32, num_splits=num_splits), *case, seed)


@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_error_bounded_by_pytorch(dtype, tree):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    case = make_case([0, 150, -1], 9, 8, 2, 64, 200, tree, gen)
    out = run_kernel(*case, dtype)
    assert out.dtype == dtype
    assert_low_precision_close(out, *case, dtype, seed)


@pytest.mark.parametrize("block_rows", [16, 64])
def test_fixed_tile_height_matches_reference(block_rows):
    """A fixed tile height (batch-invariant mode): 9 tokens x 4 heads per KV head take three
    16-row tiles, or one 64-row tile mostly padding; both are the reference attention."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    case = make_case([0, 37, -1], 9, 8, 2, 16, 96, True, gen)
    assert_fp32_close(run_kernel(*case, torch.float32, num_splits=2, block_rows=block_rows), *case, seed)


def test_rejects_bad_inputs():
    q = torch.zeros(1, 2, 4, 16)
    k = torch.zeros(1, 2, 64, 16)
    lens = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(TypeError, match="share a dtype"):
        cache_attention(q, k.half(), k.half(), lens)
    with pytest.raises(TypeError, match="int64"):
        cache_attention(q, k, k, lens.int())
    with pytest.raises(TypeError, match="tree_mask"):
        cache_attention(q, k, k, lens, torch.ones(1, 2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="multiple of KV heads"):
        cache_attention(q, torch.zeros(1, 3, 64, 16), torch.zeros(1, 3, 64, 16), lens)
    with pytest.raises(ValueError, match="power of two"):
        cache_attention(torch.zeros(1, 2, 4, 24), torch.zeros(1, 2, 64, 24), torch.zeros(1, 2, 64, 24), lens)
    with pytest.raises(ValueError, match="num_splits"):
        cache_attention(q, k, k, lens, num_splits=0)
    with pytest.raises(ValueError, match="block_rows must be 16, 32 or 64"):
        cache_attention(q, k, k, lens, block_rows=8)


@pytest.mark.gpu
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
def test_cuda_matches_reference_and_replays_in_graph(tree):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    lens = [0, 1500, 37, -1]
    case = make_case(lens, 9, 32, 8, 128, 2048, tree, gen)
    assert_fp32_close(run_kernel(*case, torch.float32, "cuda"), *case, seed)
    assert_low_precision_close(run_kernel(*case, torch.bfloat16, "cuda"), *case, torch.bfloat16, seed)

    # Capture once, then replay with new lengths and queries written into the static inputs.
    q, k, v, lens, mask = case
    static = [t.to("cuda", torch.bfloat16) for t in (q, k, v)] + [lens.cuda(), None if mask is None else mask.cuda()]
    cache_attention(*static)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cache_attention(*static)
    static[0].copy_(torch.randn(q.shape, generator=gen).to("cuda", torch.bfloat16))
    static[3].copy_(torch.tensor([700, -1, 0, 2000]))
    graph.replay()
    eager = cache_attention(*static)
    assert torch.equal(captured, eager), f"seed={seed}: graph replay differs from an eager launch"
    assert (captured[1] == 0).all(), f"seed={seed}: the newly padded row must be zeros after replay"
