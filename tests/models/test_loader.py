"""The loader: end-of-sequence ids from every source, hub revisions, and a `.gguf` path that
loads exactly like the zoo's folder built from the same GGUF."""
import sys

import pytest
import torch
from transformers import AutoTokenizer

from csd_engine import Engine, SamplingParams
from csd_engine.models import zoo
from csd_engine.models.llama import LlamaRunner
from csd_engine.models.loader import _split_revision, eos_token_ids, load_runner
from tests.tiny_models import hf_greedy, tiny_llama


class _Tokenizer:
    def __init__(self, eos):
        self.eos_token_id = eos


def test_eos_ids_come_from_the_tokenizer_and_the_generation_config():
    model = tiny_llama(seed=1)
    assert eos_token_ids(model) == ()
    model.generation_config.eos_token_id = [7, 3]
    model.config.eos_token_id = 3
    assert eos_token_ids(model, _Tokenizer(9)) == (3, 7, 9)
    model.generation_config.eos_token_id = 5
    assert eos_token_ids(model, _Tokenizer(None)) == (3, 5)
    runner, _ = load_runner(model, torch.device("cpu"), torch.float32)
    assert runner.eos_token_ids == (3, 5)


def test_hub_ids_take_a_revision():
    assert _split_revision("org/name") == ("org/name", {})
    assert _split_revision("org/name@v1.0") == ("org/name", {"revision": "v1.0"})
    with pytest.raises(ValueError, match="'org/name@revision'"):
        _split_revision("org/name@")


@pytest.mark.slow
def test_a_gguf_path_loads_like_the_zoo_folder():
    """Same dequantization, same EOS repair: the engine's target from the GGUF and from the
    zoo's bfloat16 folder built from it hold equal weights, EOS ids and tokens generated."""
    gguf, folder = zoo.fetch_gguf("smollm2-135m"), zoo.resolve("smollm2-135m")
    engines = [Engine(str(path), dtype=torch.bfloat16, max_batch_size=1, max_seq_len=64, verify_backend="torch")
               for path in (gguf, folder)]
    runners = [engine.target for engine in engines]
    assert all(isinstance(r, LlamaRunner) for r in runners)
    for name in ("embed", "lm_head", "final_norm"):
        assert torch.equal(getattr(runners[0], name), getattr(runners[1], name)), name
    for i, (a, b) in enumerate(zip(runners[0].layers, runners[1].layers)):
        for name in a:
            assert (a[name] is None and b[name] is None) or torch.equal(a[name], b[name]), (i, name)
    assert engines[0].tokenizer.eos_token_id == AutoTokenizer.from_pretrained(folder).eos_token_id
    assert runners[0].eos_token_ids == runners[1].eos_token_ids
    assert engines[0].tokenizer.eos_token_id in runners[0].eos_token_ids

    results = [engine.generate(["The capital of France is"], SamplingParams(max_new_tokens=8))[0] for engine in engines]
    assert results[0].token_ids == results[1].token_ids and results[0].text == results[1].text


