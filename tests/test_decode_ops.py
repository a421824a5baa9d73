"""csd_engine's CPU layer ops (csrc/decode_cpu.cpp: ops.add_rmsnorm, rope_and_cache,
decode_attention, silu_mul) against their PyTorch references: the same roundings (one unit of
the last place where only an fp32 sum's order differs), rows computed alone, nothing outside a
row's visible slots read or written, clear errors (tests/test_cpu_isa.py reruns them with every
instruction set compiled)."""
import pytest
import torch
import torch.nn.functional as F

from csd_engine import ops
from csd_engine.kernels.mask import attention_mask
from csd_engine.kernels.rmsnorm import add_rmsnorm_ref
from csd_engine.kernels.rope import rope_and_cache_ref
from csd_engine.models.llama import silu_mul_ref
from tests.stats import fresh_seed

pytestmark = pytest.mark.skipif(not ops.cpu_layer_ops_run(), reason="csd_engine._C has no CPU layer ops")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def ulp(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The spacing of `dtype` (default x's) at |x| (normal range), in float64."""
    info = torch.finfo(dtype or x.dtype)
    mag = x.double().abs().clamp(min=info.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * info.eps


def assert_within_ulps(ours, ref, ulps=1, context=""):
    err = (ours.double() - ref.double()).abs()
    bound = ulps * torch.maximum(ulp(ours), ulp(ref))
    assert (err <= bound).all(), f"{context}: worst {(err - bound).max().item():.3g} over {ulps} ulp"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 896), (3, 2, 37), (4, 1536)])
