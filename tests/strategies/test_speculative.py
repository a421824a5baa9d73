"""Chain speculative decoding is lossless: greedy equals plain greedy decoding, sampling
follows the target, with a neural drafter and with MaG, batched with ragged acceptance."""
import pytest
import torch

from csd_engine import Autoregressive, Engine, SamplingParams, Speculative
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


@pytest.mark.parametrize("model_cost,min_confidence", [(0.0, 0.6), (0.3, 0.0), (0.3, 0.3)])
def test_auto_greedy_equals_autoregressive_with_rows_that_sit_out(model_cost, min_confidence, monkeypatch):
    """Speculative.auto() with a drafter that is rarely right: rows stop drafting once their
    counted rate falls below what a draft costs, and sit out with the drafter's cache trailing;
    rows admitted later start at the prior rate and draft, and the drafter catches the
    sitting-out rows up in the same forward. Greedy output equals plain decoding throughout."""
    import csd_engine.strategies.speculative_auto as auto
    target = tiny_llama(seed=21)
    engine = Engine(target, drafters=[perturbed(target, noise=1.5, seed=23)], max_batch_size=2, max_seq_len=96,
                    verify_backend="torch")
    behind, chain = [], auto.draft_chain
    monkeypatch.setattr(auto, "draft_chain", lambda *a, **kw: behind.append(kw["max_behind"]) or chain(*a, **kw))
    prompts = random_prompts(6, lo=2, hi=10, seed=5)
    params = [SamplingParams(max_new_tokens=n) for n in (30, 8, 12, 20, 6, 10)]  # rows freed and refilled
    strategy = Speculative.auto(max_tokens=4, model_cost=model_cost, min_confidence=min_confidence)
    with engine.scheduler(strategy) as scheduler:
        ids = [scheduler.add(p, sp) for p, sp in zip(prompts, params)]
        done = {}
        while scheduler.has_unfinished():
            done.update({o.request_id: o.result for o in scheduler.step() if o.finished})
    out = [done[i] for i in ids]
    plain = [engine.generate([p], sp, strategy=Autoregressive())[0] for p, sp in zip(prompts, params)]
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    drafted, forwards = sum(r.metrics.drafted for r in out), sum(r.metrics.drafter_forwards[0] for r in out)
    if model_cost:
        first = out[0].metrics  # steps in which the row offered a draft, against all its steps
        assert first.drafted_per_position[0] < first.target_forwards, "the row never stopped drafting"
        assert max(behind) > 2, "no row sat out and was caught up"
    if min_confidence:
        assert drafted < forwards, "no draft stopped below the confidence threshold"


def test_auto_draft_length_follows_counted_acceptance_and_costs(pair):
    """Each row's length maximises (1 + a + ... + a^k) / (1 + (width + model cost) k) at its own
    counted rate a: the longest draft where every token is accepted, none where none is, and
    shorter drafts as a draft token costs more; a row with no counts yet starts optimistic."""
    target, draft_model = pair
    engine = Engine(target, drafters=[draft_model], max_batch_size=3, max_seq_len=32)
    models = engine._decoder_models()
    from csd_engine.strategies.base import DecodeState, StepMetrics
    z = torch.zeros(3, dtype=torch.int64)
    state = DecodeState(torch.zeros(3, 32, dtype=torch.int64), z.clone(), z.clone(), torch.ones(3, dtype=torch.bool),
                        torch.zeros(3), z.int(), torch.ones(3), z.clone(), z.clone(), 0, True,
                        metrics=StepMetrics.zeros(3, "cpu", levels=2, positions=8, sources=1))
    state.metrics.source_accepted[0] = torch.tensor([1000, 0, 700])
    state.metrics.source_checked[0] = torch.tensor([1000, 1000, 1000])
    lengths = {c: Speculative.auto(max_tokens=6, model_cost=c, width_cost=0.02).decoder(models).budget(state).tolist()
               for c in (0.05, 0.3, 0.6)}
    assert lengths[0.05][:2] == [6, 0] and lengths[0.3][:2] == [6, 0]
    assert lengths[0.05][2] > lengths[0.3][2] > lengths[0.6][2] >= 0, lengths
    state.active[0] = False
    assert Speculative.auto(model_cost=0.05).decoder(models).budget(state)[0] == 0  # a free row drafts nothing
    # a fresh row drafts at the optimistic prior rate 0.8 where a draft token costs half a target forward
    # (the 0.5B on the AVX2 CPU: 0.35 + 0.15); at 0.5 it would never try and never learn its rate
    state.metrics.source_accepted.zero_(), state.metrics.source_checked.zero_()
    fresh = {r: Speculative.auto(model_cost=0.35, width_cost=0.15, prior_rate=r).decoder(models).budget(state)[1]
             for r in (0.8, 0.5)}
    assert fresh[0.8] > 0 and fresh[0.5] == 0, fresh


def test_confidence_stop_is_refused_where_it_cannot_apply():
    engine = Engine(tiny_llama(seed=1), drafters=["mag"], max_batch_size=1, max_seq_len=32)
    for bad in (-0.1, 1.0, True, "0.5"):
        with pytest.raises(ValueError, match=r"min_confidence=\.\.\.\) must be a number in \[0, 1\)"):
            Speculative(min_confidence=bad)
        with pytest.raises(ValueError, match=r"min_confidence=\.\.\.\) must be a number in \[0, 1\)"):
            Speculative.auto(min_confidence=bad)
    for name, bad in (("max_tokens", 0), ("prior", 0), ("prior_rate", 1.0), ("model_cost", -1), ("width_cost", -0.5)):
        with pytest.raises(ValueError, match=rf"Speculative.auto\({name}=\.\.\.\) must be"):
            Speculative.auto(**{name: bad})
    with pytest.raises(ValueError, match="MaG's drafts are already only what it matched"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2), strategy=Speculative(min_confidence=0.5))
    with pytest.raises(ValueError, match="tunes a neural drafter"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2), strategy=Speculative.auto())
    assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=2), strategy=Speculative(k=2))[0].token_ids


def test_auto_rows_that_sit_out_are_caught_up_exactly(monkeypatch):
    """With a drafter identical to the target, every draft is accepted iff the drafter's cache
    is exactly the committed prefix when it drafts. A schedule forced on the decoder: every
    fourth step the rows of one parity of committed length (alternating) draft 3 tokens, every other step all sit
    out, so the drafter trails by several tokens and catches rows up inside batched forwards."""
    import csd_engine.strategies.speculative_auto as auto
    target = tiny_llama(seed=21)
    engine = Engine(target, drafters=[target], max_batch_size=4, max_seq_len=96, verify_backend="torch")
    monkeypatch.setattr(auto.AutoSpeculativeDecoder, "budget",
                        lambda self, state: 3 * (state.metrics.target_forwards % 4 == 0) *
                        ((state.committed + state.metrics.target_forwards // 4) % 2 == 0) * state.active)
    behind, chain = [], auto.draft_chain
    monkeypatch.setattr(auto, "draft_chain", lambda *a, **kw: behind.append(kw["max_behind"]) or chain(*a, **kw))
    prompts = random_prompts(4, lo=2, hi=12, seed=8)
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, seed=i, max_new_tokens=30) for i in range(4)]
        for r in engine.generate(prompts, params, strategy=Speculative.auto(max_tokens=3)):
            assert 0 < r.metrics.drafted == r.metrics.accepted, (temperature, r.metrics.drafted, r.metrics.accepted)
    assert max(behind) > 2, "no row trailed the committed prefix by more than a step"
