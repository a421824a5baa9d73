"""Attention of a few new query tokens per row over the static KV cache (flash-decoding).

Serves decoding (n = 1), chain verification (n = k + 1) and tree verification (n nodes under
a tree mask). The new tokens' keys/values are already in the cache at slots
`cache_lens[b] .. cache_lens[b] + n - 1`, so every query reads one contiguous slot range
`[0, cache_lens[b] + n)` of its row and masks only among the new tokens.

Phase 1 splits that range into chunks so that even one sequence fills the GPU: program
(row * kv_heads + kv_head, split, query block) computes, for the new tokens x query heads of
one KV head group (all of them unless n * group > MAX_BLOCK_ROWS), the running max, the
softmax denominator and the unnormalised output over its chunk. Phase 2 merges the partials
of each query with a log-sum-exp merge. The grids depend on static shapes only (batch,
capacity, n), never on `cache_lens`, so a launch can be captured in a CUDA graph and
replayed with new lengths; programs whose chunk starts past their row's valid length exit
at once.
"""
import functools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .mask import attention_mask

BLOCK_N = 64  # keys per inner step; chunks are whole multiples of it
MAX_BLOCK_ROWS = 64  # (query token, head) rows per tile in phase 1
PROGRAMS_PER_SM = 4
FALLBACK_SM_COUNT = 132  # H100 SXM, used when the tensors are not on a CUDA device
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _dot_operand(x, UPCAST: tl.constexpr):
    # Triton's interpreter (CPU) multiplies the raw bits of bf16 dot operands (triton#11584);
    # there the values go through fp32, which holds every bf16/fp16 value exactly.
    if UPCAST:
        x = x.to(tl.float32)
    return x  # one return: Triton's compiler refuses returns of two types


