"""Early-exit drafters (`LlamaRunner.truncated`, spec suffix `[:L]`): the first L layers, then the
model's own final norm and head, on the same weight tensors and a cache of their own."""
import copy

import pytest
import torch

from csd_engine import Engine, Speculative
from csd_engine.models.llama import LlamaRunner
from csd_engine.models.loader import load_runner
from csd_engine.models.quant import QuantizedLinear
from csd_engine.models.runner import ForwardBatch
from tests.models.test_llama import _native_logits_in_steps
from tests.strategies.common import assert_greedy_equals_autoregressive
from tests.tiny_models import VOCAB, random_prompts, tiny_llama, tiny_qwen2


def first_layers(model, layers: int):
    """A transformers model of only the first `layers` decoder layers (+ final norm and head)."""
    short = copy.deepcopy(model)
    short.model.layers = short.model.layers[:layers]
    short.config.num_hidden_layers = layers
    return short


def tensors(runner):
    """Every weight tensor a runner reads, by name (a quantized matrix by its packed tensors)."""
    out = {"embed": runner.embed, "final_norm": runner.final_norm}
    for name, w in [("lm_head", runner.lm_head)] + [(f"{i}.{k}", v) for i, layer in enumerate(runner.layers)
                                                     for k, v in layer.items()]:
        if isinstance(w, QuantizedLinear):
            out[name + ".packed"], out[name + ".scales"] = w.packed, w.scales
        elif w is not None:
            out[name] = w
    return out


# the fused kernels (interpreted here: slow) run for one depth
@pytest.mark.parametrize("layers,fused", [(1, False), (2, False), (3, False), (2, True)],
                         ids=["1-plain", "2-plain", "3-plain", "2-fused"])
@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2-tied-bias"])
def test_truncated_logits_match_the_first_layers_in_transformers(make, fused, layers):
    model = make(seed=int(torch.randint(0, 1000, (1,))), layers=4)
    short = first_layers(model, layers)
    ids = torch.randint(0, VOCAB, (3, 17))
    with torch.no_grad():
        ref64 = copy.deepcopy(short).double()(ids, use_cache=False).logits
        hf32 = short(ids, use_cache=False).logits.double()
    full = LlamaRunner(model, "cpu", torch.float32, fused=fused)
    ours = _native_logits_in_steps(full.truncated(layers), ids, splits=[5, 6, 11]).double()
    hf_err, our_err = (hf32 - ref64).abs().max().item(), (ours - ref64).abs().max().item()
    print(f"L={layers}: transformers fp32 max err {hf_err:.2e}; truncated runner {our_err:.2e}")
    assert our_err <= 4 * hf_err + 1e-6


@pytest.mark.parametrize("quantize", [None, "int4g32"])
def test_truncated_shares_every_weight_and_owns_its_cache(quantize):
    model = tiny_llama(seed=3, layers=4)
    full = LlamaRunner(model, "cpu", torch.float32, quantize=quantize)
    view = full.truncated(2)
    shared, ours = tensors(full), tensors(view)
    assert set(ours) <= set(shared) and len(ours) > 10
    for name, t in ours.items():
        assert t.data_ptr() == shared[name].data_ptr(), name
    assert view.num_layers == 2 and full.num_layers == 4
    assert view.num_params == full.num_params - sum(full.layer_params[2:])
    # Separate caches: the view's forwards leave the full model's cache and logits unchanged.
    ids = torch.randint(0, VOCAB, (2, 9))
    full.allocate(2, 32)
    full(ForwardBatch.chain(ids[:, :6], full.cache.lengths, 6, need_logits=False))
    full.cache.advance(torch.full((2,), 6))
    before = full.cache.k.clone(), full.cache.v.clone()
    view.allocate(2, 32)
    assert view.cache.k.shape[0] == 2 and view.cache.k.data_ptr() != full.cache.k.data_ptr()
    view(ForwardBatch.chain(ids, view.cache.lengths, 9))
    assert torch.equal(full.cache.k, before[0]) and torch.equal(full.cache.v, before[1])
    assert full.cache.lengths.tolist() == [6, 6] and view.cache.lengths.tolist() == [0, 0]
    logits = full(ForwardBatch.chain(ids[:, 6:], full.cache.lengths, 9))
    torch.testing.assert_close(logits, _native_logits_in_steps(LlamaRunner(model, "cpu", torch.float32,
                                                                           quantize=quantize), ids, [])[:, 6:])


@pytest.mark.parametrize("layers", [0, 5, -1, True, 2.0, "2"])
def test_layers_out_of_range_are_refused(layers):
    runner = LlamaRunner(tiny_llama(layers=4), "cpu", torch.float32)
    with pytest.raises(ValueError, match="keeps 1 to 4 layers"):
        runner.truncated(layers)


def test_spec_suffix_truncates_and_quantizes(tmp_path):
    folder = tmp_path / "tiny"
    tiny_qwen2(seed=6, layers=3).save_pretrained(folder)
    short, _ = load_runner(f"{folder}[:2]", "cpu", torch.float32)
    both, _ = load_runner(f"{folder}:int4g32[:1]", "cpu", torch.float32)
    assert short.num_layers == 2 and short.quantize is None
    assert both.num_layers == 1 and isinstance(both.layers[0]["down"], QuantizedLinear)
    with pytest.raises(ValueError, match="keeps 1 to 3 layers"):
        load_runner(f"{folder}[:4]", "cpu", torch.float32)


def test_early_exit_drafter_keeps_speculation_lossless():
    """The sharing use: the target's own runner and its early exit in one engine."""
    target = LlamaRunner(tiny_llama(seed=8, layers=4), "cpu", torch.float32)
    engine = Engine(target=target, drafters=[target.truncated(3)], max_batch_size=3, max_seq_len=64)
    assert engine.drafters[0].cache is not engine.target.cache
    assert_greedy_equals_autoregressive(engine, random_prompts(3, seed=14), Speculative(k=3))
