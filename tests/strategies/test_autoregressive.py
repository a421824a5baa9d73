"""Autoregressive decoding: exact greedy equality with transformers, sampling by distribution,
per-request seeds, stop handling, and errors that leave the engine usable."""
import copy as copy_module
import dataclasses
import math
import pickle
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

import csd_engine
from csd_engine import Autoregressive, Cascade, Engine, Pearl, SamplingParams, Speculative, Staged
from tests.strategies.common import assert_samples_follow_target
from tests.tiny_models import VOCAB, random_prompts, tiny_gpt2, tiny_llama, tiny_qwen2


def hf_greedy(model, prompt, n):
    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             generation_config=cfg)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2, tiny_gpt2], ids=["llama", "qwen2", "gpt2-generic"])
def test_greedy_equals_transformers_generate_batched_and_ragged(make):
    model = make(seed=11)
    prompts = random_prompts(4, lo=1, hi=15, seed=int(torch.randint(0, 10**6, (1,))))
    engine = Engine(model, max_batch_size=4, max_seq_len=128)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=20))
    for prompt, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(model, prompt, 20), f"prompt {prompt}"
        assert r.finish_reason == "length" and r.text is None
        assert r.metrics.target_forwards == 20 and r.metrics.mean_accepted_tokens == 1.0
    single = engine.generate([prompts[2]], SamplingParams(max_new_tokens=20))[0]
    assert single.token_ids == results[2].token_ids


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 12, 1.0), (1.3, 0, 0.8)])
def test_sampled_first_tokens_follow_the_model_distribution(temperature, top_k, top_p):
    model = tiny_llama(seed=2)
    prompt = random_prompts(1, lo=4, hi=6, seed=3)[0]
    # Thousands of rows: the PyTorch verification backend (token-identical to the Triton kernel,
    # see tests/kernels/test_verify.py) keeps this fast under the interpreter.
    engine = Engine(model, max_batch_size=3000, max_seq_len=32, verify_backend="torch")
    assert_samples_follow_target(engine, model, prompt, Autoregressive(), temperature, top_k, top_p, draws=6000)


def test_same_seed_same_tokens_whatever_shares_the_batch():
    engine = Engine(tiny_qwen2(seed=4), max_batch_size=4, max_seq_len=64)
    prompts = random_prompts(4, seed=5)
    mine = SamplingParams(temperature=1.0, seed=1234, max_new_tokens=12)
    alone = engine.generate([prompts[0]], mine)[0].token_ids
    others = [SamplingParams(temperature=0.9, seed=s, max_new_tokens=5 + s) for s in range(3)]
    together = engine.generate(prompts, [mine] + others)[0].token_ids
    assert alone == together
    different = engine.generate([prompts[0]], SamplingParams(temperature=1.0, seed=1235, max_new_tokens=12))
    assert different[0].token_ids != alone


def test_stop_tokens_and_limits():
    model = tiny_llama(seed=6)
    engine = Engine(model, max_batch_size=2, max_seq_len=40)
    prompt = random_prompts(1, seed=8)[0]
    free = engine.generate([prompt], SamplingParams(max_new_tokens=10))[0].token_ids
    stop = free[4]
    first_stop = free.index(stop)
    r = engine.generate([prompt, prompt], [SamplingParams(max_new_tokens=10, stop_token_ids=[stop]),
                                           SamplingParams(max_new_tokens=3)])
    assert r[0].token_ids == free[:first_stop + 1] and r[0].finish_reason == "stop"
    assert r[1].token_ids == free[:3] and r[1].finish_reason == "length"
    # max_seq_len bounds prompt + output.
    long = engine.generate([list(range(30))], SamplingParams(max_new_tokens=100))[0]
    assert len(long.token_ids) == 40 - 30 and long.finish_reason == "length"


