"""What an application embedding the engine does around it: its autocast, its modified or
training-mode models, one runner handed in twice. The engine computes plain decoding's tokens
anyway, or refuses by name, and leaves the application's objects as it found them."""
import pytest
import torch

from csd_engine import Autoregressive, Engine, SamplingParams, Speculative
from csd_engine.models.hf import HFRunner
from csd_engine.models.llama import LlamaRunner
from tests.tiny_models import hf_greedy, random_prompts, tiny_gpt2, tiny_llama

PROMPTS = random_prompts(3, seed=1)
PARAMS = SamplingParams(max_new_tokens=8)


def _tokens(engine, strategy=None):
    return [r.token_ids for r in engine.generate(PROMPTS, PARAMS, strategy=strategy)]


@pytest.mark.parametrize("native", [None, False])
def test_a_callers_autocast_does_not_reach_the_engines_forwards(native):
    """Under the caller's torch.autocast(bfloat16) a float32 engine computes in float32 as
    always: the same tokens and logprobs (the native runner had failed on its float32 cache,
    the generic one had silently computed in bfloat16)."""
    engine = Engine(tiny_llama(seed=5, scale=0.5), drafters=["mag"], max_batch_size=3, max_seq_len=64, native=native)
    params = SamplingParams(max_new_tokens=8, logprobs=True)
    for strategy in (Autoregressive(), Speculative(k=3)):
        expected = engine.generate(PROMPTS, params, strategy=strategy)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = engine.generate(PROMPTS, params, strategy=strategy)
            assert torch.is_autocast_enabled("cpu")  # the caller's context is theirs again after each step
        assert [r.token_ids for r in got] == [r.token_ids for r in expected], strategy
        assert [r.logprobs for r in got] == [r.logprobs for r in expected], strategy


def test_one_runner_in_two_roles_is_refused_by_name():
    """A runner holds one KV cache: as the target and a drafter, or as two drafters, each would
    overwrite the other's (Speculative had emitted other tokens, a cascade crashed inside)."""
    runner = Engine(tiny_llama(seed=5), max_batch_size=3, max_seq_len=64).target
    other = Engine(tiny_llama(seed=6), max_batch_size=3, max_seq_len=64).target
    with pytest.raises(ValueError, match=r"drafter 0 is the same LlamaRunner object as the target: .*pass the model"):
        Engine(runner, drafters=[runner], max_batch_size=3, max_seq_len=64)
    with pytest.raises(ValueError, match=r"drafter 1 is the same LlamaRunner object as drafter 0"):
        Engine(runner, drafters=[other, other, "mag"], max_batch_size=3, max_seq_len=64)
    model = tiny_llama(seed=5)  # a model twice is fine: each role gets a runner of its own
    engine = Engine(model, drafters=[model], max_batch_size=3, max_seq_len=64)
    assert _tokens(engine, Speculative(k=3)) == _tokens(engine, Autoregressive())


class _Adapted(torch.nn.Module):
    """A low-rank adapter around a projection, laid out as peft's lora.Linear is."""

    def __init__(self, base: torch.nn.Linear, seed: int):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.base_layer = base
        self.lora_A = torch.nn.Linear(base.in_features, 4, bias=False)
        self.lora_B = torch.nn.Linear(4, base.out_features, bias=False)
        with torch.no_grad():
            self.lora_A.weight.copy_(torch.randn(self.lora_A.weight.shape, generator=generator))
            self.lora_B.weight.copy_(torch.randn(self.lora_B.weight.shape, generator=generator))

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def test_a_model_the_native_runner_would_not_compute_runs_on_the_generic_one():
    """The native runner reads weights by name and computes the layers itself: a model with an
    adapter around its projections (it had failed with a bare KeyError) or a forward hook (it
    had been silently ignored) runs on the generic runner, giving the modified model's own
    greedy tokens; native=True names the module. transformers' own output-recording hooks,
    left after a call with output_hidden_states, do not count."""
    adapted = tiny_llama(seed=2)
    for i, layer in enumerate(adapted.model.layers):
        layer.self_attn.q_proj = _Adapted(layer.self_attn.q_proj, seed=i)
    hooked = tiny_llama(seed=3)
    hooked.lm_head.register_forward_hook(lambda module, inputs, out: out.flip(-1))
    for model, words in ((adapted, r"model.layers.0.self_attn.q_proj is a _Adapted, not a torch.nn.*Linear"),
                         (hooked, r"lm_head has forward hooks")):
        engine = Engine(model, drafters=["mag"], max_batch_size=3, max_seq_len=64)
        assert isinstance(engine.target, HFRunner)
        assert _tokens(engine, Speculative(k=3)) == [hf_greedy(model, p, 8) for p in PROMPTS]
        with pytest.raises(ValueError, match=rf"native runner cannot run this model: {words}"):
            Engine(model, max_batch_size=1, native=True)
    recorded = tiny_llama(seed=4)
    recorded(torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    assert isinstance(Engine(recorded, max_batch_size=1).target, LlamaRunner)


def test_a_model_in_training_mode_decodes_in_eval_and_stays_in_training():
    """The generic runner runs the caller's own model (no copy when dtype and device match):
    without dropout while it decodes, and with every module's mode as the caller left it
    afterwards, so a training loop that samples with the engine keeps training with dropout."""
    model = tiny_gpt2(seed=1)
    expected = [hf_greedy(model.eval(), p, 8) for p in PROMPTS]
    model.train()
    model.transformer.h[0].eval()  # a module the caller keeps in eval
    modes = {name: m.training for name, m in model.named_modules()}
    engine = Engine(model, drafters=["mag"], max_batch_size=3, max_seq_len=64)
    assert engine.target.model is model
    assert {name: m.training for name, m in model.named_modules()} == modes
    assert _tokens(engine, Speculative(k=3)) == expected
    assert {name: m.training for name, m in model.named_modules()} == modes