def test_what_the_native_runner_cannot_compute_goes_to_the_generic_one_or_is_refused():
    """A GELU MLP on a native architecture (dynamic RoPE: below): the generic runner, whose
    greedy tokens are transformers' own (the native one silently diverged); native=True names
    why not."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from csd_engine.models.hf import HFRunner
    from tests.tiny_models import _finish
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=16)
    for extra, words in ((dict(hidden_act="gelu"), "hidden_act 'gelu'"),):
        model = _finish(LlamaForCausalLM(LlamaConfig(**base, **extra)), seed=4, scale=1.5)
        engine = Engine(model, max_batch_size=1, max_seq_len=48)
        assert isinstance(engine.target, HFRunner)
        prompt = [5, 9, 2, 7]
        assert engine.generate([prompt], SamplingParams(max_new_tokens=30))[0].token_ids == hf_greedy(model, prompt, 30)
        with pytest.raises(ValueError, match=words):
            Engine(model, max_batch_size=1, max_seq_len=48, native=True)


def test_a_sliding_window_bounds_max_seq_len():
    """Full attention equals a sliding window's while the sequence fits in it: inside, Mistral's
    and Qwen2's windows run (exactly transformers' tokens); past it, refused by name."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from tests.tiny_models import _finish
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512)
    models = [_finish(MistralForCausalLM(MistralConfig(**base, sliding_window=400)), seed=5, scale=1.5),
              _finish(Qwen2ForCausalLM(Qwen2Config(**base, sliding_window=400, use_sliding_window=True,
                                                   max_window_layers=0)), seed=6, scale=1.5)]
    for model in models:
        for native in (None, False):
            with pytest.raises(ValueError, match=r"sliding window of 400 tokens.*max_seq_len must be at most 144"):
                Engine(model, max_batch_size=1, max_seq_len=145, native=native)
            engine = Engine(model, max_batch_size=1, max_seq_len=64, native=native)
            prompt = [3, 1, 4, 1, 5]
            assert engine.generate([prompt], SamplingParams(max_new_tokens=20))[0].token_ids == \
                hf_greedy(model, prompt, 20)


def test_a_learned_position_table_bounds_max_seq_len():
    """GPT-2 learns embeddings for n_positions positions and fails past them: the engine bounds
    max_seq_len by the table less the drafts' headroom (refused by name above it, the largest
    that fits when not given), and speculation then runs exactly to the end, where its drafts
    go past max_seq_len into positions the table must still hold."""
    from csd_engine import Autoregressive, Cascade, Speculative, Staged
    from csd_engine.scheduler import HEADROOM
    from tests.tiny_models import perturbed, tiny_gpt2

    target = tiny_gpt2(seed=3)  # n_positions 512
    drafter = perturbed(target, noise=0.2, seed=4)
    limit = 512 - HEADROOM
    with pytest.raises(ValueError, match=rf"learned embeddings for 512 positions.*max_seq_len must be at most {limit}"):
        Engine(target, max_batch_size=1, max_seq_len=limit + 1)
    with pytest.raises(ValueError, match=rf"drafter 0 has learned embeddings.*at most {limit}, got 300"):
        Engine(tiny_llama(seed=0), drafters=[drafter], max_batch_size=1, max_seq_len=300)
    engine = Engine(target, drafters=[drafter, "mag"], max_batch_size=1)
    assert engine.max_seq_len == limit
    prompt = ([5, 9, 2, 7, 3] * 60)[:limit - 6]  # repetitive: MaG matches to the end
    params = SamplingParams(max_new_tokens=50)
    plain = engine.generate([prompt], params, strategy=Autoregressive())[0]
    assert plain.finish_reason == "length" and len(plain.token_ids) == 6
    for strategy in (Speculative(k=4), Cascade(k_matrix=[[2, 2], [0, 2]], mag_tokens=2), Staged(branching=(2, 2))):
        assert engine.generate([prompt], params, strategy=strategy)[0].token_ids == plain.token_ids, strategy


def test_model_specs_users_write():
    """A pathlib.Path and '~' work like the path; a quantization suffix in any case works; one
    out of order is refused by its form, not 'did you mean'; a transformers model that is not a
    causal LM is refused at load; the generic runner leaves the caller's model as it was."""
    import pathlib

    from transformers import BertConfig, BertModel

    from csd_engine.models.loader import split_spec
    from tests.tiny_models import tiny_gpt2
    assert split_spec("smollm2-135m:INT4") == ("smollm2-135m", "int4", None)
    assert split_spec("~/m:int8[:2]")[0] == str(pathlib.Path.home() / "m")
    with pytest.raises(ValueError, match=r"cannot read its suffix; a spec is MODEL\[:int8"):
        split_spec("smollm2-135m[:4]:int8")
    with pytest.raises(TypeError, match="must be a causal language model .* got BertModel"):
        Engine(BertModel(BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=64)))
    gpt2 = tiny_gpt2(seed=3).to(torch.bfloat16)
    Engine(gpt2, max_batch_size=1, max_seq_len=32)  # float32
    assert next(gpt2.parameters()).dtype == torch.bfloat16


