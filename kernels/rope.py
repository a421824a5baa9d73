"""Rotary embedding of q and k, fused with the KV-cache write (Triton), with its PyTorch reference.

From the fused qkv projection of n new tokens per row, one launch
  * rotates each query head and returns q [B, n, Hq, D];
  * rotates each key head and stores it at cache slot lengths[b] + j of its row;
  * stores each value head at the same slot.
A negative slot wraps to the end of the row (slot + S), as PyTorch indexing does: the CUDA-graph
runner's padded rows have length -1 and write their entries at the last slots (graphs.py).

Rotation, as in transformers' Llama (rotate_half): with freq = position * inv_freq[i mod D/2],
cos / sin computed in fp32, scaled by the model's attention scaling and rounded to the
activation dtype, y = x * cos + rotate_half(x) * sin, each product rounded to the activation
dtype before the sum — the same roundings as the native runner's PyTorch path.

Why a kernel: the PyTorch path costs about 15 launches per layer (two rotations, two indexed
cache writes and their index arithmetic); this is one.
"""
import torch
import triton
import triton.language as tl

from .rounding import round_to


@triton.jit
def _rope_cache_kernel(qkv_ptr, pos_ptr, inv_freq_ptr, lens_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                       n, capacity, scaling, stride_row, stride_head, stride_slot,
                       Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)  # b * n + j
    head = tl.program_id(1)  # q heads, then k heads, then v heads
    row = token // n
    cols = tl.arange(0, HEAD_DIM)
    half: tl.constexpr = HEAD_DIM // 2
    src = qkv_ptr + token * ((Q_HEADS + 2 * KV_HEADS) * HEAD_DIM) + head * HEAD_DIM
    x = tl.load(src + cols)
    if head < Q_HEADS + KV_HEADS:
        partner = tl.load(src + tl.where(cols < half, cols + half, cols - half)).to(tl.float32)
        rotated = tl.where(cols < half, -partner, partner)  # negated in fp32: exact, and the interpreter
        # cannot negate bf16 (it stores it as uint16)
        freq = tl.load(pos_ptr + token).to(tl.float32) * tl.load(inv_freq_ptr + cols % half)
        cos = round_to(tl.cos(freq) * scaling, x.dtype).to(tl.float32)
        sin = round_to(tl.sin(freq) * scaling, x.dtype).to(tl.float32)
        first = round_to(x.to(tl.float32) * cos, x.dtype).to(tl.float32)
        second = round_to(rotated * sin, x.dtype).to(tl.float32)
        y = round_to(first + second, x.dtype)
    else:
        y = x
    if head < Q_HEADS:
        tl.store(q_ptr + token * (Q_HEADS * HEAD_DIM) + head * HEAD_DIM + cols, y)
    else:
        slot = tl.load(lens_ptr + row) + token % n
        slot = tl.where(slot < 0, slot + capacity, slot)
        kv_head = (head - Q_HEADS) % KV_HEADS
        dst = row * stride_row + kv_head * stride_head + slot * stride_slot + cols
        if head < Q_HEADS + KV_HEADS:
            tl.store(k_cache_ptr + dst, y)
        else:
            tl.store(v_cache_ptr + dst, y)


def _check(qkv, positions, k_cache, v_cache, lengths, q_heads, kv_heads, head_dim):
    b, n, width = qkv.shape
    if width != (q_heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"qkv's last dimension must be (q_heads + 2 * kv_heads) * head_dim = "
                         f"{(q_heads + 2 * kv_heads) * head_dim}, got {width}")
    if positions.shape != (b, n) or lengths.shape != (b,):
        raise ValueError(f"positions must be [{b}, {n}] and lengths [{b}], got {tuple(positions.shape)} and "
                         f"{tuple(lengths.shape)}")
    expected = (b, kv_heads, k_cache.shape[2], head_dim)
    if tuple(k_cache.shape) != expected or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache and v_cache must both be [{b}, {kv_heads}, S, {head_dim}] with equal strides, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.stride(3) != 1 or k_cache.dtype != qkv.dtype:
        raise ValueError("the caches must be contiguous along head_dim and have qkv's dtype")


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                   q_heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """qkv [B, n, (Hq + 2 Hkv) * D] (fp32 / bf16 / fp16), positions [B, n] int64, inv_freq [D/2]
    fp32, k_cache / v_cache [B, Hkv, S, D] (one layer), lengths [B] int64. D: a power of two.
    Writes k and v into the caches at slots lengths[b] + j; returns the rotated q [B, n, Hq, D]."""
    _check(qkv, positions, k_cache, v_cache, lengths, q_heads, kv_heads, head_dim)
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    b, n, _ = qkv.shape
    q = torch.empty(b, n, q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if b * n:
        _rope_cache_kernel[(b * n, q_heads + 2 * kv_heads)](
            qkv.contiguous(), positions.contiguous(), inv_freq.contiguous(), lengths, q, k_cache, v_cache,
            n, k_cache.shape[2], float(scaling), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            Q_HEADS=q_heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, num_warps=1 if head_dim <= 64 else 2)
    return q


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    """cos, sin [B, n, 1, D] in `dtype` (broadcast over heads), as transformers computes them."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scaling).to(dtype)[:, :, None, :], (emb.sin() * scaling).to(dtype)[:, :, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def rope_and_cache_ref(qkv, positions, inv_freq, scaling, k_cache, v_cache, lengths, q_heads, kv_heads, head_dim):
    """The PyTorch reference (the native runner's unfused path); same arguments and effects."""
    _check(qkv, positions, k_cache, v_cache, lengths, q_heads, kv_heads, head_dim)
    b, n, _ = qkv.shape
    cos, sin = rope_tables(positions, inv_freq, scaling, qkv.dtype)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    slots = lengths[:, None] + torch.arange(n, device=qkv.device)[None, :]
    rows = torch.arange(b, device=qkv.device)[:, None]
    k_cache[rows, :, slots] = rotate(k.view(b, n, kv_heads, head_dim), cos, sin)
    v_cache[rows, :, slots] = v.view(b, n, kv_heads, head_dim)
    return rotate(q.view(b, n, q_heads, head_dim), cos, sin)
