"""csd_engine's int4 CPU matmul (csrc/int4_linear.cpp, ops.int4_linear) for bf16 activations on x86
CPUs with AVX2 (its AVX-512 BF16 tiles where the CPU has them; test_cpu_isa.py reruns this file
with each instruction set): within the rounding of fp32 accumulation of the exact product with the
dequantized weight, every output row the same whatever else shares the call, its layout and
errors, and when QuantizedLinear takes it."""
import time

import pytest
import torch

from csd_engine import ops
from csd_engine.models.quant import QuantizedLinear, pack_int4_for_kernel, quantize_values, quantize_weight
from tests.test_bf16_linear import assert_within_fp32_sum_and_bf16_rounding

needs_kernel = pytest.mark.skipif(not ops.int4_kernel_runs("cpu", torch.bfloat16),
                                  reason="csd_engine's int4 kernel does not run here (needs the extension and "
                                         "an x86 CPU with AVX2)")
# (rows of x, N, K, group): every tile (1-6 rows of x), several tiles, groups of 64 to 256
SHAPES = [(1, 16, 64, 64), (2, 16, 128, 64), (3, 32, 320, 64), (4, 16, 256, 128), (5, 48, 128, 128),
          (6, 16, 512, 256), (7, 16, 192, 64), (13, 32, 256, 128), (17, 16, 128, 64)]


@pytest.fixture
def gen():
    seed = time.time_ns() % 2**31
    return torch.Generator().manual_seed(seed), seed