def test_bad_input_names_the_problem_and_engine_stays_usable(tmp_path):
    model = tiny_llama(seed=9)
    engine = Engine(model, max_batch_size=2, max_seq_len=16)
    good = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))[0].token_ids
    bad = [
        (lambda: engine.generate([list(range(16))]), "max_seq_len"),
        (lambda: engine.generate([[]]), "empty"),
        (lambda: engine.generate([[1, VOCAB + 5]]), "token ids"),
        (lambda: engine.generate(["text"]), "tokenizer"),
        (lambda: engine.generate([[1]], strategy="fast"), "strategy"),
        (lambda: SamplingParams(temperature=-1), "temperature"),
        (lambda: SamplingParams(top_p=0), "top_p"),
        (lambda: SamplingParams(top_p=1.5), "top_p"),
        (lambda: SamplingParams(top_k=-2), "top_k"),
        (lambda: SamplingParams(top_k=2 ** 31), r"top_k must be in \[0, 2\*\*31 - 1\]"),  # int32 on the device
        (lambda: SamplingParams(seed=2 ** 63), r"seed must be an int in \[0, 2\*\*63 - 1\]"),  # int64
        (lambda: SamplingParams(temperature=1e-40), r"temperature must be 0 \(greedy\) or .* >= 1e-06"),  # overflow
        (lambda: SamplingParams(top_k=2.5), "SamplingParams.top_k must be an int, got float"),
        (lambda: SamplingParams(temperature="1"), "SamplingParams.temperature must be a number, got str"),
        (lambda: SamplingParams(max_new_tokens=0), "max_new_tokens"),
        (lambda: SamplingParams(stop_token_ids=[-1]), r"stop_token_ids must be a list of token ids \(ints >= 0\)"),
        (lambda: SamplingParams(stop_token_ids=[2.7]), "stop_token_ids"),  # not silently made 2
        (lambda: engine.generate([[1]], SamplingParams(stop_token_ids=[VOCAB])), rf"outside the vocabulary \[0, {VOCAB}\)"),
        (lambda: engine.generate([[1]], [SamplingParams()] * 2), "one per prompt"),
        (lambda: Engine(str(tmp_path)), "not a model folder"),
        (lambda: Engine(model, dtype="bf16"), r"dtype must be .* \(or its name: float32, bfloat16, float16\)"),
        (lambda: Engine(model, device="tpu"), r"device must be 'cpu', 'cuda' or 'cuda:N'"),
        (lambda: Engine(model, drafters=["magg"]), r"did you mean 'mag'\?"),  # at once, not after hub retries
        (lambda: Engine("qwen2.5-coder-1.5"), r"did you mean 'qwen2.5-coder-1.5b'\?"),
        (lambda: Engine(model, attention_backend="flash"), r"attention_backend must be one of \('sdpa', 'triton'\)"),
        (lambda: Engine(str(tmp_path / "missing-model")), "missing-model.: no such file or folder"),
        (lambda: SamplingParams(ignore_eos="no"), "ignore_eos must be True or False"),  # not taken as true
        (lambda: Engine(model, max_batch_size=2.5), "max_batch_size must be an int >= 1"),
        (lambda: Engine(model, max_seq_len=True), "max_seq_len must be an int >= 2"),
        (lambda: Engine(model, drafters=None), r"drafters must be a list .*\[\] for none"),
        (lambda: Engine(model, native="yes"), "native must be None"),
        (lambda: Engine(model, tokenizer="abc"), "tokenizer must be None"),
        (lambda: engine.generate([[1]], strategy=Autoregressive), r"e\.g\. Autoregressive\(\), got the class"),
        (lambda: csd_engine.Speculative(drafter="0"), r"Speculative\(drafter=\.\.\.\) must be an int >= 0"),
        (lambda: csd_engine.Speculative.auto(drafter=True), r"Speculative.auto\(drafter=\.\.\.\) must be"),
    ]
    for call, words in bad:
        with pytest.raises((ValueError, TypeError), match=words):
            call()
        assert engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))[0].token_ids == good
    assert engine.generate((1, 2, 3), SamplingParams(max_new_tokens=4))[0].token_ids == good  # a tuple: one prompt
    # the bounds themselves are served
    extreme = SamplingParams(temperature=1e-6, top_k=2 ** 31 - 1, seed=2 ** 63 - 1, max_new_tokens=4)
    assert engine.generate([[1, 2, 3]], extreme)[0].token_ids == good  # (1e-6: greedy but for exact ties)
    assert Engine(model, dtype="float32", max_batch_size=1, max_seq_len=16).dtype == torch.float32  # names work too


