"""csd_engine's CPU matmuls for bf16 activations (csrc/bf16_linear.cpp: ops.dense_linear's bf16
kernel and ops.int8_linear): within the rounding of fp32 accumulation of the exact product, every
output row the same whatever else shares the call, their errors, and when they are taken."""
import time

import pytest
import torch
import torch.nn.functional as F

from csd_engine import ops

needs_kernel = pytest.mark.skipif("cpu" not in ops._BF16_LINEAR_DEVICES,
                                  reason="csd_engine._C has no bf16_linear CPU kernel (extension not built)")
# (rows of x, N, K): every FMA tile, the scalar rest, k tails; with AMX (K a multiple of 32) one and
# four W tiles per item, W rows past the last tile, k beyond one chunk, x's rows in 1 to 3 tiles
SHAPES = [(1, 1, 8), (1, 4, 1536), (2, 6, 24), (3, 37, 37), (5, 8, 64), (6, 9, 200), (7, 5, 31), (13, 40, 96),
          (9, 26, 40), (17, 12, 256), (1, 64, 64), (5, 80, 96), (17, 48, 2048), (16, 70, 4160), (33, 64, 32)]


@pytest.fixture
def gen():
    seed = time.time_ns() % 2**31
    return torch.Generator().manual_seed(seed), seed


def assert_within_fp32_sum_and_bf16_rounding(y, exact, magnitude, roundings, seed):
    """|y - exact| <= E + 2^-8 (|exact| + E), E = roundings 2^-24 magnitude: each of `roundings`
    fp32 operations on the way rounds by at most 2^-24 of the sum of magnitudes, and 2^-8 |v| is
    half a bf16 ulp of the accumulated value v (8 significant bits)."""
    e = roundings * 2.0 ** -24 * magnitude
    err = (y.double() - exact).abs()
    assert (err <= e + 2.0 ** -8 * (exact.abs() + e)).all(), f"seed {seed}: worst {(err - e).max().item()}"