def case(g, m, n, k, group, bias=False):
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g) * 0.05 + 0.02 * torch.randn(n, 1, generator=g)  # rows off zero: zeros matter
    values = quantize_values(w, f"int4g{group}", torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    scales_zeros = torch.stack([values.scale, values.zero], dim=-1).contiguous()
    return x, values, pack_int4_for_kernel(values.q), scales_zeros, b


def exact_terms(x, values):
    """The dequantized weight's two shares in float64 (exact: small integers times bf16 values),
    [N, K] each: (q - 8) s and z; and what bounds each term the kernel adds up on the way,
    |q - 8| s + 16 s + |z| (the AVX2 tiles sum x q s and add (z - 8 s) times x's group sum)."""
    per_input = lambda t: t.double().repeat_interleave(values.group, dim=1)  # noqa: E731
    steps, scales, zeros = (values.q - 8).double() * per_input(values.scale), per_input(values.scale), \
        per_input(values.zero)
    return steps, zeros, steps.abs() + 16 * scales.abs() + zeros.abs()


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k,group", SHAPES)
def test_within_fp32_accumulation_and_one_rounding_of_the_exact_product(m, n, k, group, bias, gen):
    """Each term passes through at most 2 G + 2 K / G + 6 fp32 roundings: G / 16 additions per
    lane and group (vdpbf16ps adds two exact products per lane; AVX2: G / 16 FMAs per low or high
    half and their sum), one scaling FMA per group, K / G group sums, 3 or 4 lane reductions; the
    zeros' share: a group's sum of x (G - 1), z - 8 s (AVX2), its product with the sum, K / G
    additions; the bias."""
    g, seed = gen
    x, values, packed, scales_zeros, b = case(g, m, n, k, group, bias)
    y = ops.int4_linear(x, packed, scales_zeros, group, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    steps, zeros, bound = exact_terms(x, values)
    xd = x.double()
    exact = xd @ (steps + zeros).T + (b.double() if bias else 0)
    magnitude = xd.abs() @ bound.T + (b.double().abs() if bias else 0)
    assert_within_fp32_sum_and_bf16_rounding(y, exact, magnitude, 2 * group + 2 * k // group + 6, seed)


@needs_kernel
@pytest.mark.parametrize("m,n,k,group", [s for s in SHAPES if s[0] > 1])
def test_a_row_gives_the_same_bits_alone_and_in_any_call(m, n, k, group, gen):
    """Rows of x alone or together, and rows of W in any position of the weight (tiles of 8, 4
    and 2 W rows with AVX-512 BF16, 4, 2 and 1 with AVX2): the same bits."""
    g, seed = gen
    x, values, packed, scales_zeros, b = case(g, m, n, k, group, bias=True)
    together = ops.int4_linear(x, packed, scales_zeros, group, b)
    for i in range(m):
        assert torch.equal(ops.int4_linear(x[i:i + 1], packed, scales_zeros, group, b), together[i:i + 1]), \
            f"row {i}, seed {seed}"
    assert torch.equal(ops.int4_linear(x[1:], packed, scales_zeros, group, b), together[1:]), f"seed {seed}"
    if n > 8:
        part = ops.int4_linear(x, packed[8:], scales_zeros[8:], group, b[8:])
        assert torch.equal(part, together[:, 8:]), f"seed {seed}"


def test_the_packing_puts_two_halves_of_each_64_inputs_in_one_byte():
    q = torch.arange(128).remainder(16).view(1, 128).repeat(8, 1)
    q[3] = 15 - q[3]
    packed = pack_int4_for_kernel(q)
    assert packed.shape == (8, 64) and packed.dtype == torch.uint8
    for c in range(2):
        for j in range(32):
            byte = int(packed[3, 32 * c + j])
            assert (byte & 15, byte >> 4) == (int(q[3, 64 * c + j]), int(q[3, 64 * c + 32 + j]))


@needs_kernel
def test_leading_dimensions_and_empty_inputs(gen):
    g, _ = gen
    x, values, packed, scales_zeros, b = case(g, 12, 16, 128, 64, bias=True)
    y = ops.int4_linear(x.view(3, 4, 128), packed, scales_zeros, 64, b)
    assert y.shape == (3, 4, 16) and torch.equal(y.reshape(12, 16), ops.int4_linear(x, packed, scales_zeros, 64, b))
    strided = x[:, :128].t().contiguous().t()  # a non-contiguous view of the same values
    assert torch.equal(ops.int4_linear(strided, packed, scales_zeros, 64), ops.int4_linear(x, packed, scales_zeros, 64))
    assert ops.int4_linear(x[:0], packed, scales_zeros, 64, b).shape == (0, 16)


@needs_kernel
def test_bad_arguments_are_refused_with_the_rule(gen):
    g, _ = gen
    x, values, packed, scales_zeros, b = case(g, 2, 16, 128, 64)
    call = ops.int4_linear
    with pytest.raises(TypeError, match="x must be bfloat16"):
        call(x.float(), packed, scales_zeros, 64)
    with pytest.raises(TypeError, match="packed must be uint8"):
        call(x, packed.to(torch.int8), scales_zeros, 64)
    with pytest.raises(ValueError, match="x's last dimension"):
        call(x[:, :64], packed, scales_zeros, 64)
    with pytest.raises(ValueError, match="group must be a multiple of 64 that divides K = 128, got 32"):
        call(x, packed, scales_zeros, 32)
    with pytest.raises(ValueError, match="N must be a multiple of 8, got 12"):
        call(x, packed[:12], scales_zeros[:12], 64)
    with pytest.raises(ValueError, match=r"scales_zeros must be \[N, K / group, 2\] = \[16, 2, 2\]"):
        call(x, packed, scales_zeros[:, :1], 64)
    with pytest.raises(TypeError, match="scales_zeros must be bfloat16"):
        call(x, packed, scales_zeros.float(), 64)
    with pytest.raises(ValueError, match=r"bias must be \[N\] = \[16\]"):
        call(x, packed, scales_zeros, 64, torch.zeros(4, dtype=torch.bfloat16))
    assert call(x, packed, scales_zeros, 64).shape == (2, 16)  # still usable


@needs_kernel
def test_the_op_passes_torch_library_checks(gen):
    g, _ = gen
    x, values, packed, scales_zeros, b = case(g, 3, 16, 128, 64, bias=True)
    torch.library.opcheck(torch.ops.csd_engine.int4_linear, (x, packed, scales_zeros, 64, b))


@pytest.mark.skipif("cpu" not in ops._INT4_LINEAR_DEVICES, reason="csd_engine._C has no int4_linear CPU kernel")
def test_the_op_refuses_a_cpu_it_does_not_run_on_clearly():
    """Where the CPU lacks AVX2 (or CSD_CPU_ISA=baseline, as test_cpu_isa.py runs this file)
    QuantizedLinear keeps torch's op and the raw op says why."""
    if ops.int4_kernel_runs("cpu", torch.bfloat16):
        pytest.skip("the int4 kernel runs here")
    x, packed, scales_zeros = torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(8, 32, dtype=torch.uint8), \
        torch.zeros(8, 1, 2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="needs an x86 CPU with AVX2 and FMA"):
        ops.int4_linear(x, packed, scales_zeros, 64)
    assert quantize_weight(torch.randn(16, 128), "int4g64", torch.bfloat16).kernel is None


@needs_kernel
@pytest.mark.parametrize("scheme", ["int4", "int4g64", "int4g256", "int4g32"])
def test_quantized_linear_takes_the_kernel_for_bf16_groups_of_64_or_more(scheme, gen, monkeypatch):
    """The kernel and torch's op differ only in rounding: both within the bound of the product
    with the dequantized weight, so here within a few bf16 ulps of each other."""
    g, _ = gen
    w, x = torch.randn(32, 512, generator=g) * 0.05, torch.randn(3, 512, generator=g).to(torch.bfloat16)
    layer = quantize_weight(w, scheme, torch.bfloat16)
    assert layer.kernel == (None if scheme == "int4g32" else "int4")
    monkeypatch.setenv("CSD_INT4_LINEAR", "0")
    torch_op = quantize_weight(w, scheme, torch.bfloat16)
    assert torch_op.kernel is None and torch_op.streamed_bytes == layer.streamed_bytes
    torch.testing.assert_close(layer(x).float(), torch_op(x).float(), rtol=2 ** -6, atol=2e-2)
    assert quantize_weight(w, scheme, torch.float32).kernel is None  # fp32 activations: torch's op
    monkeypatch.setenv("CSD_INT4_LINEAR", "yes")
    with pytest.raises(ValueError, match="CSD_INT4_LINEAR must be 1 .* or 0"):
        quantize_weight(w, scheme, torch.bfloat16)


@needs_kernel
def test_a_drafters_dense_copy_takes_its_wide_calls_and_batch_invariant_calls_stay_alike(gen):
    g, _ = gen
    w = torch.randn(16, 128, generator=g) * 0.05
    drafter = quantize_weight(w, "int4g64", torch.bfloat16, dense_rows=4)
    assert drafter.kernel == "int4" and drafter.dense is not None
    x = torch.randn(6, 128, generator=g).to(torch.bfloat16)
    assert torch.equal(drafter(x[:4]), ops.int4_linear(x[:4], drafter.packed, drafter.scales, 64))
    assert torch.equal(drafter(x), ops.dense_linear(x, drafter.dense))
    target = quantize_weight(w, "int4g64", torch.bfloat16)
    assert isinstance(target, QuantizedLinear) and target.dense is None
    assert torch.equal(target(x), ops.int4_linear(x, target.packed, target.scales, 64))
