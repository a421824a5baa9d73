"""Rounding to the activation dtype inside Triton kernels, identical on the GPU and in the interpreter.

Triton rounds fp32 -> bf16 to nearest-even on the GPU, but its interpreter (the CPU test path)
truncates. Kernels whose roundings must reproduce PyTorch's step by step (rmsnorm.py, rope.py)
round through `round_to`, which does round-to-nearest-even on the fp32 bits first, so the final
cast is exact everywhere. fp32 and fp16 casts are already correct in both.
"""
import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 x rounded to `dtype` (nearest, ties to even), returned in `dtype`."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        # a NaN stays one (a quiet one, which the final cast keeps): the carry would turn GPUs'
        # canonical NaN 0x7FFFFFFF into -0.0, and truncation 0x7F800001 into inf
        x = tl.where(x != x, float("nan"), bits.to(tl.float32, bitcast=True))
    return x.to(dtype)
