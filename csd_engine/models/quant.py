"""Weight-only quantized linear layers for the native runner, on torch's own packed-weight matmuls.

    values = quantize_values(w, "int4", dtype=torch.bfloat16)   # w: [N, K]; pure PyTorch
    w_hat = dequantize(values)                                 # [N, K] float32: what the matmul multiplies by
    layer = QuantizedLinear(values)                            # packs for torch's op on w's device
    y = linear(x, layer, bias)                                 # x: [..., K] -> [..., N] in x.dtype

Schemes (`SCHEMES`), both rounding to the nearest grid point, so |w - w_hat| <= s / 2 elementwise:
  int8      symmetric, one scale per output row: w_hat = q * s, q in [-127, 127], s = max|w_row| / 127
  int4[gG]  asymmetric, per row and group of G inputs (G = 128 unless gG says 32/64/256):
            w_hat = (q - 8) * s + z, q in [0, 15], s = (max - min) / 15, z = min + 8 s (tinygemm's layout)
Scales and zeros are stored in the activation dtype, as the ops require, and q is rounded against
the stored values; z's rounding can move the int4 grid's ends by u (|z| + 8 s) (u: the dtype's unit
roundoff), which only groups far from zero notice.

What the ops accept (torch 2.13; CPU measured, CUDA read from aten/src/ATen/native/cuda/int{4,8}mm.cu):
  CPU  _weight_int8pack_mm(x, q int8 [N, K], s [N]): x fp32/bf16/fp16, s in x's dtype, any N, K
       _convert_weight_to_int4pack_for_cpu(q int32 [N, K], 1) -> uint8 [N, K/2] (a blocked layout)
       _weight_int4pack_mm_for_cpu(x, packed, G, sz [K/G, N, 2]): x fp32/bf16/fp16, sz in x's dtype,
       G in {32, 64, 128, 256}, K % G == 0, N % 16 == 0
  CUDA _weight_int8pack_mm: any float x, computed in fp32 by a plain one-thread-per-output kernel
       (an H100, bench/gpu.py's 2-layer 7B-shaped drafter: 8.7x bf16's forward at one token, 85x at 40 rows);
       _convert_weight_to_int4pack(uint8 [N, K/2], inner_k_tiles) + _weight_int4pack_mm: x bf16
       only, inner_k_tiles in {2, 4, 8} with K % (16 inner_k_tiles) == 0 (the largest is used), N % 8 == 0
       (same drafter: 0.50x bf16 at one token, 0.68x at 5, 0.89x at 8 rows, 2.9x at 40: dense_rows pays)
  All: x 2-D and contiguous (`QuantizedLinear` flattens the leading dims). fp32 activations work on
  the CPU but are several times slower than the unquantized fp32 model at decode sizes
  (TORCH_CPU_PACKED_SLOWDOWN; the runner warns): quantization is for bf16 models.

Wide calls: the CPU ops handle one row after another, so their time grows with the rows while a
dense bf16 matmul's stays nearly flat up to ~16 rows. `dense_rows=R` keeps the dequantized weight in the
activation dtype as well and sends calls of more than R rows through it (prefill, a drafter
catching up, wide reviews): fast at every width for 1.25x (int4) or 1.5x (int8) the bf16 bytes.
A whole Qwen 0.5B forward (2 cores, ms; bf16 / int4 / int4 with R = 16; bench/forward_cost.py,
docs/measurements.md): 1 token 47 / 15 / 15, 9 tokens 56 / 45 / 49, 17 tokens 69 / 71 / 58, 64 tokens
137 / 223 / 129, 900 tokens 1852 / 3451 / 1866: the crossover of the whole model is near 16 rows.
Its rounding differs from the op's, so a quantized target never uses it (its output is the
quantized model's); drafters do (DRAFTER_DENSE_ROWS). int8 with bf16 activations on an x86 CPU where
csd_engine's bf16 kernel runs takes its int8 twin instead (ops.int8_linear), which without native
bf16 needs no dense copy (with it, a drafter's calls of more than DRAFTER_DENSE_ROWS take the copy).
int4 with bf16 activations on an x86 CPU with AVX2 takes csd_engine's int4 kernel (ops.int4_linear,
groups of 64 inputs or more) in its own packing (pack_int4_for_kernel); drafters keep dense copies
(drafter_dense_rows).
"""
from dataclasses import dataclass

import torch

