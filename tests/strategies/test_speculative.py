"""Chain speculative decoding is lossless: greedy equals plain greedy decoding, sampling
follows the target, with a neural drafter and with MaG, batched with ragged acceptance."""
import pytest
import torch

from csd_engine import Engine, SamplingParams, Speculative
from csd_engine.drafters.mag import MaG
from tests.strategies.common import assert_greedy_equals_autoregressive, assert_samples_follow_target
from tests.tiny_models import VOCAB, perturbed, random_prompts, tiny_gpt2, tiny_llama, tiny_qwen2


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(seed=21)
    return target, perturbed(target, noise=0.1, seed=22)  # agrees with the target most of the time


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("drafter", ["model", "mag"])
def test_greedy_equals_autoregressive(pair, k, drafter):
    target, draft_model = pair
    # the Triton verification kernel (interpreted here: seconds per call) for one k, the PyTorch reference for the others
    engine = Engine(target, drafters=[draft_model if drafter == "model" else "mag"], max_batch_size=4,
                    max_seq_len=96, verify_backend="triton" if k == 3 else "torch")
    prompts = random_prompts(4, lo=1, hi=14, seed=int(torch.randint(0, 10**6, (1,))))
    prompts[0] = prompts[0][:3] * 4  # repetitive: MaG finds matches, acceptance gets ragged
    out = assert_greedy_equals_autoregressive(engine, prompts, Speculative(k=k))
    m = out[0].metrics
    assert m.drafted > 0 and 0 <= m.accepted <= m.drafted
    assert m.mean_accepted_tokens == pytest.approx(m.new_tokens / m.target_forwards)
    assert len(m.acceptance_by_position) <= k and all(0 <= a <= 1 for a in m.acceptance_by_position)
    if drafter == "model":
        assert sum(r.metrics.accepted for r in out) > 0  # the perturbed drafter agrees with its target often
        assert m.drafter_forwards[0] == m.target_forwards * k


def test_greedy_generic_runner_target_and_drafter():
    target = tiny_gpt2(seed=3)
    engine = Engine(target, drafters=[perturbed(target, 0.2)], max_batch_size=2, max_seq_len=64)
    assert_greedy_equals_autoregressive(engine, random_prompts(2, seed=4), Speculative(k=3), max_new_tokens=12)


@pytest.mark.parametrize("drafter,temperature,top_k,top_p", [("model", 1.0, 0, 1.0), ("model", 0.7, 20, 0.9),
                                                              ("mag", 1.0, 0, 1.0)])
def test_sampling_follows_the_target(pair, drafter, temperature, top_k, top_p):
    target, draft_model = pair
    engine = Engine(target, drafters=[draft_model if drafter == "model" else "mag"], max_batch_size=2000,
                    max_seq_len=32, verify_backend="torch")
    prompt = [5, 17, 5, 17, 5]  # MaG proposes 17 after 5: its drafts are accepted and rejected
    results = assert_samples_follow_target(engine, target, prompt, Speculative(k=3), temperature, top_k, top_p)
    assert sum(r.metrics.accepted for r in results) > 0


def test_vocabulary_mismatch_is_refused_at_construction():
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(tiny_llama(seed=1), drafters=[tiny_qwen2(seed=1, vocab=VOCAB + 8)])


def test_strategy_validation():
    engine = Engine(tiny_llama(seed=1), max_batch_size=1, max_seq_len=32)
    with pytest.raises(ValueError, match="drafter"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2), strategy=Speculative(k=2))
    for bad in (0, -1, 65, 2.5, True):
        with pytest.raises(ValueError, match="k must be"):
            Speculative(k=bad)
    assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].token_ids


def test_drafter_given_as_loaded_mag_instance_and_string():
    target = tiny_llama(seed=2)
    engine = Engine(target, drafters=[MaG(), "mag"], max_batch_size=1, max_seq_len=32)
    assert all(isinstance(d, MaG) for d in engine.drafters)