def test_add_rmsnorm_is_the_reference(dtype, shape):
    g = torch.Generator().manual_seed(fresh_seed())
    h, delta = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    weight = torch.randn(shape[-1], generator=g).to(dtype)
    out, summed = ops.add_rmsnorm(h, weight, 1e-6, delta)
    ref, ref_sum = add_rmsnorm_ref(h, weight, 1e-6, delta)
    assert torch.equal(summed, ref_sum)  # one rounding of an exact sum
    # Only the order of the fp32 sum of squares differs. Each order is within n u of the exact sum
    # (u = 2^-24), so the two mean squares differ by at most 2 n u relative, their inverse roots by
    # n u, and fp32 outputs by that plus two roundings; in bf16 / fp16 that moves a rounding by one unit.
    for ours, want in ((out, ref), (ops.add_rmsnorm(h, weight, 1e-6)[0], add_rmsnorm_ref(h, weight, 1e-6)[0])):
        if dtype == torch.float32:
            torch.testing.assert_close(ours, want, rtol=shape[-1] * 2.0 ** -24 + 2 * 2.0 ** -23, atol=0)
        else:
            assert_within_ulps(ours, want, ulps=2)
    assert ops.add_rmsnorm(h, weight, 1e-6)[1] is h


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 6), (14, 2, 64), (12, 2, 128)])
def test_rope_and_cache_is_the_reference(dtype, heads, kv_heads, dim):
    """Ragged rows, several tokens per row and a negative length (wraps to the row's end, as the
    graph runner's padded rows do); every other cache slot is left as it was."""
    g = torch.Generator().manual_seed(fresh_seed())
    b, n, capacity = 3, 3, 40
    qkv = torch.randn(b, n, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    lengths = torch.tensor([0, 17, -2])  # the last row writes slots S - 2, S - 1 and 0
    positions = torch.tensor([[0, 1, 2], [17, 18, 19], [900, 901, 902]])
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
    caches = [torch.randn(b, kv_heads, capacity, dim, generator=g).to(dtype) for _ in range(2)]
    ours_k, ours_v, ref_k, ref_v = (c.clone() for c in caches + caches)
    q = ops.rope_and_cache(qkv, positions, inv_freq, 1.25, ours_k, ours_v, lengths, heads, kv_heads, dim)
    ref_q = rope_and_cache_ref(qkv, positions, inv_freq, 1.25, ref_k, ref_v, lengths, heads, kv_heads, dim)
    # cos / sin come from another fp32 libm, so a rounding of them may flip: the difference is
    # within a few units of the terms' magnitude (the result may cancel), and rare
    terms = qkv.double().abs().amax() * 1.25
    for ours, ref, name in ((q, ref_q, "q"), (ours_k, ref_k, "k cache")):
        err = (ours.double() - ref.double()).abs().max().item()
        assert err <= 4 * ulp(terms, dtype).item(), f"{name}: {err:.3g}"
        if dtype != torch.float32:  # fp32 keeps the libm's and the compiler's last bits
            assert (ours == ref).double().mean() > 0.98, f"{name}: {(ours != ref).double().mean():.3f} differ"
    assert torch.equal(ours_v, ref_v)


def _attention_case(g, dtype, b, heads, kv_heads, dim, lengths, n=1, capacity=320):
    q = torch.randn(b, n, heads, dim, generator=g).to(dtype)
    # a layer's view of a [layers, rows, kv_heads, S, D] cache: rows are not adjacent in memory
    k, v = (torch.randn(2, b + 1, kv_heads, capacity, dim, generator=g).to(dtype)[1, :b] for _ in range(2))
    return q, k, v, torch.tensor(lengths)


def attention_ref(q, k, v, lengths, tree_mask=None):
    """float64 attention of q [B, n, Hq, D] over the cache, token t of row b seeing what
    attention_mask says: slots 0..lengths[b] + t, or the prefix and its tree_mask row."""
    b, n, hq, d = q.shape
    group = hq // k.shape[1]
    keys, values = (t.double().repeat_interleave(group, dim=1) for t in (k, v))  # [B, Hq, S, D]
    scores = torch.einsum("bnhd,bhsd->bhns", q.double(), keys) * d ** -0.5
    scores = scores.masked_fill(~attention_mask(lengths, n, k.shape[2], tree_mask), float("-inf"))
    return torch.einsum("bhns,bhsd->bnhd", torch.softmax(scores, dim=-1), values)


# Two rows' trees of 9 nodes (parents; -1: a child of the committed prefix), in the engine's
# layout (every parent before its children)
TREE_PARENTS = [[-1, 0, 0, 1, 1, 2, 3, 4, 5], [-1, 0, 1, 2, 0, 4, 4, 6, 7]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 16), (14, 2, 64), (12, 2, 128), (6, 3, 80)])
@pytest.mark.parametrize("n", [1, 5])
def test_decode_attention_is_causal_attention(dtype, heads, kv_heads, dim, n):
    """Against float64 attention: token t of row b over slots 0..lengths[b] + t; slots after a
    row's last new token hold NaN and must not be read."""
    g = torch.Generator().manual_seed(fresh_seed())
    q, k, v, lengths = _attention_case(g, dtype, 4, heads, kv_heads, dim, [0, 5, 47, 300], n=n)
    for row, length in enumerate(lengths.tolist()):
        k[row, :, length + n:] = float("nan")
        v[row, :, length + n:] = float("nan")
    ours = ops.decode_attention(q, k, v, lengths)
    ref = attention_ref(q, k.nan_to_num(), v.nan_to_num(), lengths)
    assert ours.dtype == dtype and ours.shape == q.shape
    # fp32 sums of at most 305 terms of magnitude <= max|v|, then one rounding to the dtype
    fp32_error = 320 * 2.0 ** -24 * v.double().nan_to_num().abs().amax()
    err = (ours.double() - ref).abs()
    bound = fp32_error + ulp(ref, dtype)
    assert (err <= bound).all(), f"worst {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(14, 2, 64), (6, 3, 80)])
def test_decode_attention_with_a_tree_is_tree_attention(dtype, heads, kv_heads, dim):
    """With tree_mask, node t sees the prefix, its ancestors and itself (attention_mask's tree
    rule), against float64; slots after the tree hold NaN and must not be read."""
    g = torch.Generator().manual_seed(fresh_seed())
    n = len(TREE_PARENTS[0])
    q, k, v, lengths = _attention_case(g, dtype, 2, heads, kv_heads, dim, [40, 3], n=n)
    mask = ops.build_tree_mask(torch.tensor(TREE_PARENTS))[0]
    for row, length in enumerate(lengths.tolist()):
        k[row, :, length + n:] = float("nan")
        v[row, :, length + n:] = float("nan")
    ours = ops.decode_attention(q, k, v, lengths, mask)
    ref = attention_ref(q, k.nan_to_num(), v.nan_to_num(), lengths, mask)
    fp32_error = 320 * 2.0 ** -24 * v.double().nan_to_num().abs().amax()
    err = (ours.double() - ref).abs()
    assert (err <= fp32_error + ulp(ref, dtype)).all(), f"worst {(err - fp32_error - ulp(ref, dtype)).max().item():.3g}"