from csd_engine.ops import (bf16_kernel_max_rows, bf16_kernel_takes, dense_linear, int4_kernel_runs, int4_linear,
                            int8_kernel_runs, int8_linear, kernel_without_native_bf16)

DEFAULT_INT4_GROUP = 128
INT4_GROUPS = (32, 64, 128, 256)
SCHEMES = ("int8", "int4") + tuple(f"int4g{g}" for g in INT4_GROUPS)
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# A forward of a model quantized for float32 or float16 activations on the CPU, where its packed
# matmuls are torch's own ops (csd_engine's kernels take bfloat16), against the same model unquantized
# in that dtype: the Qwen 0.5B's one-token forward in float32, int4 3.65x and int8 1.67x (2-core
# AVX-512 EPYC, 2026-12-01: bench/measured/forward-cost-qwen-0.5b-float32-quantized-cpu-2026-12-01.json;
# 6.4x and 2.8x on one thread; float16 activations take the same ops, unmeasured).
TORCH_CPU_PACKED_SLOWDOWN = {4: 3.65, 8: 1.67}
DRAFTER_DENSE_ROWS = 16  # where the int4 op (and with native bf16 the int8 kernel) falls behind bf16 for a
# whole Qwen 0.5B forward on the CPU


def drafter_dense_rows(device, dtype: torch.dtype, scheme: str | None = None) -> int:
    """Rows above which a quantized drafter's calls (weights of `scheme`) take its dense copy:
    DRAFTER_DENSE_ROWS, but fewer on a CPU without native bf16 where csd_engine's bf16 kernel runs,
    whose cost grows slowly with the rows: 4 for int4 weights on csd_engine's int4 kernel, 2 for
    torch's int4 op. Whole int4 Qwen 0.5B forwards on a 2-core AVX2 EPYC (docs/measurements.md, "int4 on a CPU
    without native bf16"): the kernel 23 / 28 / 38 / 45 ms for 1 to 4 rows, torch's op 38 / 40 for
    1 or 2; the dense copy 47-49 ms from 3 rows, which the kernel exceeds from 5."""
    cpu_kernel = torch.device(device).type == "cpu" and dtype == torch.bfloat16 and kernel_without_native_bf16()
    if not cpu_kernel:
        return DRAFTER_DENSE_ROWS
    bits, group = parse_scheme(scheme) if scheme else (0, 0)
    return 4 if bits == 4 and group % 64 == 0 and int4_kernel_runs(device, dtype) else 2


def on_torch_cpu_ops(device, dtype: torch.dtype) -> bool:
    """Quantized weights for `dtype` activations run torch's packed CPU ops, several times slower
    than the unquantized model (TORCH_CPU_PACKED_SLOWDOWN): float32 or float16 on the CPU."""
    return torch.device(device).type == "cpu" and dtype != torch.bfloat16


def parse_scheme(scheme: str) -> tuple[int, int | None]:
    """(bits, int4 group size) of a scheme name; raises on anything else."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; known: {', '.join(SCHEMES)} "
                         f"(int4 groups {DEFAULT_INT4_GROUP} inputs unless int4gG says otherwise)")
    if scheme == "int8":
        return 8, None
    return 4, int(scheme[5:]) if scheme.startswith("int4g") else DEFAULT_INT4_GROUP


@dataclass
class QuantizedValues:
    """The quantized weight in plain layout: w_hat = (q - offset) * scale + zero, per row / group."""
    q: torch.Tensor  # [N, K] int32 grid indices
    scale: torch.Tensor  # [N, K / group] in dtype (int8: group = K)
    zero: torch.Tensor | None  # like scale (int4), None (int8: symmetric)
    bits: int
    group: int
    dtype: torch.dtype  # activation dtype the scales are stored in

    @property
    def offset(self) -> int:
        return 8 if self.bits == 4 else 0


def check_shape(scheme: str, shape: tuple[int, int], dtype: torch.dtype, device) -> None:
    """Raises ValueError naming the op's constraint that an [N, K] weight of `scheme` would break."""
    bits, group = parse_scheme(scheme)
    n, k = shape
    device = torch.device(device)
    if dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"quantized weights need float32, bfloat16 or float16 activations, got {dtype}")
    if bits == 8:
        return
    if k % group:
        raise ValueError(f"{scheme}: the input size K={k} of an [{n}, {k}] weight must be a multiple of the "
                         f"group size {group} (pick another int4gG, G in {INT4_GROUPS})")
    if device.type == "cuda":
        if dtype != torch.bfloat16:
            raise ValueError(f"{scheme} on CUDA: _weight_int4pack_mm takes bfloat16 activations only, got {dtype}")
        if k % 32 or n % 8:
            raise ValueError(f"{scheme} on CUDA: an [{n}, {k}] weight needs K % 32 == 0 and N % 8 == 0")
    elif n % 16:
        raise ValueError(f"{scheme} on the CPU: _convert_weight_to_int4pack_for_cpu needs the output size N "
                         f"to be a multiple of 16, this [{n}, {k}] weight has N={n}")