@triton.jit
def _attention_split_kernel(q_ptr, k_ptr, v_ptr, lens_ptr, tree_ptr, max_ptr, den_ptr, acc_ptr,
                  stride_qb, stride_qn, stride_qh, stride_qd,
                  stride_kb, stride_kh, stride_ks, stride_kd,
                  stride_vb, stride_vh, stride_vs, stride_vd,
                  stride_tb, stride_ti, stride_tj,
                  n, kv_heads, capacity, chunk, qk_scale,
                  GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_ROWS: tl.constexpr, BLOCK_KEYS: tl.constexpr, HAS_TREE: tl.constexpr,
                  UPCAST_DOTS: tl.constexpr):
    pid_bh = tl.program_id(0).to(tl.int64)  # b * stride_kb and the partials' offsets pass 2**31 at real sizes
    split = tl.program_id(1)
    b = pid_bh // kv_heads
    kv_head = pid_bh % kv_heads
    cache_len = tl.load(lens_ptr + b)
    start = split * chunk
    end = tl.minimum(tl.minimum(start + chunk, cache_len + n), capacity)
    if (cache_len < 0) | (start >= end):
        return  # padded row or a chunk past this row's valid length: phase 2 skips it

    # Row r is query token r // GROUP of head kv_head * GROUP + r % GROUP: the heads of a
    # group share every key, so one tile serves them all.
    rows = tl.program_id(2) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < ROWS
    query = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    if not HAS_TREE:
        # Causal: no query of this block sees a new token after its last query (this matters
        # when a long prompt goes through here, not for a few verified tokens).
        last_query = tl.minimum(tl.max(query, axis=0), n - 1)
        end = tl.minimum(end, cache_len + last_query + 1)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + query[:, None] * stride_qn + head[:, None] * stride_qh
                + dims[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
    q = _dot_operand(q, UPCAST_DOTS)
    k_base = k_ptr + b * stride_kb + kv_head * stride_kh + dims[None, :] * stride_kd
    v_base = v_ptr + b * stride_vb + kv_head * stride_vh + dims[None, :] * stride_vd
    run_max = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)  # log2 domain
    den = tl.zeros([BLOCK_ROWS], tl.float32)
    acc = tl.zeros([BLOCK_ROWS, HEAD_DIM], tl.float32)
    for key0 in range(start, end, BLOCK_KEYS):
        slots = key0 + tl.arange(0, BLOCK_KEYS)
        in_range = slots < end
        k = _dot_operand(tl.load(k_base + slots[:, None] * stride_ks, mask=in_range[:, None], other=0.0),
                         UPCAST_DOTS)
        v = _dot_operand(tl.load(v_base + slots[:, None] * stride_vs, mask=in_range[:, None], other=0.0),
                         UPCAST_DOTS)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        new = slots - cache_len  # index among the new tokens; negative = committed prefix
        if HAS_TREE:
            sees_new = tl.load(tree_ptr + b * stride_tb + query[:, None] * stride_ti + new[None, :] * stride_tj,
                               mask=row_ok[:, None] & (new[None, :] >= 0) & (new[None, :] < n), other=0) != 0
        else:
            sees_new = new[None, :] <= query[:, None]
        visible = in_range[None, :] & ((new[None, :] < 0) | sees_new)
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(scores, axis=1))
        # A query may see nothing in this block (or chunk): keep exp2 away from -inf - -inf.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp2(run_max - safe_max)
        p = tl.exp2(scores - safe_max[:, None])
        den = den * rescale + tl.sum(p, axis=1)
        # p rounds to the cache dtype for a tensor-core dot, as flash attention does.
        p = _dot_operand(p.to(v_ptr.dtype.element_ty), UPCAST_DOTS)
        acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
        run_max = new_max
    partial = (pid_bh * tl.num_programs(1) + split) * ROWS + rows
    tl.store(max_ptr + partial, run_max, mask=row_ok)
    tl.store(den_ptr + partial, den, mask=row_ok)
    tl.store(acc_ptr + partial[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _attention_merge_kernel(lens_ptr, max_ptr, den_ptr, acc_ptr, out_ptr,
                  stride_ob, stride_on, stride_oh, stride_od,
                  n, kv_heads, capacity, chunk, num_splits,
                  GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    pid_bh = tl.program_id(0).to(tl.int64)  # as in phase 1: the partials' offsets pass 2**31 at real sizes
    rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < ROWS
    b = pid_bh // kv_heads
    head = (pid_bh % kv_heads) * GROUP + rows % GROUP
    dims = tl.arange(0, HEAD_DIM)
    out = (out_ptr + b * stride_ob + (rows // GROUP)[:, None] * stride_on + head[:, None] * stride_oh
           + dims[None, :] * stride_od)
    cache_len = tl.load(lens_ptr + b)
    if cache_len < 0:
        zeros = tl.zeros([BLOCK_ROWS, HEAD_DIM], tl.float32)
        tl.store(out, zeros.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        return

    # The same rule as phase 1 says which splits ran, so no partial is read uninitialised.
    valid_splits = tl.cdiv(tl.minimum(cache_len + n, capacity), chunk)
    run_max = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_ROWS], tl.float32)
    acc = tl.zeros([BLOCK_ROWS, HEAD_DIM], tl.float32)
    for split in range(0, valid_splits):
        partial = (pid_bh * num_splits + split) * ROWS + rows
        part_max = tl.load(max_ptr + partial, mask=row_ok, other=float("-inf"))
        part_den = tl.load(den_ptr + partial, mask=row_ok, other=0.0)
        part_acc = tl.load(acc_ptr + partial[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None], other=0.0)
        new_max = tl.maximum(run_max, part_max)
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        weight = tl.exp2(part_max - safe_max)
        rescale = tl.exp2(run_max - safe_max)
        den = den * rescale + weight * part_den
        acc = acc * rescale[:, None] + weight[:, None] * part_acc
        run_max = new_max
    # A query that sees no key at all (an empty tree-mask row on an empty prefix) has
    # acc = den = 0 and gets zeros.
    result = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(out, result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return FALLBACK_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def _default_num_splits(tiles: int, capacity: int, device: torch.device) -> int:
    """Splits of the KV range so that `tiles` (row, KV head, query block) tiles make about
    PROGRAMS_PER_SM programs per SM, each split keeping at least one key block."""
    wanted = triton.cdiv(_sm_count(device) * PROGRAMS_PER_SM, tiles)
    return max(1, min(wanted, triton.cdiv(capacity, BLOCK_N)))


def _check_inputs(q, k_cache, v_cache, cache_lens, tree_mask) -> None:
    if q.dim() != 4 or k_cache.dim() != 4:
        raise ValueError(f"q must be [B, n, Hq, D] and k_cache [B, Hkv, S, D], "
                         f"got {tuple(q.shape)} and {tuple(k_cache.shape)}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q, k_cache, v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    batch, n, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if v_cache.shape != k_cache.shape or k_cache.shape[0] != batch or k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache and v_cache must both be [B={batch}, Hkv, S, D={head_dim}], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if q_heads % kv_heads != 0:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    if n < 1:
        raise ValueError("q must hold at least one new token per row")
    if cache_lens.dtype != torch.int64 or cache_lens.shape != (batch,):
        raise TypeError(f"cache_lens must be int64 of shape [{batch}], "
                        f"got {cache_lens.dtype} {tuple(cache_lens.shape)}")
    if tree_mask is not None and (tree_mask.dtype != torch.bool or tree_mask.shape != (batch, n, n)):
        raise TypeError(f"tree_mask must be bool of shape [{batch}, {n}, {n}], "
                        f"got {tree_mask.dtype} {tuple(tree_mask.shape)}")
    tensors = [q, k_cache, v_cache, cache_lens] + ([] if tree_mask is None else [tree_mask])
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all inputs must be on one device, got {[str(t.device) for t in tensors]}")


def cache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_lens: torch.Tensor,
                    tree_mask: torch.Tensor | None = None, scale: float | None = None,
                    num_splits: int | None = None, block_rows: int | None = None) -> torch.Tensor:
    """Attention of n new tokens per row over their row's cache prefix and each other.

    q           [B, n, Hq, D]   fp32 / bf16 / fp16; D a power of two in 16..128
    k_cache     [B, Hkv, S, D]  same dtype, Hq % Hkv == 0 (grouped-query attention);
    v_cache     [B, Hkv, S, D]  the new tokens' entries already at slots cache_lens[b] + j
    cache_lens  [B] int64       committed prefix length per row; < 0 marks a padded row
                                (zeros out, nothing read). Caller keeps cache_lens[b] + n <= S.
    tree_mask   [B, n, n] bool  new token i sees new token j iff tree_mask[b, i, j];
                                None = causal (j <= i). Prefix slots are always visible.
    scale       softmax scale, default 1 / sqrt(D)
    num_splits  chunks of the KV range per (row, KV head); default fills the GPU
    block_rows  (query token, head) rows per tile, a power of two in 16..64; default the
                smallest that holds n x group rows. Fixing it keeps a row's arithmetic the same
                at any step width (BLAS and MMA tiles can reduce in another order by tile size).
    returns     [B, n, Hq, D] in q's dtype, accumulated in fp32.
    """
    _check_inputs(q, k_cache, v_cache, cache_lens, tree_mask)
    batch, n, q_heads, head_dim = q.shape
    if q.dtype not in DTYPES:
        raise TypeError(f"q dtype {q.dtype} not supported; allowed: {DTYPES}")
    if head_dim < 16 or head_dim > 128 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two in 16..128 (tl.dot needs >= 16), got {head_dim}")
    kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    rows = n * group
    if scale is None:
        scale = head_dim ** -0.5
    if block_rows is None:
        block_rows = min(max(16, triton.next_power_of_2(rows)), MAX_BLOCK_ROWS)  # tl.dot needs >= 16
    elif block_rows not in (16, 32, 64):
        raise ValueError(f"block_rows must be 16, 32 or 64 (powers of two in 16..{MAX_BLOCK_ROWS}), "
                         f"got {block_rows!r}")
    row_blocks = triton.cdiv(rows, block_rows)
    if num_splits is None:
        num_splits = _default_num_splits(batch * kv_heads * row_blocks, capacity, q.device)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    chunk = triton.cdiv(triton.cdiv(capacity, num_splits), BLOCK_N) * BLOCK_N

    partial_shape = (batch * kv_heads, num_splits, rows)
    part_max = torch.empty(partial_shape, dtype=torch.float32, device=q.device)
    part_den = torch.empty(partial_shape, dtype=torch.float32, device=q.device)
    part_acc = torch.empty(partial_shape + (head_dim,), dtype=torch.float32, device=q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if tree_mask is None:
        tree, tree_strides = cache_lens, (0, 0, 0)  # never read: HAS_TREE is off
    else:
        tree, tree_strides = tree_mask.view(torch.uint8), tree_mask.stride()

    _attention_split_kernel[(batch * kv_heads, num_splits, row_blocks)](
        q, k_cache, v_cache, cache_lens, tree, part_max, part_den, part_acc,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *tree_strides,
        n, kv_heads, capacity, chunk, scale * math.log2(math.e),
        GROUP=group, ROWS=rows, HEAD_DIM=head_dim,
        BLOCK_ROWS=block_rows, BLOCK_KEYS=BLOCK_N, HAS_TREE=tree_mask is not None,
        UPCAST_DOTS=q.device.type != "cuda",
        # fp32 tiles take twice the shared memory; one stage keeps them under pre-Hopper limits.
        num_stages=1 if q.dtype == torch.float32 else 3)
    _attention_merge_kernel[(batch * kv_heads, row_blocks)](
        cache_lens, part_max, part_den, part_acc, out, *out.stride(),
        n, kv_heads, capacity, chunk, num_splits,
        GROUP=group, ROWS=rows, HEAD_DIM=head_dim, BLOCK_ROWS=block_rows)
    return out


def cache_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_lens: torch.Tensor,
                        tree_mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """PyTorch twin of `cache_attention`: same shapes and meaning, any float dtype (float64
    included) computed in that dtype; SDPA over the whole cache with the engine's explicit
    visibility mask (`kernels/mask.py`)."""
    _check_inputs(q, k_cache, v_cache, cache_lens, tree_mask)
    n, q_heads = q.shape[1], q.shape[2]
    visible = attention_mask(cache_lens, n, k_cache.shape[2], tree_mask)  # [B, 1, n, S]
    visible = visible & (cache_lens >= 0)[:, None, None, None]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache, v_cache, attn_mask=visible, scale=scale,
                                         enable_gqa=q_heads != k_cache.shape[1])
    # SDPA gives NaN where a query sees nothing; the kernel defines that output as zeros.
    out = torch.where(visible.any(dim=-1, keepdim=True), out, 0.0)
    return out.transpose(1, 2)