@pytest.mark.parametrize("heads,kv_heads,dim", [(14, 2, 64), (12, 2, 128), (6, 3, 80)])
def test_a_tree_node_is_computed_as_a_lone_token_after_its_ancestors(heads, kv_heads, dim):
    """Bit for bit: node t of a tree equals one token whose cache holds the prefix and then its
    ancestors at consecutive slots, what plain decoding has once they are accepted (the prefix
    spans key blocks: 40 and 70 committed slots)."""
    g = torch.Generator().manual_seed(fresh_seed())
    n = len(TREE_PARENTS[0])
    q, k, v, lengths = _attention_case(g, torch.bfloat16, 2, heads, kv_heads, dim, [40, 70], n=n)
    mask = ops.build_tree_mask(torch.tensor(TREE_PARENTS))[0]
    together = ops.decode_attention(q, k, v, lengths, mask)
    for row in range(2):
        length = int(lengths[row])
        for t in range(n):
            path = mask[row, t].nonzero()[:, 0]  # its ancestors and itself, in slot order
            kc, vc = k[row:row + 1].clone(), v[row:row + 1].clone()
            kc[:, :, length:length + len(path)] = k[row:row + 1, :, length + path]
            vc[:, :, length:length + len(path)] = v[row:row + 1, :, length + path]
            alone = ops.decode_attention(q[row:row + 1, t:t + 1], kc, vc, torch.tensor([length + len(path) - 1]))
            assert torch.equal(alone, together[row:row + 1, t:t + 1]), f"row {row}, node {t}"


@pytest.mark.parametrize("heads,kv_heads,dim", [(14, 2, 64), (12, 2, 128), (6, 3, 80), (66, 1, 64)])
def test_decode_attention_computes_every_token_and_row_alone(heads, kv_heads, dim):
    """Bit for bit: a row's output is the same alone or in a batch, and token t of a call with n
    tokens is the same as a call with that token alone at its position (lengths + t): a token's
    logits do not depend on the forward's width (greedy speculative decoding relies on it on
    the CPU). A padded row (length -1) gets zeros."""
    g = torch.Generator().manual_seed(fresh_seed())
    n = 9
    q, k, v, lengths = _attention_case(g, torch.bfloat16, 4, heads, kv_heads, dim, [3, 200, 31, -1], n=n)
    together = ops.decode_attention(q, k, v, lengths)
    assert (together[3] == 0).all()
    for row in range(3):
        alone = ops.decode_attention(q[row:row + 1], k[row:row + 1], v[row:row + 1], lengths[row:row + 1])
        assert torch.equal(alone, together[row:row + 1])
        for t in range(n):
            one = ops.decode_attention(q[row:row + 1, t:t + 1], k[row:row + 1], v[row:row + 1], lengths[row:row + 1] + t)
            assert torch.equal(one, together[row:row + 1, t:t + 1]), f"row {row}, token {t}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_the_reference(dtype):
    g = torch.Generator().manual_seed(fresh_seed())
    gate_up = torch.randn(3, 2, 2 * 300, generator=g) * 6
    gate_up[0, 0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 80.0, -80.0, 200.0, -200.0])
    gate_up = gate_up.to(dtype)
    ours, ref = ops.silu_mul(gate_up), silu_mul_ref(gate_up)
    assert ours.shape == ref.shape == (3, 2, 300)
    if dtype == torch.float32:  # an exp within 2 fp32 ulp and a division: a few ulp
        assert_within_ulps(ours, ref, ulps=8)
    else:  # silu(gate) rounded to the dtype may flip one ulp at a near-tie, which up scales;
        # then each rounds the product once (seed 1553890250, float16: 2 ulp of the product)
        gate, up = gate_up.chunk(2, dim=-1)
        silu = torch.nn.functional.silu(gate.double())
        bound = ulp(silu, dtype) * up.double().abs() + torch.maximum(ulp(ours), ulp(ref))
        err = (ours.double() - ref.double()).abs()
        assert (err <= bound).all(), f"worst {(err - bound).max().item():.3g}"


