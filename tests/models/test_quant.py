"""Weight-only int8 / int4 weights (models/quant.py) in the native runner.

The quantization error is bounded in two independent steps, which together are the whole
difference between the quantized runner and the float model:
1. deq(Q(W)) is within half a grid step of W elementwise: |W - deq(Q(W))| <= s / 2, plus, for
   int4, u (|z| + 8 s) where the scale s and zero z were rounded to the activation dtype
   (unit roundoff u; it moves the grid's ends, see quant.py). Checked on random weights.
2. Everything after the rounding is exact up to float arithmetic: torch's packed matmul equals
   F.linear with deq(Q(W)) within the dot-product rounding bound gamma_K |x| |W|^T
   (gamma_K = K u / (1 - K u)), and the quantized runner's logits equal a float32 model whose
   weights are replaced by deq(Q(W)) within the error transformers itself makes in float32
   (the bound of test_llama.py), through prefill, decode and verify-sized chunks, both paths.
Greedy decoding is then exactly the dequantized model's, as a speculative target or drafter.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from csd_engine import Autoregressive, Engine, SamplingParams, Speculative, ops
from csd_engine.models.graphs import GraphedRunner
from csd_engine.models.llama import LlamaRunner
from csd_engine.models.loader import load_runner, split_spec
from csd_engine.models.quant import QuantizedLinear, dequantize, linear, quantize_values, quantize_weight
from csd_engine.models.runner import ForwardBatch
from tests.models.test_llama import _native_logits_in_steps
from tests.strategies.common import assert_greedy_equals_autoregressive
from tests.tiny_models import VOCAB, random_prompts, tiny_gpt2, tiny_llama, tiny_qwen2

TINY_SCHEMES = ["int8", "int4g32", "int4g64"]  # the tiny models' K = 64 or 128 allow groups of 32 and 64
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def dequantized_model(model, scheme, dtype=torch.float32):
    """A float32 copy of `model` whose projections and head hold deq(Q(W)) (scales rounded to
    `dtype`); the embedding stays as it was (an untied head of its own when the model ties
    them), as in the quantized runner."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in ref.named_modules():
            if name.split(".")[-1] in PROJECTIONS:
                module.weight.copy_(dequantize(quantize_values(module.weight, scheme, dtype)))
        head = dequantize(quantize_values(ref.lm_head.weight, scheme, dtype))
        ref.lm_head.weight = torch.nn.Parameter(head)
    ref.config.tie_word_embeddings = False
    return ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", ["int8", "int4g32", "int4", "int4g256"])