def test_a_cuda_device_is_fixed_to_an_index_that_exists(monkeypatch):
    """"cuda" becomes the current device's index when the engine is built (the threads that run
    it later have a current device of their own); an index past the devices is refused by name."""
    from csd_engine.engine import _checked_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert _checked_device("cuda") == torch.device("cuda:1")
    assert _checked_device(torch.device("cuda", 0)) == torch.device("cuda:0")
    with pytest.raises(ValueError, match=r"drafter_device='cuda:2', but torch sees 2 CUDA device\(s\): cuda:0 to cuda:1"):
        _checked_device("cuda:2", "drafter_device")


def test_a_drafter_runner_built_on_cuda_without_an_index_is_on_the_engines_device(monkeypatch):
    """A runner built on "cuda" (LlamaRunner(model, "cuda", ...), as tests/models/test_graphs.py's
    GPU test builds them) sits on the current device, which the engine's "cuda" resolves to:
    torch.device("cuda") != torch.device("cuda:0"), so a plain comparison refused it. Checked on
    the CPU with CUDA faked for the engine's drafter_device and the runner's cache kept on the CPU."""
    from csd_engine.models.llama import LlamaRunner
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    drafter = LlamaRunner(tiny_llama(seed=2), "cpu", torch.float32)

    def allocate_on_the_cpu(batch, capacity):
        drafter.device = torch.device("cpu")
        LlamaRunner.allocate(drafter, batch, capacity)
        drafter.device = torch.device("cuda")
    drafter.allocate = allocate_on_the_cpu
    drafter.device = torch.device("cuda")  # as LlamaRunner(model, "cuda", ...) records it
    engine = Engine(tiny_llama(seed=1), drafters=[drafter], device="cpu", drafter_device="cuda", max_batch_size=1,
                    max_seq_len=16)
    assert engine.drafter_device == torch.device("cuda:0") and engine.drafters == [drafter]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"drafter 0 is a runner on cuda, but the engine puts drafters on cuda:0"):
        Engine(tiny_llama(seed=1), drafters=[drafter], device="cpu", drafter_device="cuda:0", max_batch_size=1,
               max_seq_len=16)  # "cuda" is cuda:1 now: another device


