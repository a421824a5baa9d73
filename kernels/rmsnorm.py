"""Fused residual add + RMSNorm (Triton), with its PyTorch reference.

    h   = h + delta                                    (when delta is given; rounded to h's dtype)
    out = weight * (h.float() * rsqrt(mean(h.float()^2) + eps)).to(h.dtype)

The rounding follows transformers' LlamaRMSNorm and the native runner's PyTorch path step by
step: the residual sum is rounded to the activation dtype, the norm is computed in fp32 and
rounded to that dtype, then multiplied by the weight (one more rounding). Only the order of the
fp32 sum of squares differs, so results agree with the reference to float rounding.

Why a kernel: in PyTorch this is 8 launches per norm (add, float, pow, mean, add eps, rsqrt,
mul, cast, mul); the native runner needs two norms per layer, so on a GPU the fused version
removes ~16 tiny kernels per layer from every decoding step (bench/gpu.py `forward_profile`).
One program per token row; the row (the hidden size, <= MAX_HIDDEN) sits in registers.
"""
import torch
import triton
import triton.language as tl

from .rounding import round_to

MAX_HIDDEN = 16384


@triton.jit
def _add_rmsnorm_kernel(h_ptr, delta_ptr, weight_ptr, out_ptr, sum_ptr, hidden, eps,
                        HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < hidden
    h = tl.load(h_ptr + row * hidden + cols, mask=inside, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * hidden + cols, mask=inside, other=0.0)
        h = round_to(h.to(tl.float32) + delta.to(tl.float32), h.dtype)
        tl.store(sum_ptr + row * hidden + cols, h, mask=inside)
    hf = h.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(hf * hf, axis=0) / hidden + eps)
    normed = round_to(hf * inv_rms, h.dtype)
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, round_to(out, out_ptr.dtype.element_ty), mask=inside)


def add_rmsnorm(h: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None):
    """h [..., H] (fp32 / bf16 / fp16, contiguous), weight [H], delta like h or None.
    Returns (normed, h + delta) — the second is h itself when delta is None."""
    hidden = h.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must have shape ({hidden},), got {tuple(weight.shape)}")
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} exceeds MAX_HIDDEN={MAX_HIDDEN}")
    if delta is not None and (delta.shape != h.shape or delta.dtype != h.dtype):
        raise ValueError(f"delta must match h: {tuple(h.shape)} {h.dtype}, got {tuple(delta.shape)} {delta.dtype}")
    h = h.contiguous()
    out = torch.empty(h.shape, dtype=torch.promote_types(h.dtype, weight.dtype), device=h.device)
    summed = torch.empty_like(h) if delta is not None else h
    rows = h.numel() // hidden
    if rows:
        _add_rmsnorm_kernel[(rows,)](h, h if delta is None else delta.contiguous(), weight, out, summed, hidden,
                                     float(eps), HAS_DELTA=delta is not None,
                                     BLOCK=triton.next_power_of_2(hidden), num_warps=4 if hidden <= 4096 else 8)
    return out, summed


def add_rmsnorm_ref(h: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None):
    """The PyTorch reference: the native runner's unfused path."""
    if delta is not None:
        h = h + delta
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return weight * normed, h