def test_dequantized_weight_is_within_half_a_step(scheme, dtype):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    w = torch.randn(1104, 512, generator=g) * 0.05  # rows in three of quantize_values' blocks
    w[3] += 0.3  # rows far from zero: the int4 zero point is large against the step there
    w[700] -= 0.4
    values = quantize_values(w, scheme, dtype)
    assert values.q.shape == w.shape and values.scale.shape == (1104, 512 // values.group)
    lo, hi = (-127, 127) if values.bits == 8 else (0, 15)
    assert values.q.min() >= lo and values.q.max() <= hi
    per_weight = lambda t: t.float().repeat_interleave(values.group, dim=1)  # noqa: E731  [N, K/G] -> [N, K]
    step = per_weight(values.scale)
    bound = step / 2
    if values.zero is not None:
        bound = bound + UNIT_ROUNDOFF[dtype] * (per_weight(values.zero).abs() + 8 * step)
    w_hat = dequantize(values)
    assert torch.equal(dequantize(values, dtype), w_hat.to(dtype))
    # rounding to the grid and rebuilding w_hat run in float32: a weight half a step from two
    # grid points may land on either, off by the float32 rounding of w / s and of w_hat
    bound = bound + 2 * UNIT_ROUNDOFF[torch.float32] * (w.abs() + w_hat.abs())
    err = (w - w_hat).abs()
    print(f"{scheme} {dtype}: max |W - deq| / step {(err / step).max():.4f}")
    assert (err <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("scheme", ["int8", "int4g32", "int4"])
def test_packed_matmul_equals_linear_on_the_dequantized_weight(scheme):
    n, k = 48, 256
    w = torch.randn(n, k) * 0.05
    bias = torch.randn(n)
    values = quantize_values(w, scheme, torch.float32)
    layer = QuantizedLinear(values)
    x = torch.randn(2, 5, k)  # leading dims flattened by the layer
    w_hat = dequantize(values).double()
    exact = F.linear(x.double(), w_hat, bias.double())
    gamma = k * UNIT_ROUNDOFF[torch.float32] / (1 - k * UNIT_ROUNDOFF[torch.float32])
    bound = gamma * (x.double().abs() @ w_hat.abs().t() + bias.double().abs()) + 1e-12
    dense = QuantizedLinear(values, dense_rows=6)  # 10 rows: the dense copy; 5 rows: the packed op
    for ours in (linear(x, layer, bias), F.linear(x, w_hat.float(), bias), linear(x, dense, bias),
                 torch.cat([linear(x[:1], dense, bias), linear(x[1:], dense, bias)])):
        assert ours.shape == (2, 5, n)
        assert ((ours.double() - exact).abs() <= bound).all()


# the fused norm / RoPE kernels (interpreted here: slow) do not touch the weights: one scheme with them
@pytest.mark.parametrize("scheme,fused", [(s, False) for s in TINY_SCHEMES] + [("int4g32", True)],
                         ids=[s for s in TINY_SCHEMES] + ["int4g32-fused"])
@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2-tied-bias"])
def test_quantized_runner_is_the_float_model_on_dequantized_weights(make, scheme, fused):
    model = make(seed=int(torch.randint(0, 1000, (1,))))
    ref_model = dequantized_model(model, scheme)
    ids = torch.randint(0, VOCAB, (3, 17))
    with torch.no_grad():
        ref64 = copy.deepcopy(ref_model).double()(ids).logits
        hf32 = ref_model(ids).logits.double()
    runner = LlamaRunner(model, "cpu", torch.float32, fused=fused, quantize=scheme)
    assert all(isinstance(w[name], QuantizedLinear) for w in runner.layers for name in ("qkv", "o", "gate_up", "down"))
    assert isinstance(runner.lm_head, QuantizedLinear) and not isinstance(runner.embed, QuantizedLinear)
    ours = _native_logits_in_steps(runner, ids, splits=[5, 6, 11]).double()
    hf_err, our_err = (hf32 - ref64).abs().max().item(), (ours - ref64).abs()
    print(f"{scheme}: transformers fp32 max err {hf_err:.2e}; quantized runner max {our_err.max():.2e}")
    assert our_err.max().item() <= 4 * hf_err + 1e-6
    # The rounding itself is visible: the float model's own logits differ by far more.
    with torch.no_grad():
        assert (model(ids).logits.double() - ref64).abs().max() > 100 * hf_err


@pytest.mark.parametrize("scheme", ["int8", "int4g32"])
def test_bfloat16_quantized_runner_errs_no_more_than_bfloat16_itself(scheme):
    """bf16 activations (the dtype quantization is for): against the float64 dequantized model,
    the quantized runner's error is within 2x that of the plain bf16 runner on the same weights,
    plus one bf16 step at the largest logit: both errors come in such steps (a plain error of one
    step and a quantized one of two is within the rule, and measured 2.0035x once)."""
    seed = int(torch.randint(0, 1000, (1,)))
    model = tiny_qwen2(seed=seed)
    ref_model = dequantized_model(model, scheme, torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        ref64 = copy.deepcopy(ref_model).double()(ids).logits
    plain = _native_logits_in_steps(LlamaRunner(ref_model, "cpu", torch.bfloat16), ids, [4, 5])
    ours = _native_logits_in_steps(LlamaRunner(model, "cpu", torch.bfloat16, quantize=scheme), ids, [4, 5])
    plain_err, our_err = (plain.double() - ref64).abs().max().item(), (ours.double() - ref64).abs().max().item()
    print(f"{scheme} bf16: plain runner max err {plain_err:.3f}, quantized runner {our_err:.3f}")
    step = torch.finfo(torch.bfloat16).eps * ref64.abs().max().item()  # a bf16 step at the largest logit, or more
    assert our_err <= 2 * plain_err + step, f"seed {seed}: {our_err:.3f} against 2 x {plain_err:.3f} + {step:.3f}"


@pytest.mark.parametrize("scheme", ["int8", "int4g32"])
def test_quantized_target_decodes_exactly_the_dequantized_model(scheme):
    """Engine(target=quantized runner), greedy: token for token a plain forward loop of the float
    model on deq(Q(W)). A quantized target's output is exactly the quantized model's."""
    model = tiny_qwen2(seed=9)
    reference = dequantized_model(model, scheme)
    engine = Engine(target=LlamaRunner(model, "cpu", torch.float32, quantize=scheme), max_batch_size=3,
                    max_seq_len=64)
    prompts = random_prompts(3, seed=int(torch.randint(0, 10**6, (1,))))
    results = engine.generate(prompts, SamplingParams(max_new_tokens=16), strategy=Autoregressive())
    for prompt, result in zip(prompts, results):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(16):
                ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
        assert result.token_ids == ids[len(prompt):]


def test_quantized_drafter_keeps_speculation_lossless():
    model = tiny_llama(seed=12)
    drafter = LlamaRunner(model, "cpu", torch.float32, quantize="int4g32")
    engine = Engine(target=model, drafters=[drafter], max_batch_size=3, max_seq_len=64)
    out = assert_greedy_equals_autoregressive(engine, random_prompts(3, seed=13), Speculative(k=3))
    assert sum(r.metrics.accepted for r in out) > 0


@pytest.mark.parametrize("kernel", [False, True])
def test_a_quantized_drafter_is_priced_by_the_bytes_its_forward_streams(kernel, monkeypatch):
    """weight_bytes: each layer's weights and the head as stored (packed where quantized, never
    the dense copies of wide calls), not the embedding; the self-tuning strategies' drafter cost
    (budget.cost_ratio) is its ratio, so an int4 drafter is about a quarter of the bf16 one;
    where csd_engine's bf16 kernel runs the target, the parameter ratio (as tuned there)."""
    from types import SimpleNamespace

    from csd_engine.strategies import budget
    monkeypatch.setattr(budget, "on_bf16_kernel", lambda models: kernel)
    model = tiny_llama(seed=12, tie=True).to(torch.bfloat16)
    dense = LlamaRunner(model, "cpu", torch.bfloat16)
    packed = LlamaRunner(model, "cpu", torch.bfloat16, quantize="int4g32", dense_rows=16)
    embed = model.model.embed_tokens.weight
    layers = sum(p.nbytes for p in model.model.layers.parameters()) + model.model.norm.weight.nbytes
    assert dense.weight_bytes == layers + embed.nbytes  # tied: the head is the embedding, streamed once
    matrices = sum(m.weight.numel() for n, m in model.named_modules() if n.split(".")[-1] in PROJECTIONS)
    matrices += embed.numel()  # the head, packed
    scales = 2 * 2 * matrices // 32  # a bf16 scale and zero per group of 32
    assert packed.weight_bytes == layers - 2 * (matrices - embed.numel()) + matrices // 2 + scales
    assert GraphedRunner(packed).weight_bytes == packed.weight_bytes
    early = dense.truncated(1)
    models = SimpleNamespace(target=dense, drafters=[packed, early], device=torch.device("cpu"))
    if kernel:
        assert budget.cost_ratio(models, 0) == 1.0
        assert budget.cost_ratio(models, 1) == early.num_params / dense.num_params
    else:
        assert budget.cost_ratio(models, 0) == packed.weight_bytes / dense.weight_bytes < 0.4
        assert budget.cost_ratio(models, 1) == early.weight_bytes / dense.weight_bytes < 1


def test_a_drafter_quantized_for_float32_on_the_cpu_warns_and_is_priced_by_its_slow_ops(tmp_path):
    """Quantized for float32 activations on the CPU, a drafter runs torch's packed ops, several
    times slower than the float32 model itself (a Qwen 0.5B int4 forward 3.65x): the runner says so
    when built, and the self-tuning strategies price it by that, so a drafter as large as its
    target is never worth a draft (its bytes alone priced it at a third of one and drafted every
    step, 4-6x slower than plain decoding). bfloat16 keeps the byte price and warns nothing."""
    import warnings

    from csd_engine import Cascade
    from csd_engine.strategies import budget
    from csd_engine.models.quant import TORCH_CPU_PACKED_SLOWDOWN
    model = tiny_llama(seed=12)
    model.save_pretrained(tmp_path / "tiny")
    with pytest.warns(UserWarning, match="quantize='int4g32' with float32 activations on the CPU runs torch's packed "
                                         "matmuls, slower than the unquantized model"):
        engine = Engine(model, drafters=[f"{tmp_path / 'tiny'}:int4g32", "mag"], max_batch_size=1, max_seq_len=64)
    models = engine._decoder_models()
    assert budget.cost_ratio(models, 0) == pytest.approx(TORCH_CPU_PACKED_SLOWDOWN[4])
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = engine.generate([[5, 9, 2, 7]], params, strategy=Autoregressive())[0].token_ids
    for strategy in (Speculative.auto(), Cascade.auto()):
        result = engine.generate([[5, 9, 2, 7]], params, strategy=strategy)[0]
        assert result.token_ids == plain and result.metrics.drafter_forwards[0] == 0, strategy
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        packed = LlamaRunner(model.to(torch.bfloat16), "cpu", torch.bfloat16, quantize="int4g32")
    assert packed.weight_bytes < LlamaRunner(model, "cpu", torch.bfloat16).weight_bytes


def test_graphed_quantized_runner_matches_the_eager_one():
    """GraphedRunner's static-buffer forward (off CUDA a plain call) over a quantized runner."""
    model = tiny_llama(seed=5)
    eager = LlamaRunner(model, "cpu", torch.float32, quantize="int8")
    graphed = GraphedRunner(LlamaRunner(model, "cpu", torch.float32, quantize="int8"), max_tokens=4)
    prefix, nxt = torch.randint(0, VOCAB, (2, 6)), torch.randint(0, VOCAB, (2, 3))
    outs = []
    for runner in (eager, graphed):
        runner.allocate(2, 32)
        runner(ForwardBatch.chain(prefix, runner.cache.lengths, 6, need_logits=False))
        runner.cache.advance(torch.tensor([6, 4]))  # ragged rows
        outs.append(runner(ForwardBatch.chain(nxt, runner.cache.lengths, 9)))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)


def test_engine_keeps_dense_copies_for_a_quantized_drafters_wide_calls_only(tmp_path):
    """A quantized drafter built by the Engine sends calls of more than drafter_dense_rows rows
    (here: the prompts' prefill) through dense copies and stays lossless; a quantized target
    never does (its output is exactly the quantized model's)."""
    from csd_engine.models.quant import DRAFTER_DENSE_ROWS
    model = tiny_llama(seed=12)
    model.save_pretrained(tmp_path / "tiny")
    engine = Engine(target=model, drafters=[f"{tmp_path / 'tiny'}:int4g32"], max_batch_size=3, max_seq_len=96)
    qkv = engine.drafters[0].layers[0]["qkv"]
    assert qkv.dense_rows == DRAFTER_DENSE_ROWS and qkv.dense is not None
    prompts = [p * 4 for p in random_prompts(3, lo=8, hi=12, seed=14)]  # > 16 tokens: a dense prefill
    out = assert_greedy_equals_autoregressive(engine, prompts, Speculative(k=3))
    assert sum(r.metrics.accepted for r in out) > 0
    target = Engine(target=f"{tmp_path / 'tiny'}:int4g32", max_batch_size=1, max_seq_len=32).target
    assert target.layers[0]["qkv"].dense is None


@pytest.mark.parametrize("forced", ["1", "0"])
@pytest.mark.parametrize("native_bf16", [False, True])
def test_a_drafters_dense_copies_take_over_sooner_where_the_bf16_kernel_runs(forced, native_bf16, monkeypatch,
                                                                            tmp_path):
    """Where csd_engine's bf16 CPU kernel runs on a CPU without native bf16, a bf16 quantized
    drafter sends every call of more than 2 rows through its dense copy (4 with int4 weights on
    csd_engine's int4 kernel) and stays lossless; elsewhere (or in fp32, or on another device)
    from 16."""
    from csd_engine import ops
    from csd_engine.models.quant import DRAFTER_DENSE_ROWS, drafter_dense_rows
    monkeypatch.setenv("CSD_BF16_LINEAR", forced)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)  # AMX has native bf16 too
    ops.bf16_kernel_pays.cache_clear()
    try:
        kernel = ops.bf16_kernel_pays() and not native_bf16
        assert drafter_dense_rows("cpu", torch.bfloat16) == (2 if kernel else DRAFTER_DENSE_ROWS)
        assert drafter_dense_rows("cpu", torch.bfloat16, "int4g32") == (2 if kernel else DRAFTER_DENSE_ROWS)
        int4_kernel = ops.int4_kernel_runs("cpu", torch.bfloat16)
        assert drafter_dense_rows("cpu", torch.bfloat16, "int4") == \
            ((4 if int4_kernel else 2) if kernel else DRAFTER_DENSE_ROWS)
        assert drafter_dense_rows("cpu", torch.float32, "int4") == DRAFTER_DENSE_ROWS
        assert drafter_dense_rows("cuda", torch.bfloat16) == DRAFTER_DENSE_ROWS
        model = tiny_llama(seed=12)
        model.save_pretrained(tmp_path / "tiny")
        # batch-invariant: bf16 greedy outputs equal whatever the step's width (no near-tie flips)
        engine = Engine(target=model, drafters=[f"{tmp_path / 'tiny'}:int4g32"], dtype=torch.bfloat16,
                        max_batch_size=2, max_seq_len=64, batch_invariant=True)
        assert engine.drafters[0].layers[0]["qkv"].dense_rows == (2 if kernel else DRAFTER_DENSE_ROWS)
        assert_greedy_equals_autoregressive(engine, random_prompts(2, lo=3, hi=9, seed=5), Speculative(k=3))
    finally:
        monkeypatch.undo()
        ops.bf16_kernel_pays.cache_clear()


@pytest.mark.skipif(not ops.int4_kernel_runs("cpu", torch.bfloat16),
                    reason="csd_engine's int4 kernel does not run here (needs an x86 CPU with AVX2)")
def test_bf16_int4_weights_on_csd_engines_kernel_keep_greedy_decoding_exact(tmp_path):
    """int4g64 weights with bf16 activations take csd_engine's int4 kernel (groups of 64: the tiny
    models' K of 64 and 128); as the target its rows are batch-invariant, so speculative decoding
    gives exactly its autoregressive tokens; as the drafter it keeps speculation lossless."""
    model = tiny_llama(seed=12)
    model.save_pretrained(tmp_path / "tiny")
    spec = f"{tmp_path / 'tiny'}:int4g64"
    engine = Engine(target=spec, drafters=[spec], dtype=torch.bfloat16, max_batch_size=2, max_seq_len=64,
                    batch_invariant=True)
    assert engine.target.layers[0]["qkv"].kernel == "int4" and engine.drafters[0].layers[0]["down"].kernel == "int4"
    out = assert_greedy_equals_autoregressive(engine, random_prompts(2, lo=3, hi=9, seed=5), Speculative(k=3))
    assert sum(r.metrics.accepted for r in out) > 0
    mixed = Engine(target=model, drafters=[spec], dtype=torch.bfloat16, max_batch_size=2, max_seq_len=64,
                   batch_invariant=True)
    assert_greedy_equals_autoregressive(mixed, random_prompts(2, lo=3, hi=9, seed=6), Speculative(k=3))


def test_spec_suffix_loads_a_quantized_runner(tmp_path):
    tiny_qwen2(seed=2).save_pretrained(tmp_path / "tiny")
    runner, _ = load_runner(f"{tmp_path / 'tiny'}:int4g32", "cpu", torch.float32)
    assert runner.quantize == "int4g32" and isinstance(runner.layers[0]["qkv"], QuantizedLinear)
    same, _ = load_runner(str(tmp_path / "tiny"), "cpu", torch.float32, quantize="int4g32")
    ids = torch.randint(0, VOCAB, (1, 5))
    torch.testing.assert_close(_native_logits_in_steps(runner, ids, []), _native_logits_in_steps(same, ids, []))
    assert split_spec("qwen2.5-coder-0.5b:int8") == ("qwen2.5-coder-0.5b", "int8", None)
    assert split_spec("qwen2.5-coder-0.5b:int4g64[:12]") == ("qwen2.5-coder-0.5b", "int4g64", 12)
    assert split_spec(str(tmp_path / "tiny")) == (str(tmp_path / "tiny"), None, None)


@pytest.mark.parametrize("bad", ["int3", "int4g16", "fp8", "INT8", "int4g"])
def test_unknown_schemes_are_refused(bad):
    with pytest.raises(ValueError, match="unknown quantization scheme"):
        load_runner(tiny_llama(), "cpu", torch.float32, quantize=bad)
    with pytest.raises(ValueError, match="unknown quantization scheme"):
        quantize_weight(torch.randn(32, 64), bad)


def test_generic_runner_and_loaded_runners_refuse_quantize():
    with pytest.raises(ValueError, match="need the native runner.*'gpt2'"):
        load_runner(tiny_gpt2(), "cpu", torch.float32, quantize="int8")
    with pytest.raises(ValueError, match="need the native runner.*native=False"):
        load_runner(tiny_llama(), "cpu", torch.float32, native=False, quantize="int8")
    runner = LlamaRunner(tiny_llama(), "cpu", torch.float32)
    with pytest.raises(ValueError, match="already a runner"):
        load_runner(runner, "cpu", torch.float32, quantize="int8")


def test_shapes_and_dtypes_the_ops_cannot_take_are_refused():
    with pytest.raises(ValueError, match="K=64 .* multiple of the group size 128"):
        LlamaRunner(tiny_llama(), "cpu", torch.float32, quantize="int4")  # hidden 64 < one group of 128
    with pytest.raises(ValueError, match="lm_head.weight: .* multiple of 16.* N=88"):
        LlamaRunner(tiny_llama(vocab=88), "cpu", torch.float32, quantize="int4g32")
    LlamaRunner(tiny_llama(vocab=88), "cpu", torch.float32, quantize="int8")  # int8 takes any shape
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        quantize_weight(torch.randn(32, 64, dtype=torch.float64), "int8")
    layer = quantize_weight(torch.randn(32, 64), "int8")
    with pytest.raises(ValueError, match="quantized for torch.float32 activations, got torch.bfloat16"):
        layer(torch.randn(2, 64, dtype=torch.bfloat16))


def test_a_weight_with_nan_or_inf_is_refused_by_name():
    from csd_engine.models.quant import quantize_values
    for bad in (float("nan"), float("inf")):
        w = torch.randn(16, 128)
        w[5, 7] = bad
        for scheme in ("int8", "int4"):
            with pytest.raises(ValueError, match="non-finite values .* rows 0..15: it cannot be quantized"):
                quantize_values(w, scheme, torch.bfloat16)