def test_a_target_runner_on_another_device_is_refused_by_name(monkeypatch):
    """A target passed as a runner built on one device, to an engine on another, is refused with
    both devices named (it would fail later, inside a forward, with a device mismatch)."""
    from csd_engine.models.llama import LlamaRunner
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    target = LlamaRunner(tiny_llama(seed=1), "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"the target is a runner on cpu, but the engine runs on cuda:0 \(device\)"):
        Engine(target, device="cuda", max_batch_size=1, max_seq_len=16)
    monkeypatch.undo()  # the same runner on its own device decodes
    assert Engine(target, device="cpu", max_batch_size=1, max_seq_len=16).generate(
        [[1, 2]], SamplingParams(max_new_tokens=2))[0].token_ids


def test_caches_that_do_not_fit_are_refused_with_their_size(monkeypatch):
    """On the CPU, caches larger than the memory available are refused before allocating (zeroing
    them would get the process killed); the allocator's own error ("you tried to allocate N
    bytes") becomes the same kind of message. The engine's settings are named either way."""
    import csd_engine.engine
    from csd_engine.models.llama import LlamaRunner
    model = tiny_llama()
    # k and v, layers, rows, kv heads, slots, head dim, float32: the target's and the drafter's caches
    size = 2 * 2 * 64 * 2 * (1024 + 256) * 16 * 4
    words = (rf"the KV caches for max_batch_size=64 rows of 1280 slots \(max_seq_len 1024 \+ 256 for drafts\) take "
             rf"{2 * size / 2 ** 30:.1f} GiB \(the target {size / 2 ** 30:.1f}, drafter 1 {size / 2 ** 30:.1f}\), ")
    monkeypatch.setattr(csd_engine.engine, "_cpu_memory_available", lambda: size)
    with pytest.raises(MemoryError, match=words + r"more than the 0.0 GiB of memory available: lower max_batch_size"):
        Engine(model, drafters=["mag", tiny_llama(seed=1)], max_batch_size=64, max_seq_len=1024)

    real = LlamaRunner.allocate

    def allocate(self, batch, capacity):
        if batch * capacity > 10_000:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
        real(self, batch, capacity)
    monkeypatch.setattr(csd_engine.engine, "_cpu_memory_available", lambda: None)  # off Linux: no check before
    monkeypatch.setattr(LlamaRunner, "allocate", allocate)
    with pytest.raises(MemoryError, match=r"take 0.0 GiB \(the target 0.0\), too much for cpu: lower max_batch_size"):
        Engine(model, max_batch_size=64, max_seq_len=1024)
    assert Engine(model, max_batch_size=2, max_seq_len=64).generate([[1, 2]], SamplingParams(max_new_tokens=2))
    # a runner passed in again gives its old cache back as it takes the new one: counted as available
    monkeypatch.setattr(LlamaRunner, "allocate", real)
    runner = Engine(model, max_batch_size=4, max_seq_len=64).target
    monkeypatch.setattr(csd_engine.engine, "_cpu_memory_available", lambda: 0)
    assert Engine(runner, max_batch_size=4, max_seq_len=64).generate([[1, 2]], SamplingParams(max_new_tokens=2))
    with pytest.raises(MemoryError, match="more than the 0.0 GiB"):
        Engine(runner, max_batch_size=8, max_seq_len=64)


def test_settings_an_app_leaves_behind_get_clear_errors():
    """torch's default dtype set to float64 by the application, a GenerationConfig given as params,
    text without a tokenizer: each refused by name, the engine usable afterwards."""
    from transformers import GenerationConfig
    engine = Engine(tiny_llama(), max_batch_size=1, max_seq_len=32)
    good = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))[0].token_ids
    torch.set_default_dtype(torch.float64)
    try:
        with pytest.raises(RuntimeError, match="torch's default dtype is torch.float64 .* set it back to torch.float32"):
            engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))
    finally:
        torch.set_default_dtype(torch.float32)
    with pytest.raises(TypeError, match="got GenerationConfig .*SamplingParams\\(max_new_tokens"):
        engine.generate([[1, 2, 3]], GenerationConfig(max_new_tokens=3))
    with pytest.raises(ValueError, match=r"this engine has none .*Engine\(\.\.\., tokenizer=\.\.\.\)"):
        engine.generate(["hello"])
    for duplicate in (pickle.dumps, copy_module.deepcopy):  # handed to a process pool, say
        with pytest.raises(TypeError, match="an Engine holds loaded models .* build one in each process"):
            duplicate(engine)
    assert engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))[0].token_ids == good