def pack_int4_for_kernel(q: torch.Tensor) -> torch.Tensor:
    """[N, K] int4 grid indices -> [N, K / 2] uint8 in csrc/int4_linear.cpp's layout: byte 32 c + j
    of a row holds input 64 c + j in its low nibble and 64 c + 32 + j in its high one."""
    n, k = q.shape
    chunks = q.to(torch.uint8).view(n, k // 64, 2, 32)
    return (chunks[:, :, 0] | chunks[:, :, 1] << 4).reshape(n, k // 2).contiguous()


def _row_blocks(n: int, k: int):
    """Row ranges of about 256K entries: each block's passes stay in the cache."""
    rows = max(1, (1 << 18) // k)
    return ((r, min(r + rows, n)) for r in range(0, n, rows))


def quantize_values(w: torch.Tensor, scheme: str, dtype: torch.dtype) -> QuantizedValues:
    """Round an [N, K] float weight to `scheme` (pure PyTorch, in float32); scales in `dtype`."""
    bits, group = parse_scheme(scheme)
    if w.dim() != 2:
        raise ValueError(f"a linear weight is [N, K], got shape {tuple(w.shape)}")
    check_shape(scheme, tuple(w.shape), dtype, w.device)
    n, k = w.shape
    tiny = torch.finfo(dtype).tiny
    group = k if bits == 8 else group
    q = torch.empty(n, k, dtype=torch.int32, device=w.device)
    scale = torch.empty(n, k // group, dtype=dtype, device=w.device)
    zero = torch.empty_like(scale) if bits == 4 else None
    for r0, r1 in _row_blocks(n, k):  # block by block, the same operations on every entry
        w32 = w[r0:r1].to(torch.float32, copy=True).view(r1 - r0, k // group, group)
        if not bool(torch.isfinite(w32).all()):  # at load time: a NaN or inf would make every scale of its row NaN
            raise ValueError(f"the weight holds non-finite values (NaN or inf) in rows {r0}..{r1 - 1}: it cannot be "
                             f"quantized to {scheme}; check the checkpoint or load it unquantized")
        if bits == 8:
            s = (w32.abs().amax(-1, keepdim=True) / 127).clamp_min(tiny).to(dtype)
            w32.div_(s.float()).round_().clamp_(-127, 127)
        else:
            lo, hi = w32.amin(-1, keepdim=True), w32.amax(-1, keepdim=True)
            s = ((hi - lo) / 15).clamp_min(tiny).to(dtype)
            z = (lo + 8 * s.float()).to(dtype)
            w32.sub_(z.float()).div_(s.float()).round_().add_(8).clamp_(0, 15)
            zero[r0:r1] = z.squeeze(-1)
        q[r0:r1] = w32.view(r1 - r0, k)
        scale[r0:r1] = s.squeeze(-1)
    return QuantizedValues(q, scale, zero, bits, group, dtype)


def dequantize(values: QuantizedValues, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K]: the weight the quantized matmul multiplies by (the reference), computed in float32
    and returned in `dtype`."""
    n, k = values.q.shape
    out = torch.empty(n, k, dtype=dtype, device=values.q.device)
    for r0, r1 in _row_blocks(n, k):
        w = (values.q[r0:r1] - values.offset).float().view(r1 - r0, k // values.group, values.group)
        w.mul_(values.scale[r0:r1].float()[..., None])
        if values.zero is not None:
            w.add_(values.zero[r0:r1].float()[..., None])
        out[r0:r1] = w.view(r1 - r0, k)
    return out


class QuantizedLinear:
    """An [N, K] weight packed for torch's weight-only matmul; call it as F.linear(x, w, bias)."""

    def __init__(self, values: QuantizedValues, dense_rows: int = 0):
        n, k = values.q.shape
        self.shape, self.bits, self.group, self.dtype = (n, k), values.bits, values.group, values.dtype
        self.device = values.q.device
        # csd_engine's own CPU kernel for this weight, if any: "int8" (without native bf16 as fast
        # as bf16 at every width: no dense copy) or "int4" (groups of 64 inputs or more)
        self.kernel = ("int8" if values.bits == 8 and int8_kernel_runs(self.device, values.dtype) else
                       "int4" if values.bits == 4 and int4_kernel_runs(self.device, values.dtype)
                       and values.group % 64 == 0 and n % 8 == 0 else None)
        self.dense_rows = 0 if self.kernel == "int8" and kernel_without_native_bf16() else dense_rows
        self.dense = dequantize(values, values.dtype) if self.dense_rows else None  # for calls of more rows
        aten = torch.ops.aten
        if self.kernel == "int4":
            self.packed = pack_int4_for_kernel(values.q)
            self.scales = torch.stack([values.scale, values.zero], dim=-1).contiguous()  # [N, K / group, 2]
            return
        if values.bits == 8:
            self.packed = values.q.to(torch.int8).contiguous()
            self.scales = values.scale.reshape(n).contiguous()  # [N] in dtype
            return
        # [K / group, N, 2]: scale and zero of each (group, output) pair.
        self.scales = torch.stack([values.scale.t(), values.zero.t()], dim=-1).contiguous()
        if self.device.type == "cuda":
            q = values.q.to(torch.uint8)
            inner_k_tiles = next(t for t in (8, 4, 2) if k % (16 * t) == 0)
            self.packed = aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), inner_k_tiles)
        else:
            self.packed = aten._convert_weight_to_int4pack_for_cpu(values.q.contiguous(), 1)

    @property
    def nbytes(self) -> int:
        return self.streamed_bytes + (self.dense.nbytes if self.dense is not None else 0)

    @property
    def streamed_bytes(self) -> int:
        """What a call of up to dense_rows rows reads: the packed weight and its scales."""
        return self.packed.nbytes + self.scales.nbytes

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise ValueError(f"this weight was quantized for {self.dtype} activations, got {x.dtype}")
        flat = x.reshape(-1, self.shape[1]).contiguous()
        aten = torch.ops.aten
        if self.dense is not None and flat.shape[0] > self.dense_rows:
            y = dense_linear(flat, self.dense)
        elif self.kernel == "int8":
            y = int8_linear(flat, self.packed, self.scales)
        elif self.kernel == "int4":
            y = int4_linear(flat, self.packed, self.scales, self.group)
        elif self.bits == 8:
            y = aten._weight_int8pack_mm(flat, self.packed, self.scales)
        elif self.device.type == "cuda":
            y = aten._weight_int4pack_mm(flat, self.packed, self.group, self.scales)
        else:
            y = aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales)
        y = y.view(*x.shape[:-1], self.shape[0])
        return y if bias is None else y + bias


def quantize_weight(w: torch.Tensor, scheme: str, dtype: torch.dtype | None = None,
                    dense_rows: int = 0) -> QuantizedLinear:
    """Quantize an [N, K] weight for activations of `dtype` (default: w's dtype); dense_rows:
    see "Wide calls" above (0: packed only)."""
    return QuantizedLinear(quantize_values(w, scheme, dtype or w.dtype), dense_rows)


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None, row_block: int = 0) -> torch.Tensor:
    """F.linear for a float weight or a QuantizedLinear: the runner's one matmul call.

    row_block > 0: batch-invariant. The rows of x (batch x tokens) go through the matmul in
    zero-padded blocks of exactly `row_block` rows, so every row takes the same kernel with the
    same reduction order whatever else is in the batch (BLAS picks kernels by the row count);
    csd_engine's CPU kernels (bf16, and QuantizedLinear.kernel without dense copies) need no blocks."""
    apply = (lambda t: weight(t, bias)) if isinstance(weight, QuantizedLinear) else \
        (lambda t: dense_linear(t, weight, bias))
    # whether every row count takes one kernel whose rows do not depend on the others: then no blocks
    kernel = weight.kernel is not None and weight.dense is None if isinstance(weight, QuantizedLinear) else \
        bf16_kernel_takes(x, weight, bias) and bf16_kernel_max_rows() is None
    if not row_block or kernel:
        return apply(x)
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    padded = torch.cat([flat, flat.new_zeros((-rows) % row_block, flat.shape[1])])
    out = torch.cat([apply(block) for block in padded.split(row_block)])[:rows]
    return out.view(*x.shape[:-1], out.shape[-1])
