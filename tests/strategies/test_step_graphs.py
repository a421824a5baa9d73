"""One graph per step (csd_engine.step_graphs), checked on the CPU with tests/graph_emulator.py:
every strategy that may be captured gives, with its steps replayed from recorded graphs, the
same tokens and the same counters as eager steps (greedy and seeded top-k / top-p sampling,
ragged prompts, requests joining rows that others left). A step that kept state in Python,
rebound a tensor or baked a host value into its work would replay wrongly. On a GPU the same
engine runs with real CUDA graphs (tests/models/test_graphs.py's CUDA tests)."""
import dataclasses
import pytest
import torch

import csd_engine.scheduler
from csd_engine import Autoregressive, Cascade, Engine, Pearl, SamplingParams, Speculative, Staged
from csd_engine.step_graphs import COMMITTED_BUCKET, StepGraphs
from tests.graph_emulator import EmulatedCapture
from tests.tiny_models import perturbed, random_prompts, tiny_llama

STRATEGIES = {
    "autoregressive": ((), Autoregressive()),
    "speculative-model": (("d1",), Speculative(k=3)),
    "speculative-mag": (("mag",), Speculative(k=4)),
    "cascade3": (("d1", "d2", "mag"), Cascade(k_matrix=[[2, 1, 1], [0, 2, 1], [0, 0, 2]], lenience=2, mag_tokens=2)),
    "cascade-tree": (("d1", "mag"), Cascade(k_matrix=[[2, 1], [0, 2]], lenience=2, mag_tokens=2, tree=(3, 2))),
    "cascade-direct": (("d1", "mag"), Cascade(k_matrix=[[2, 3], [0, 2]], lenience=2, mag_tokens=1, direct_match=3,
                                              direct_tokens=6)),
    "cascade-auto": (("d1", "mag"), Cascade.auto()),
    "cascade-auto-tree": (("d1", "mag"), Cascade.auto(tree=(3, 2))),
    "staged": (("d1", "mag"), Staged(branching=(2, 2, 1), mag_tokens=2)),
}
SETTINGS = {"greedy": dict(), "top-k-top-p": dict(temperature=0.9, top_k=8, top_p=0.9, seed=5)}
CASES = [(name, "greedy") for name in STRATEGIES] + [
    (name, "top-k-top-p") for name in ("speculative-model", "cascade3", "cascade-tree", "cascade-auto", "staged")]


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(seed=71)
    return {"target": target, "d1": perturbed(target, noise=0.2, seed=72), "d2": perturbed(target, noise=0.5, seed=73)}


def device_path(monkeypatch) -> None:
    """Engines decode on the device path: no CPU-only trim of the target's width (Engine.trim_drafts)."""
    models = Engine._decoder_models
    monkeypatch.setattr(Engine, "_decoder_models", lambda self: dataclasses.replace(models(self), trim_drafts=False))


def emulated(monkeypatch, captures: list, capture_type=EmulatedCapture) -> None:
    """Schedulers replay their steps from emulated graphs (as cuda_graphs='step' on a GPU), which
    replay fixed shapes: the device path."""
    device_path(monkeypatch)

    def step_graphs(scheduler):
        capture = capture_type()
        captures.append(capture)
        limit = scheduler.engine.max_seq_len + scheduler.decoder.max_tokens_per_forward
        return StepGraphs(scheduler.decoder, len(scheduler.engine.drafters), limit, capture)
    monkeypatch.setattr(csd_engine.scheduler.Scheduler, "_step_graphs", step_graphs)


def run(engine, strategy, prompts, params, rows):
    """Every prompt through a scheduler of `rows` rows (more prompts than rows: rows are reused)."""
    done = {}
    with engine.scheduler(strategy, rows=rows) as scheduler:
        ids = [scheduler.add(p, params) for p in prompts]
        while scheduler.has_unfinished():
            done.update((o.request_id, o.result) for o in scheduler.step() if o.finished)
    return [done[i] for i in ids]