def test_a_tokenizers_padded_output_runs_without_its_padding():
    """A BatchEncoding (input_ids with an attention_mask, padded on either side) runs as its
    unpadded rows; one row of it is one prompt (apply_chat_template's output)."""
    from transformers import BatchEncoding
    engine = Engine(tiny_llama(), max_batch_size=2, max_seq_len=32)
    params = SamplingParams(max_new_tokens=4)
    plain = [r.token_ids for r in engine.generate([[1, 2, 3], [4, 5, 6, 7, 8]], params)]
    left = BatchEncoding({"input_ids": torch.tensor([[0, 0, 1, 2, 3], [4, 5, 6, 7, 8]]),
                          "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])})
    right = BatchEncoding({"input_ids": [[1, 2, 3, 9, 9], [4, 5, 6, 7, 8]],
                           "attention_mask": [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]})
    assert [r.token_ids for r in engine.generate(left, params)] == plain
    assert [r.token_ids for r in engine.generate(right, params)] == plain
    assert engine.encode_prompt(BatchEncoding({"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1]})) == [1, 2, 3]
    with pytest.raises(ValueError, match="a tokenizer output of 2 rows; one prompt is one row"):
        engine.encode_prompt(left)
    with pytest.raises(ValueError, match="attention_mask does not have its input_ids' shape"):
        engine.generate(BatchEncoding({"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1]]}), params)


def test_every_bit_of_a_seed_counts():
    """Seeds that differ only above bit 31 draw different tokens (the random streams take 32-bit
    seeds: kernels.random.fold_seed), and a seed gives the same tokens every time."""
    from csd_engine.kernels.random import fold_seed
    assert [fold_seed(s) for s in (0, 7, 2 ** 32 - 1)] == [0, 7, 2 ** 32 - 1]  # the 32-bit seeds unchanged
    assert len({fold_seed(1 + (k << 32)) for k in range(1000)}) == 1000
    engine = Engine(tiny_llama(seed=2), max_batch_size=4, max_seq_len=32)
    seeds = [1, 2 ** 32 + 1, 2 ** 40 + 1, 2 ** 63 - 1]
    runs = engine.generate([[1, 2, 3]] * 4, [SamplingParams(temperature=1.5, seed=s, max_new_tokens=16) for s in seeds])
    assert len({tuple(r.token_ids) for r in runs}) == 4
    again = engine.generate([[1, 2, 3]], SamplingParams(temperature=1.5, seed=2 ** 40 + 1, max_new_tokens=16))
    assert again[0].token_ids == runs[2].token_ids


def test_a_runner_called_outside_generate_flags_nothing():
    """The non-finite flags belong to a generate call: afterwards the runner holds none, so it can
    be called at another batch size (a benchmark wrapping it in a CUDA graph of 8 rows did)."""
    from csd_engine.models.runner import ForwardBatch
    engine = Engine(tiny_llama(seed=3), max_batch_size=1, max_seq_len=32)
    first = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))[0].token_ids
    runner = engine.target
    assert runner.nonfinite_rows is None
    runner.allocate(4, engine.capacity)
    ids = torch.tensor([[5], [6], [7], [8]])
    assert runner(ForwardBatch.chain(ids, runner.cache.lengths, 1)).shape[:2] == (4, 1)
    assert engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))[0].token_ids == first


def test_public_api_exports():
    assert {"Engine", "SamplingParams", "Autoregressive", "Speculative"} <= set(csd_engine.__all__)
    assert isinstance(Autoregressive(), Autoregressive)


@pytest.mark.parametrize("strategy", ["autoregressive", "speculative", "cascade"])
def test_nan_logits_are_a_clear_error_and_the_engine_stays_usable(strategy):
    """A model whose embedding of token 5 is NaN poisons every row that contains it: generate
    raises naming the model and the prompt (never tokens from NaN), and the other prompts still
    generate afterwards, through a target or a drafter alike."""
    from tests.tiny_models import perturbed
    healthy = tiny_llama(seed=7)
    broken = tiny_llama(seed=7)
    with torch.no_grad():
        broken.model.embed_tokens.weight[5] = float("nan")
    target, drafters, name = (broken, [], "the target") if strategy == "autoregressive" else \
        (healthy, [broken], "drafter 0")
    if strategy == "cascade":
        drafters = [broken, perturbed(healthy, noise=0.1, seed=8), "mag"]
    engine = Engine(target, drafters=drafters, max_batch_size=2, max_seq_len=32, verify_backend="torch")
    chosen = {"autoregressive": Autoregressive(), "speculative": csd_engine.Speculative(k=3),
              "cascade": csd_engine.Cascade(k_matrix=[[2, 1, 0], [0, 2, 1], [0, 0, 2]])}[strategy]
    params = SamplingParams(max_new_tokens=6)
    with pytest.raises(ValueError, match=rf"non-finite logits \(NaN or inf\) from {name} for prompt\(s\) \[1\]"):
        engine.generate([[1, 2, 3], [4, 5, 6]], params, strategy=chosen)
    clean = engine.generate([[1, 2, 3]], params, strategy=chosen)[0].token_ids
    assert clean == Engine(healthy, max_batch_size=1, max_seq_len=32).generate([[1, 2, 3]], params)[0].token_ids


def test_seed_none_is_fresh_per_request_and_stops_add_to_eos():
    """One params object with seed=None serves many requests: each draws its own seed (rows of
    one call and repeated calls differ). stop_token_ids end a request in addition to EOS."""
    model = tiny_llama(seed=12)
    engine = Engine(model, max_batch_size=4, max_seq_len=48, verify_backend="torch")
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    rows = [r.token_ids for r in engine.generate([[1, 2, 3]] * 4, params)]
    again = engine.generate([[1, 2, 3]], params)[0].token_ids
    assert len({tuple(r) for r in rows + [again]}) > 1, "seed=None gave the same tokens to every request"
    free = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=16))[0].token_ids
    model.config.eos_token_id = None
    engine.target.eos_token_ids = (free[6],)  # as the loader sets it from the generation config
    stop = next(t for t in free[2:] if t != free[6] and free.index(t) < free.index(free[6]))
    first = min(free.index(stop), free.index(free[6]))
    both = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=16, stop_token_ids=[stop]))[0]
    assert both.token_ids == free[:first + 1] and both.finish_reason == "stop"
    eos_only = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=16))[0]
    assert eos_only.token_ids == free[:free.index(free[6]) + 1]
    ignored = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
    assert ignored.token_ids == free
    assert SamplingParams(max_tokens=5).max_new_tokens == 5 and SamplingParams().max_new_tokens == 64
    for max_new_tokens in (6, 64):  # 64 given is not "not given"
        with pytest.raises(ValueError, match="disagree"):
            SamplingParams(max_tokens=5, max_new_tokens=max_new_tokens)
    # dataclasses.replace passes every field again: the alias must not pin the old value
    assert [replace(SamplingParams(max_new_tokens=10), max_new_tokens=n).max_new_tokens for n in (64, 20)] == [64, 20]
    assert replace(SamplingParams(max_tokens=10), max_new_tokens=20).max_new_tokens == 20
    # frozen: a field set afterwards would skip the checks and normalization (a stop string as its characters)
    params = SamplingParams(stop="answer")
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.stop = "answer"
    with pytest.raises(ValueError, match="temperature must be"):
        replace(params, temperature=-1)