def test_a_path_object_and_a_broken_gguf(tmp_path):
    model = tiny_llama(seed=2)
    model.save_pretrained(tmp_path / "tiny")
    engine = Engine(tmp_path / "tiny", drafters=tmp_path / "tiny", max_batch_size=1, max_seq_len=32)
    assert engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))[0].token_ids == hf_greedy(model, [1, 2, 3], 4)
    broken = tmp_path / "cut.GGUF"  # a header cut short (and the extension in capitals)
    broken.write_bytes(zoo.fetch_gguf("smollm2-135m").read_bytes()[:100])
    with pytest.raises(ValueError, match=r"cut\.GGUF' is not a model"):
        Engine(str(broken))


def test_a_gguf_without_the_gguf_extra_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if not installed
    with pytest.raises(ImportError, match=r"needs the gguf and accelerate packages: pip install 'csd_engine\[gguf\]'"):
        Engine(str(zoo.fetch_gguf("smollm2-135m")))


def test_a_hub_id_without_a_network_fails_at_once(monkeypatch):
    """No retries for most of a minute: an unreachable hub loads only what its cache holds."""
    from csd_engine.models import loader
    monkeypatch.setattr(loader, "_hub_reachable", lambda: False)
    with pytest.raises(ValueError, match=r"'org/no-such-model' is not a model.*the hub is not reachable from here"):
        Engine("org/no-such-model")



def test_max_seq_len_past_the_trained_positions_warns_and_the_default_stays_within():
    """Plain RoPE computes past max_position_embeddings, but the model never saw those positions:
    left out, max_seq_len stays within the positions every model was trained on (a drafter's
    too); asked past them, the engine warns naming the model and still runs it."""
    target, drafter = tiny_llama(seed=0), tiny_llama(seed=1)  # max_position_embeddings 512
    drafter.config.max_position_embeddings = 300
    assert Engine(target, max_batch_size=1).max_seq_len == 512
    assert Engine(target, drafters=[drafter, "mag"], max_batch_size=1).max_seq_len == 300
    with pytest.warns(UserWarning, match=r"max_seq_len=600 .* 512 positions the target was trained on") as caught:
        engine = Engine(target, drafters=["mag"], max_batch_size=1, max_seq_len=600)
    assert engine.max_seq_len == 600 and caught[0].filename == __file__
    with pytest.warns(UserWarning, match=r"300 positions drafter 0 was trained on"):
        Engine(target, drafters=[drafter], max_batch_size=1, max_seq_len=400)

def _llama_with_rope(seed: int, **rope):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny_models import _finish
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_parameters={"rope_theta": 10000.0, **rope})
    return _finish(LlamaForCausalLM(config), seed=seed, scale=1.5)