def case(g, m, n, k, bias):
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return x, w, b


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_within_fp32_accumulation_and_one_rounding_of_the_exact_product(m, n, k, bias, gen):
    """K fused multiply-adds, a lane reduction (3) and the bias: K + 4 roundings of sum|x w| + |b|."""
    g, seed = gen
    x, w, b = case(g, m, n, k, bias)
    y = torch.ops.csd_engine.bf16_linear(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    magnitude = x.double().abs() @ w.double().abs().T + (b.double().abs() if bias else 0)
    assert_within_fp32_sum_and_bf16_rounding(y, exact, magnitude, k + 4, seed)


@needs_kernel
@pytest.mark.parametrize("m,n,k", [s for s in SHAPES if s[0] > 1])
def test_a_row_gives_the_same_bits_alone_and_in_any_call(m, n, k, gen):
    g, seed = gen
    x, w, b = case(g, m, n, k, bias=True)
    together = torch.ops.csd_engine.bf16_linear(x, w, b)
    for i in range(m):
        assert torch.equal(torch.ops.csd_engine.bf16_linear(x[i:i + 1], w, b), together[i:i + 1]), f"row {i}, seed {seed}"
    assert torch.equal(torch.ops.csd_engine.bf16_linear(x[1:], w, b), together[1:]), f"seed {seed}"


@needs_kernel
@pytest.mark.parametrize("int8", [False, True])
def test_a_weight_row_gets_the_same_bits_from_a_tile_and_from_the_scalar_rest(int8, gen):
    """Weight rows past the last whole group of 24 take the scalar loop, which must add in the
    tiles' order: rows 24..28 computed as the rest of a 29-row weight and as a tile's rows."""
    g, seed = gen
    x = torch.randn(3, 70, generator=g).to(torch.bfloat16)
    if int8:
        if "cpu" not in ops._INT8_LINEAR_DEVICES:
            pytest.skip("csd_engine._C has no int8_linear CPU kernel")
        w = torch.randint(-127, 128, (48, 70), generator=g, dtype=torch.int8)
        scale = torch.rand(48, generator=g).to(torch.bfloat16)
        as_rest, in_tile = ops.int8_linear(x, w[:29], scale[:29]), ops.int8_linear(x, w[24:], scale[24:])
    else:
        w = torch.randn(48, 70, generator=g).to(torch.bfloat16)
        as_rest, in_tile = (torch.ops.csd_engine.bf16_linear(x, part) for part in (w[:29], w[24:]))
    assert torch.equal(as_rest[:, 24:], in_tile[:, :5]), f"seed {seed}"


@needs_kernel
def test_leading_dimensions_and_strided_input_are_kept(gen):
    g, _ = gen
    x, w, b = case(g, 12, 10, 48, bias=True)
    y = torch.ops.csd_engine.bf16_linear(x.view(3, 4, 48), w, b)
    assert y.shape == (3, 4, 10) and torch.equal(y.reshape(12, 10), torch.ops.csd_engine.bf16_linear(x, w, b))
    strided = torch.randn(5, 96, generator=g).to(torch.bfloat16)[:, ::2]
    assert torch.equal(torch.ops.csd_engine.bf16_linear(strided, w, None),
                       torch.ops.csd_engine.bf16_linear(strided.contiguous(), w, None))
    assert torch.ops.csd_engine.bf16_linear(x[:0], w, b).shape == (0, 10)


@needs_kernel
def test_bad_input_names_the_problem():
    x, w = torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(3, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="x must be bfloat16, got Float"):
        torch.ops.csd_engine.bf16_linear(x.float(), w, None)
    with pytest.raises(TypeError, match="weight must be bfloat16, got Float"):
        torch.ops.csd_engine.bf16_linear(x, w.float(), None)
    with pytest.raises(ValueError, match=r"x's last dimension \(8\) must equal weight's K \(4\)"):
        torch.ops.csd_engine.bf16_linear(x, w[:, :4], None)
    with pytest.raises(ValueError, match=r"bias must be \[N\] = \[3\]"):
        torch.ops.csd_engine.bf16_linear(x, w, torch.zeros(4, dtype=torch.bfloat16))


@needs_kernel
def test_opcheck(gen):
    g, _ = gen
    x, w, b = case(g, 3, 5, 16, bias=True)
    torch.library.opcheck(torch.ops.csd_engine.bf16_linear, (x, w, b))


@pytest.mark.parametrize("forced,want", [("1", True), ("0", False)])
def test_dense_linear_takes_the_kernel_as_forced(forced, want, monkeypatch, gen):
    g, _ = gen
    x, w, b = case(g, 5, 6, 40, bias=True)
    monkeypatch.setenv("CSD_BF16_LINEAR", forced)
    ops.bf16_kernel_pays.cache_clear()
    try:
        used = ops.bf16_kernel_pays()
        y = ops.dense_linear(x, w, b)
        assert used == (want and "cpu" in ops._BF16_LINEAR_DEVICES)
        assert torch.equal(y, torch.ops.csd_engine.bf16_linear(x, w, b) if used else F.linear(x, w, b))
        assert torch.equal(ops.dense_linear(x.float(), w.float()), F.linear(x.float(), w.float()))  # float32: torch's
    finally:
        monkeypatch.undo()
        ops.bf16_kernel_pays.cache_clear()


@pytest.mark.parametrize("shape", [(40,), (1, 40), (1, 1, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_one_row_on_torchs_bf16_matmul_keeps_its_shape_and_precision(shape, bias, monkeypatch, gen):
    """Without the kernel (CSD_BF16_LINEAR=0) a one-row bf16 call goes to torch's matmul with a
    zero row beside it (faster there): the shape is kept, and the row is the exact product within
    fp32 accumulation and one bf16 rounding (two with a bias, should torch round before adding it)."""
    g, seed = gen
    x, w, b = case(g, 1, 24, 40, bias)
    monkeypatch.setenv("CSD_BF16_LINEAR", "0")
    ops.bf16_kernel_pays.cache_clear()
    try:
        y = ops.dense_linear(x.reshape(shape), w, b)
        assert y.dtype == torch.bfloat16 and y.shape == (*shape[:-1], 24)
        exact = x.double() @ w.double().T + (b.double() if bias else 0)
        magnitude = x.double().abs() @ w.double().abs().T + (b.double().abs() if bias else 0)
        e = (40 + 4) * 2.0 ** -24 * magnitude
        err = (y.reshape(1, -1).double() - exact).abs()
        assert (err <= e + (2 if bias else 1) * 2.0 ** -8 * (magnitude + e)).all(), f"seed {seed}: {err.max()}"
    finally:
        monkeypatch.undo()
        ops.bf16_kernel_pays.cache_clear()


def test_a_bad_switch_value_names_the_allowed_ones(monkeypatch):
    monkeypatch.setenv("CSD_BF16_LINEAR", "yes")
    ops.bf16_kernel_pays.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"CSD_BF16_LINEAR must be 1 .* or 0 .*, got 'yes'"):
            ops.bf16_kernel_pays()
    finally:
        monkeypatch.undo()
        ops.bf16_kernel_pays.cache_clear()


needs_int8_kernel = pytest.mark.skipif("cpu" not in ops._INT8_LINEAR_DEVICES,
                                       reason="csd_engine._C has no int8_linear CPU kernel (extension not built)")


def int8_case(g, m, n, k, bias):
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, generator=g) / 64 + 1e-3).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return x, q, scale, b


@needs_int8_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int8_within_fp32_accumulation_and_one_rounding_of_the_exact_product(m, n, k, bias, gen):
    """y = (x q^T) s + b: the bf16 kernel's K + 4 roundings, plus the scaling and the bias added
    after it: K + 6 roundings of s sum|x q| + |b|."""
    g, seed = gen
    x, q, s, b = int8_case(g, m, n, k, bias)
    y = ops.int8_linear(x, q, s, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    bias64 = b.double() if bias else torch.zeros(n, dtype=torch.float64)
    exact = (x.double() @ q.double().T) * s.double() + bias64
    magnitude = (x.double().abs() @ q.double().abs().T) * s.double() + bias64.abs()
    assert_within_fp32_sum_and_bf16_rounding(y, exact, magnitude, k + 6, seed)


@needs_int8_kernel
@pytest.mark.parametrize("m,n,k", [s for s in SHAPES if s[0] > 1])
def test_int8_row_gives_the_same_bits_alone_and_in_any_call(m, n, k, gen):
    g, seed = gen
    x, q, s, b = int8_case(g, m, n, k, bias=True)
    together = ops.int8_linear(x, q, s, b)
    for i in range(m):
        assert torch.equal(ops.int8_linear(x[i:i + 1], q, s, b), together[i:i + 1]), f"row {i}, seed {seed}"


@needs_int8_kernel
def test_int8_bad_input_names_the_problem(gen):
    x, q, s, b = int8_case(gen[0], 2, 3, 8, bias=True)
    with pytest.raises(TypeError, match="int8_linear: x must be bfloat16, got Float"):
        ops.int8_linear(x.float(), q, s)
    with pytest.raises(TypeError, match="int8_linear: weight must be int8, got Int"):
        ops.int8_linear(x, q.int(), s)
    with pytest.raises(ValueError, match=r"int8_linear: scale must be \[N\] = \[3\]"):
        ops.int8_linear(x, q, s[:2])
    with pytest.raises(ValueError, match=r"int8_linear: x's last dimension \(8\) must equal weight's K \(4\)"):
        ops.int8_linear(x, q[:, :4], s)
    torch.library.opcheck(torch.ops.csd_engine.int8_linear, (x, q, s, b))


@pytest.mark.parametrize("native_bf16", [False, True])
@pytest.mark.parametrize("forced", ["1", "0"])
def test_an_int8_layer_takes_the_kernel_where_it_runs_and_torchs_op_elsewhere(forced, native_bf16, monkeypatch, gen):
    """QuantizedLinear (int8, bf16) on the kernel wherever the bf16 kernel runs; without native
    bf16 with no dense copy (the kernel is as fast at every width), with it keeping the dense copy
    for wide calls; elsewhere torch's op. Both compute the same product."""
    from csd_engine.models.quant import quantize_weight
    g, _ = gen
    w, x = torch.randn(24, 64, generator=g).to(torch.bfloat16), torch.randn(5, 64, generator=g).to(torch.bfloat16)
    monkeypatch.setenv("CSD_BF16_LINEAR", forced)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)  # AMX has native bf16 too
    ops.bf16_kernel_pays.cache_clear()
    try:
        layer = quantize_weight(w, "int8", dense_rows=8)  # 5 rows: the packed op, not the dense copy
        kernel = forced == "1" and "cpu" in ops._INT8_LINEAR_DEVICES
        assert (layer.kernel == "int8") == kernel and (layer.dense is None) == (kernel and not native_bf16)
        y = layer(x)
        want = ops.int8_linear(x, layer.packed, layer.scales) if kernel else \
            torch.ops.aten._weight_int8pack_mm(x, layer.packed, layer.scales)
        assert torch.equal(y, want)
        other = torch.ops.aten._weight_int8pack_mm(x, layer.packed, layer.scales)
        torch.testing.assert_close(y.float(), other.float(), rtol=2 ** -7, atol=1e-2)
    finally:
        monkeypatch.undo()
        ops.bf16_kernel_pays.cache_clear()