def test_token_id_prompts_may_be_numpy_or_torch():
    """Token ids as NumPy ints, a 1-D array or tensor per prompt, or a 2-D one for a batch: the
    same tokens as lists; float or bool ids are refused."""
    engine = Engine(tiny_llama(seed=13), max_batch_size=2, max_seq_len=64, verify_backend="torch")
    params = SamplingParams(max_new_tokens=4)
    expected = [r.token_ids for r in engine.generate([[1, 2, 3], [4, 5, 6]], params)]
    for prompts in ([np.array([1, 2, 3]), torch.tensor([4, 5, 6])], [[np.int64(1), 2, 3], (4, 5, 6)],
                    np.array([[1, 2, 3], [4, 5, 6]]), torch.tensor([[1, 2, 3], [4, 5, 6]])):
        assert [r.token_ids for r in engine.generate(prompts, params)] == expected
    assert engine.generate(torch.tensor([1, 2, 3]), params)[0].token_ids == expected[0]
    for bad in ([torch.tensor([1.0, 2.0])], [[True, 2]], [np.array([[1, 2]])]):
        with pytest.raises(ValueError, match="prompt 0 must be a string or a list of token ids"):
            engine.generate(bad, params)


def test_each_request_has_its_own_wall_time_and_time_to_first_token():
    engine = Engine(tiny_llama(seed=13), max_batch_size=2, max_seq_len=64, verify_backend="torch")
    short, long = engine.generate([[1, 2, 3], [4, 5]], [SamplingParams(max_new_tokens=2),
                                                        SamplingParams(max_new_tokens=40)])
    for r in (short, long):
        assert 0 < r.metrics.time_to_first_token_s <= r.metrics.wall_time_s
    assert short.metrics.wall_time_s < long.metrics.wall_time_s
    assert long.metrics.time_to_first_token_s < short.metrics.wall_time_s  # both first tokens came in step 1


def test_a_numpy_integer_seed_is_the_int_it_holds():
    assert SamplingParams(temperature=1.0, seed=np.int64(5)) == SamplingParams(temperature=1.0, seed=5)
    with pytest.raises(ValueError, match="seed must be an int"):
        SamplingParams(temperature=1.0, seed=np.float64(5))


@pytest.mark.parametrize("strategy", [Autoregressive(), Speculative(k=3)], ids=["autoregressive", "speculative-mag"])
def test_a_tie_at_a_tiny_temperature_is_a_fair_coin(strategy):
    """Two top tokens with bit-identical logits, temperature 1e-6: each is drawn half the time
    and its log-probability is log(1/2). Dividing the raw logits by T in float32 spaces them 0.5
    apart near 7e6, which drew 0.55 / 0.45 (0.60 with drafts) and read -0.5."""
    from tests.stats import assert_distribution
    model = tiny_llama(seed=31, scale=2.5)
    prompt = [88, 14, 80, 74, 68, 30, 88]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
        top = int(logits.argmax())
        model.lm_head.weight[top - 1 if top else 1] = model.lm_head.weight[top]
        twin = top - 1 if top else 1
    n = 4000
    engine = Engine(model, drafters=[] if isinstance(strategy, Autoregressive) else ["mag"], max_batch_size=n,
                    max_seq_len=16, verify_backend="torch")  # the shift is the verifier's, before either backend
    results = engine.generate([prompt] * n, [SamplingParams(temperature=1e-6, max_new_tokens=1, seed=s, logprobs=True)
                                             for s in range(n)], strategy=strategy)
    first = torch.tensor([r.token_ids[0] for r in results])
    assert set(first.tolist()) <= {top, twin}
    assert_distribution((first == top).long(), torch.tensor([0.5, 0.5]))
    assert results[0].logprobs[0] == pytest.approx(math.log(0.5), abs=1e-5)