@pytest.mark.parametrize("rope", ["longrope", "dynamic"])
def test_rope_that_changes_with_length_bounds_max_seq_len(rope):
    """LongRoPE switches to its long factors, dynamic NTK rescales its frequencies, once a
    forward reaches past a length (400 here): a verification forward there would rotate its
    tokens otherwise than one-token decoding does, so max_seq_len stays below it (refused by
    name above it, the largest that fits by default). Below it every strategy is plain
    decoding and transformers' own greedy output, on the native runner and the generic one; the
    native runner takes the frequencies of the model as loaded, also after transformers ran it
    past the length."""
    from csd_engine import Autoregressive, Speculative
    from csd_engine.models.hf import HFRunner
    from csd_engine.scheduler import HEADROOM

    half = 8  # head_dim 16
    if rope == "longrope":
        model = _llama_with_rope(7, rope_type="longrope", original_max_position_embeddings=400,
                                 short_factor=[1.0 + 0.1 * i for i in range(half)],
                                 long_factor=[2.0 + 0.5 * i for i in range(half)])
        words = "long rotary factors"
    else:
        model = _llama_with_rope(7, rope_type="dynamic", factor=4.0)
        model.config.max_position_embeddings = 400
        model.model.rotary_emb.max_seq_len_cached = model.model.rotary_emb.original_max_seq_len = 400
        words = "rescales its rotary frequencies"
    limit = 400 - HEADROOM
    with pytest.raises(ValueError, match=rf"{words} .*past 400 positions.*max_seq_len must be at most {limit}"):
        Engine(model, max_batch_size=1, max_seq_len=limit + 1)
    prompt = ([5, 9, 2, 7, 3] * 40)[:limit - 30]  # repetitive: MaG's drafts reach into the headroom
    params = SamplingParams(max_new_tokens=40)
    expected = hf_greedy(model, prompt, 30)
    for native, runner in ((None, LlamaRunner), (False, HFRunner)):
        engine = Engine(model, drafters=["mag"], max_batch_size=1, native=native)
        assert engine.max_seq_len == limit and isinstance(engine.target, runner)
        plain = engine.generate([prompt], params, strategy=Autoregressive())[0]
        assert plain.token_ids == expected
        assert engine.generate([prompt], params, strategy=Speculative(k=8))[0].token_ids == expected
    with torch.no_grad():
        model(torch.tensor([prompt * 2]))  # past 400: transformers now holds other frequencies
    again = Engine(model, max_batch_size=1).generate([prompt], params, strategy=Autoregressive())[0]
    assert again.token_ids == plain.token_ids


def test_a_quantized_checkpoint_runs_on_the_generic_runner():
    """A checkpoint with a quantization_config holds layers with scales (FP8, int8...) the
    native runner would read as dense weights: it runs on transformers' own modules instead,
    and native=True is refused by name."""
    from csd_engine.models.hf import HFRunner

    model = tiny_llama(seed=2)
    model.config.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    runner, _ = load_runner(model, torch.device("cpu"), torch.float32)
    assert isinstance(runner, HFRunner)
    with pytest.raises(ValueError, match="quantized checkpoint"):
        load_runner(model, torch.device("cpu"), torch.float32, native=True)


def test_architectures_that_read_masks_otherwise_decode_exactly():
    """XGLM adds a 4-D attention mask to its scores and MPT reads a boolean one as the keys to
    hide: the generic runner passes an additive mask, so plain decoding is transformers' greedy
    output and a speculative step (a many-token forward) gives the same tokens."""
    from transformers import MptConfig, MptForCausalLM, XGLMConfig, XGLMForCausalLM

    from csd_engine import Autoregressive, Speculative
    from tests.tiny_models import _finish, perturbed

    models = [_finish(XGLMForCausalLM(XGLMConfig(vocab_size=96, d_model=64, ffn_dim=128, num_layers=2,
                                                 attention_heads=4, max_position_embeddings=512)), seed=3, scale=1.5),
              _finish(MptForCausalLM(MptConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, max_seq_len=512)),
                      seed=4, scale=1.5)]
    prompts = [[5, 9, 2, 7, 3, 11, 4], [1, 2, 3, 1, 2, 3, 1, 2]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    for model in models:
        engine = Engine(model, drafters=[perturbed(model, noise=0.1, seed=5)], max_batch_size=2, max_seq_len=96,
                        verify_backend="torch")
        plain = [r.token_ids for r in engine.generate(prompts, params, strategy=Autoregressive())]
        assert plain == [hf_greedy(model, p, 12) for p in prompts], type(model).__name__
        assert [r.token_ids for r in engine.generate(prompts, params, strategy=Speculative(k=4))] == plain


def test_a_model_the_generic_runner_cannot_run_exactly_is_refused_at_load(monkeypatch):
    """The generic runner checks at load that one three-token forward (cache, 4-D mask,
    positions) gives three one-token forwards' logits: a state-space model (no KV cache) and an
    ALiBi model that cannot take the mask are refused by name, and so is a model that reads the
    mask otherwise (MPT with a boolean one), instead of decoding wrongly."""
    from transformers import BloomConfig, BloomForCausalLM, MambaConfig, MambaForCausalLM, MptConfig, MptForCausalLM

    from csd_engine.models.hf import HFRunner
    from tests.tiny_models import _finish

    for model in (MambaForCausalLM(MambaConfig(vocab_size=96, hidden_size=64, state_size=8, num_hidden_layers=2)),
                  BloomForCausalLM(BloomConfig(vocab_size=96, hidden_size=64, n_layer=2, n_head=4))):
        with pytest.raises(ValueError, match=rf"model_type '{model.config.model_type}' cannot run on csd_engine's "
                                             "generic runner: a forward over a cached prefix"):
            Engine(model, max_batch_size=1, max_seq_len=64)
    mpt = _finish(MptForCausalLM(MptConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, max_seq_len=512)),
                  seed=4, scale=1.5)
    monkeypatch.setattr(HFRunner, "_additive", lambda self, seen: seen[None, None])  # a boolean mask
    with pytest.raises(ValueError, match="model_type 'mpt' cannot run on csd_engine's generic runner exactly"):
        Engine(mpt, max_batch_size=1, max_seq_len=64)