@pytest.mark.parametrize("name,setting", CASES)
def test_replayed_steps_equal_eager_steps(models, name, setting, monkeypatch):
    drafters, strategy = STRATEGIES[name]
    engine = Engine(models["target"], drafters=[models[d] if d != "mag" else "mag" for d in drafters],
                    max_batch_size=2, max_seq_len=64, verify_backend="torch")
    prompts = random_prompts(3, lo=2, hi=12, seed=81)
    prompts[0] = (prompts[0][:3] * 5)[:12]  # MaG matches
    # Cascade.auto's budgets move with its counts: its keys repeat only in longer runs
    params = SamplingParams(**SETTINGS[setting], max_new_tokens=40 if name == "cascade-auto" else 14)
    # eager on the device path too: Cascade.auto() counts the empty MaG slots an untrimmed forward
    # pays for, so its drafts follow the path
    device_path(monkeypatch)
    eager = run(engine, strategy, prompts, params, rows=2)
    captures = []
    emulated(monkeypatch, captures)
    graphed = run(engine, strategy, prompts, params, rows=2)
    assert captures[0].replays >= 3, f"{captures[0].captures} captures, only {captures[0].replays} replays"
    for i, (a, b) in enumerate(zip(eager, graphed)):
        assert b.token_ids == a.token_ids, f"{name} request {i}"
        for field in ("target_forwards", "drafter_forwards", "accepted", "drafted", "acceptance_by_level"):
            assert getattr(b.metrics, field) == getattr(a.metrics, field), (name, i, field)


def test_the_emulator_catches_a_step_that_keeps_state_in_python(models, monkeypatch):
    """The check has teeth: a step that rebinds a tensor each step replays stale work."""
    class Rebinding(Autoregressive):
        def decoder(self, m):
            decoder = super().decoder(m)
            step = decoder.step

            def rebinding_step(state, plan=None):
                state.offset = state.offset + 0  # a new tensor: a graph keeps reading the old one
                return step(state, plan)
            decoder.step = rebinding_step
            return decoder

    engine = Engine(models["target"], max_batch_size=2, max_seq_len=64, verify_backend="torch")
    prompts = random_prompts(2, lo=4, hi=8, seed=82)
    params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=12)
    eager = run(engine, Rebinding(), prompts, params, rows=2)
    emulated(monkeypatch, [])
    graphed = run(engine, Rebinding(), prompts, params, rows=2)
    assert [r.token_ids for r in graphed] != [r.token_ids for r in eager]


def test_a_later_scheduler_replays_the_kept_graphs_and_any_other_drops_them(models, monkeypatch):
    """The engine keeps the last scheduler's step graphs: the next generate with the same strategy
    and rows replays them (no warm-up for a shape it has seen) and gives the eager tokens, with
    other seeds too (what the decoder derives per request reaches the kept graphs); a scheduler
    of another strategy or row count drops them and captures its own."""
    drafters, strategy = STRATEGIES["cascade3"]
    engine = Engine(models["target"], drafters=[models[d] if d != "mag" else "mag" for d in drafters],
                    max_batch_size=2, max_seq_len=64, verify_backend="torch")
    prompts = random_prompts(3, lo=2, hi=12, seed=83)
    params = SamplingParams(temperature=0.9, top_k=8, seed=5, max_new_tokens=14)
    reseeded = dataclasses.replace(params, seed=6)
    eager = [r.token_ids for r in run(engine, strategy, prompts, params, rows=2)]
    eager_reseeded = [r.token_ids for r in run(engine, strategy, prompts, reseeded, rows=2)]
    assert eager_reseeded != eager
    captures = []
    emulated(monkeypatch, captures)
    assert [r.token_ids for r in run(engine, strategy, prompts, params, rows=2)] == eager
    warm_ups, replays = captures[0].warm_ups, captures[0].replays
    assert [r.token_ids for r in run(engine, strategy, prompts, reseeded, rows=2)] == eager_reseeded
    assert len(captures) == 1 and captures[0].warm_ups == warm_ups and captures[0].replays > replays + 10
    run(engine, strategy, prompts[:1], params, rows=1)
    run(engine, Autoregressive(), prompts[:1], params, rows=2)
    assert [r.token_ids for r in run(engine, strategy, prompts, params, rows=2)] == eager
    assert len(captures) == 4


def test_nonfinite_logits_in_a_kept_graphs_replay_end_the_request():
    """The runners' non-finite flags are the tensors the kept graphs write: a request whose
    logits go NaN in a replayed step of a later generate ends with a clear error."""
    broken = tiny_llama(seed=7)
    with torch.no_grad():
        broken.model.embed_tokens.weight[5] = float("nan")
    engine = Engine(broken, max_batch_size=1, max_seq_len=32, verify_backend="torch")
    captures = []
    with pytest.MonkeyPatch.context() as patch:
        emulated(patch, captures)
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=6))
        with pytest.raises(ValueError, match=r"non-finite logits \(NaN or inf\) from the target"):
            engine.generate([[4, 5, 6]], SamplingParams(max_new_tokens=6))
    assert len(captures) == 1 and captures[0].replays > 0