def test_prompts_go_only_into_the_models_a_strategy_runs():
    """Autoregressive on an engine with drafters prefills the target alone (a long prompt's
    drafter prefill costs seconds on a CPU), Speculative its own drafter; each still equals plain
    decoding, also when a drafting strategy follows on the same rows, and chunked prefills too."""
    target, drafter = tiny_llama(seed=3), tiny_llama(seed=4, layers=1)
    prompts = random_prompts(3, lo=2, hi=20, seed=5)
    engine = Engine(target, drafters=[drafter, "mag"], max_batch_size=3, max_seq_len=96)
    calls = []
    for i, runner in enumerate(engine.models()):
        prefill = runner.prefill
        runner.prefill = lambda rows, ids, start=0, i=i, prefill=prefill: calls.append(i) or prefill(rows, ids, start)
    params = SamplingParams(max_new_tokens=12)
    plain = [r.token_ids for r in engine.generate(prompts, params, strategy=Autoregressive())]
    assert calls and set(calls) == {0}, "the drafters were prefilled for Autoregressive"
    assert int(engine.drafters[0].cache.lengths.abs().sum()) == 0, "an idle drafter holds nothing"
    calls.clear()
    assert [r.token_ids for r in engine.generate(prompts, params, strategy=Speculative(k=3, drafter=0))] == plain
    assert set(calls) == {0, 1}  # MaG's prefill is not Speculative's to call either
    calls.clear()
    with engine.scheduler(Autoregressive(), prefill_chunk=4) as scheduler:
        ids = [scheduler.add(prompt, params) for prompt in prompts]
        done = {}
        while len(done) < len(ids):
            done.update({o.request_id: o.result.token_ids for o in scheduler.step() if o.finished})
    assert [done[i] for i in ids] == plain and set(calls) == {0}


@pytest.mark.parametrize("strategy", [
    Speculative(k=3, drafter=1),
    Pearl(gamma=2, drafter=1, overlap=True),  # its own decoder (on one device it runs the chain)
    Staged(branching=(2, 2), drafter=1, mag_tokens=2),
    Cascade(k_matrix=[[0, 2, 2], [0, 0, 0], [0, 0, 3]], lenience=2),  # K gives drafter 0 nothing
], ids=["speculative", "pearl", "staged", "cascade"])
def test_a_drafter_the_strategy_never_runs_is_not_prefilled(strategy):
    """With two neural drafters, a strategy that runs only the second prefills the target and
    that one; its tokens still equal plain decoding."""
    target, idle, drafter = tiny_llama(seed=3), tiny_llama(seed=4, layers=1), tiny_llama(seed=6, layers=1)
    prompts = random_prompts(3, lo=2, hi=20, seed=7)
    engine = Engine(target, drafters=[idle, drafter, "mag"], max_batch_size=3, max_seq_len=96)
    params = SamplingParams(max_new_tokens=12)
    plain = [r.token_ids for r in engine.generate(prompts, params, strategy=Autoregressive())]
    calls = []
    for i, runner in enumerate(engine.models()):
        prefill = runner.prefill
        runner.prefill = lambda rows, ids, start=0, i=i, prefill=prefill: calls.append(i) or prefill(rows, ids, start)
    assert [r.token_ids for r in engine.generate(prompts, params, strategy=strategy)] == plain
    assert set(calls) == {0, 2}, f"prefilled models {sorted(set(calls))} (0: target, 1: the idle drafter)"
    assert int(engine.drafters[0].cache.lengths.abs().sum()) == 0, "the idle drafter holds nothing"