def test_a_model_whose_state_a_rollback_cannot_cut_is_refused_at_load():
    """A hybrid model whose layers keep a convolution state (LFM2) decodes one prompt, but a
    rejected draft (or a shorter neighbour's prefill) must cut its cache back: refused by name
    when the engine is built, not with transformers' error in the middle of a generation."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    model = Lfm2ForCausalLM(Lfm2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                       layer_types=["conv", "full_attention"]))
    with pytest.raises(ValueError, match="model_type 'lfm2' cannot run on csd_engine's generic runner: its cache "
                                         "cannot be cut back to a shorter prefix"):
        Engine(model, max_batch_size=2, max_seq_len=64)


def test_tree_strategies_refuse_a_model_whose_attention_reads_the_cache_slot():
    """A tree node sits at a cache slot past its position. MPT's ALiBi biases by slot distance and
    GPT-Neo's local layers mask by slot, so their trees' tokens were not plain decoding's: the
    tree strategies refuse them by name when they start (chain strategies stay exact), and the
    engine serves on. So are sliding-window cache layers (Mistral's on the generic runner), whose keys
    tree compaction cannot move. A model whose attention reads positions only (GPT-2) still runs trees."""
    from transformers import (GPTNeoConfig, GPTNeoForCausalLM, MistralConfig, MistralForCausalLM, MptConfig,
                              MptForCausalLM)

    from csd_engine import Autoregressive, Cascade, Speculative, Staged
    from tests.tiny_models import _finish, perturbed, tiny_gpt2

    mpt = _finish(MptForCausalLM(MptConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, max_seq_len=512)),
                  seed=4, scale=1.5)
    neo = _finish(GPTNeoForCausalLM(GPTNeoConfig(vocab_size=96, hidden_size=64, num_layers=2, num_heads=4,
                                                 max_position_embeddings=512, window_size=16,
                                                 attention_types=[[["global", "local"], 1]])), seed=4, scale=1.5)
    mistral = _finish(MistralForCausalLM(MistralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=400, max_position_embeddings=512)), seed=3, scale=1.5)
    prompts = [[5, 17, 33, 2, 9, 41, 7], [3, 8]]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    trees = (Staged(branching=(2, 2, 1)), Cascade(k_matrix=[[2, 1], [0, 2]], lenience=2, mag_tokens=2, tree=(3, 2)),
             Cascade.auto(tree=(3, 2)))
    refusals = ((mpt, "do not change with a token.s position_ids"), (neo, "local attention layers .window_size 16."),
                (mistral, "sliding-window or non-attention layers"))
    for model, why in refusals:
        engine = Engine(model, drafters=[perturbed(model, noise=0.1, seed=5), "mag"], max_batch_size=2,
                        max_seq_len=64, verify_backend="torch", native=False)
        plain = [r.token_ids for r in engine.generate(prompts, params, strategy=Autoregressive())]
        for strategy in trees:
            with pytest.raises(ValueError, match=f"checks token trees, which the engine's target cannot compute "
                                                 f"exactly: .*{why}.*use a chain strategy"):
                engine.generate(prompts, params, strategy=strategy)
        assert [r.token_ids for r in engine.generate(prompts, params, strategy=Speculative(k=3))] == plain
    gpt2 = tiny_gpt2()
    engine = Engine(gpt2, drafters=[perturbed(gpt2, noise=0.1, seed=5)], max_batch_size=2, max_seq_len=64,
                    verify_backend="torch")
    assert engine.target.tree_limit is None
    plain = [r.token_ids for r in engine.generate(prompts, params, strategy=Autoregressive())]
    assert [r.token_ids for r in engine.generate(prompts, params, strategy=Staged(branching=(2, 2, 1)))] == plain


def test_a_model_passed_in_as_an_application_holds_it():
    """A model in training mode stays in it (the native runner copies what it runs); a generic
    runner's model switched back to training is run in eval (no dropout); a torch.compile'd model
    runs as the model it wraps; weights left on the meta device are refused by name; an engine
    built under inference_mode works outside it."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from tests.tiny_models import tiny_gpt2
    params = SamplingParams(max_new_tokens=6)
    model = tiny_llama().train()
    plain = Engine(model, max_batch_size=1, max_seq_len=32).generate([[1, 2, 3]], params)[0].token_ids
    assert model.training and all(m.training for m in model.modules())
    assert Engine(torch.compile(tiny_llama()), max_batch_size=1, max_seq_len=32).generate(
        [[1, 2, 3]], params)[0].token_ids == plain
    with torch.inference_mode():
        made_inside = Engine(tiny_llama(), max_batch_size=1, max_seq_len=32)
    assert made_inside.generate([[1, 2, 3]], params)[0].token_ids == plain
    gpt2 = tiny_gpt2()
    generic = Engine(gpt2, max_batch_size=1, max_seq_len=32)
    first = generic.generate([[1, 2, 3]], params)[0].token_ids
    gpt2.train()
    assert [generic.generate([[1, 2, 3]], params)[0].token_ids for _ in range(3)] == [first] * 3
    with torch.device("meta"):
        meta = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="weights are not all loaded .*load them into memory first"):
        Engine(meta)