class FailingCapture(EmulatedCapture):
    def capture(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_step_whose_capture_fails_runs_eagerly_with_a_warning(models, monkeypatch, caplog):
    drafters, strategy = STRATEGIES["cascade-tree"]
    engine = Engine(models["target"], drafters=[models[d] if d != "mag" else "mag" for d in drafters],
                    max_batch_size=2, max_seq_len=64, verify_backend="torch")
    prompts = random_prompts(3, lo=2, hi=12, seed=84)
    params = SamplingParams(max_new_tokens=14)
    eager = run(engine, strategy, prompts, params, rows=2)
    emulated(monkeypatch, [], FailingCapture)
    with caplog.at_level("WARNING", logger="csd_engine"):
        graphed = run(engine, strategy, prompts, params, rows=2)
    assert "capturing a step of CascadeDecoder failed (RuntimeError: operation not permitted" in caplog.text
    for a, b in zip(eager, graphed):
        assert b.token_ids == a.token_ids
        assert (b.metrics.target_forwards, b.metrics.drafter_forwards) == (a.metrics.target_forwards,
                                                                          a.metrics.drafter_forwards)


def test_keys_round_max_committed_up_within_the_caches(models):
    engine = Engine(models["target"], max_batch_size=1, max_seq_len=1000, verify_backend="torch")
    with engine.scheduler(Autoregressive(), rows=1) as scheduler:
        graphs = StepGraphs(scheduler.decoder, 0, 1001, EmulatedCapture())
        state = scheduler.state
        for committed, bound in ((0, COMMITTED_BUCKET), (5, COMMITTED_BUCKET), (COMMITTED_BUCKET + 1, 2 * COMMITTED_BUCKET),
                                 (990, 1001)):
            state.max_committed = committed
            assert graphs.key(state, None)[1] == bound


def test_pearl_refuses_step_graphs_with_a_clear_error(models, monkeypatch):
    """Pearl's drafter runs in a thread of its own: on a GPU its step cannot be one graph."""
    engine = Engine(models["target"], drafters=[models["d1"]], max_batch_size=1, max_seq_len=32,
                    verify_backend="torch", cuda_graphs="step")
    with engine.scheduler(Pearl(gamma=2, overlap=True)) as scheduler:
        assert scheduler.step_graphs is None  # on the CPU steps run eagerly
        monkeypatch.setattr(engine, "device", torch.device("cuda"))  # the check runs before any CUDA work
        with pytest.raises(ValueError, match="cuda_graphs='step' cannot capture PearlDecoder"):
            scheduler._step_graphs()


@pytest.mark.gpu
@pytest.mark.parametrize("name,setting", [("autoregressive", "greedy"), ("speculative-model", "greedy"),
                                          ("cascade3", "greedy"), ("cascade-tree", "top-k-top-p"),
                                          ("cascade-auto", "greedy"), ("speculative-mag", "top-k-top-p")])
def test_real_cuda_graphs_equal_eager_steps(models, name, setting, caplog):
    """cuda_graphs='step' on a GPU: real captures and replays give the eager steps' tokens and
    counters, and every capture succeeds (a failed one would run its steps eagerly, same tokens)."""
    drafters, strategy = STRATEGIES[name]
    results = []
    caplog.set_level("WARNING", logger="csd_engine")
    for graphs in (False, "step"):
        engine = Engine(models["target"], drafters=[models[d] if d != "mag" else "mag" for d in drafters],
                        device="cuda", max_batch_size=2, max_seq_len=64, attention_backend="triton",
                        cuda_graphs=graphs)
        prompts = random_prompts(3, lo=2, hi=12, seed=81)
        prompts[0] = (prompts[0][:3] * 5)[:12]
        with engine.scheduler(strategy, rows=2) as scheduler:
            assert (scheduler.step_graphs is not None) == bool(graphs)
        results.append(run(engine, strategy, prompts, SamplingParams(**SETTINGS[setting], max_new_tokens=14), rows=2))
    for i, (a, b) in enumerate(zip(*results)):
        assert b.token_ids == a.token_ids, f"{name} request {i}"
        assert (b.metrics.target_forwards, b.metrics.drafter_forwards) == (a.metrics.target_forwards,
                                                                          a.metrics.drafter_forwards)
    assert "capturing a step" not in caplog.text, caplog.text