def test_fake_kernels_describe_what_the_ops_return():
    """The ops' meta functions (torch.compile, export) give the real outputs' shapes and strides,
    also for non-contiguous inputs."""
    q = torch.randn(1, 4, 3, 8).transpose(1, 2)  # [1, 3, 4, 8], not contiguous
    k = torch.randn(1, 2, 16, 8)
    torch.library.opcheck(torch.ops.csd_engine.decode_attention, (q, k, k.clone(), torch.tensor([3]), None))
    h = torch.randn(8, 3).t()  # [3, 8], not contiguous
    torch.library.opcheck(torch.ops.csd_engine.add_rmsnorm, (h, torch.randn(8), 1e-6, None))


def test_bad_input_is_refused_clearly():
    h = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"weight must be \[8\] in h's dtype"):
        ops.add_rmsnorm(h, torch.randn(7), 1e-6)
    with pytest.raises(TypeError, match="h must be float32, bfloat16 or float16, got Long"):
        ops.add_rmsnorm(h.long(), torch.randn(8), 1e-6)
    q = torch.randn(1, 1, 4, 8)
    k = torch.randn(1, 2, 16, 8)
    with pytest.raises(ValueError, match=r"row 0's new tokens sit in slots 16..16, past a cache of 16 slots"):
        ops.decode_attention(q, k, k.clone(), torch.tensor([16]))
    with pytest.raises(ValueError, match=r"row 0's new tokens sit in slots 14..16, past a cache of 16 slots"):
        ops.decode_attention(q.expand(1, 3, 4, 8), k, k.clone(), torch.tensor([14]))
    with pytest.raises(ValueError, match=r"q must be \[B, n, q_heads, head_dim\]"):
        ops.decode_attention(q[0], k, k.clone(), torch.tensor([3]))
    with pytest.raises(ValueError, match="must be a multiple of kv_heads"):
        ops.decode_attention(torch.randn(1, 1, 3, 8), k, k.clone(), torch.tensor([3]))
    with pytest.raises(ValueError, match=r"tree_mask must be bool \[1, 1, 1\], got Long \[1, 1, 1\]"):
        ops.decode_attention(q, k, k.clone(), torch.tensor([3]), torch.ones(1, 1, 1, dtype=torch.long))
    qkv = torch.randn(1, 2, 8 * 8)
    with pytest.raises(ValueError, match="writes slots -17..-16 of a cache of 16"):
        ops.rope_and_cache(qkv, torch.zeros(1, 2, dtype=torch.long), torch.ones(4), 1.0, k, k.clone(),
                           torch.tensor([-17]), 4, 2, 8)
    with pytest.raises(ValueError, match="writes slots 15..16 of a cache of 16"):
        ops.rope_and_cache(qkv, torch.zeros(1, 2, dtype=torch.long), torch.ones(4), 1.0, k, k.clone(),
                           torch.tensor([15]), 4, 2, 8)
    with pytest.raises(ValueError, match="last dimension must be even"):
        ops.silu_mul(torch.randn(2, 7))
    # a length that would wrap when n is added to it is refused, never written or read through
    huge = torch.tensor([2 ** 63 - 1])
    guard = torch.zeros(3, 1, 2, 16, 8)
    with pytest.raises(ValueError, match="writes slots"):
        ops.rope_and_cache(qkv, torch.zeros(1, 2, dtype=torch.long), torch.ones(4), 1.0, guard[1], guard[1].clone(),
                           huge, 4, 2, 8)
    assert not guard.any(), "rope_and_cache wrote outside its cache"
    with pytest.raises(ValueError, match="past a cache of 16 slots"):
        ops.decode_attention(q.expand(1, 2, 4, 8), k, k.clone(), huge)
    # a wrong dtype is named
    with pytest.raises(ValueError, match=r"lengths must be int64 \[1\], got Int \[1\]"):
        ops.decode_attention(q, k, k.clone(), torch.tensor([3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"in q's dtype \(Float\).*got BFloat16"):
        ops.decode_attention(q, k.bfloat16(), k.bfloat16(), torch.tensor([3]))
    # the ops (and the engine's runners) work as before after a refusal
    assert ops.decode_attention(q, k, k.clone(), torch.tensor([3])).shape == q.shape