def test_tied_embeddings_stay_one_tensor_when_cast():
    """A tied model cast to the engine's dtype keeps one copy of its embedding for the head (a
    second would cost the vocabulary's rows again); an untied one keeps both."""
    tied, _ = load_runner(tiny_llama(tie=True), "cpu", torch.bfloat16)
    untied, _ = load_runner(tiny_llama(), "cpu", torch.bfloat16)
    assert tied.lm_head is tied.embed and untied.lm_head is not untied.embed


def test_the_generic_runner_casts_parameters_only_and_never_the_callers_model():
    """A model whose parameters are already in the engine's dtype is run as it is, its float32
    RoPE buffer kept float32 (as transformers keeps it, so the tokens are its generate's); one
    with a parameter in another dtype is copied, the caller's left as it was."""
    model = tiny_llama().to(torch.bfloat16)
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.float()
    engine = Engine(model, dtype=torch.bfloat16, native=False, max_batch_size=1, max_seq_len=32)
    assert engine.target.model is model and model.model.rotary_emb.inv_freq.dtype == torch.float32
    mixed = tiny_llama()
    mixed.model.norm.to(torch.bfloat16)
    other = Engine(mixed, dtype=torch.float32, native=False, max_batch_size=1, max_seq_len=32)
    assert other.target.model is not mixed and mixed.model.norm.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in other.target.model.parameters())
