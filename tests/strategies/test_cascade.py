"""Cascade Speculative Drafting is lossless: greedy equals plain greedy decoding for any valid
K and lenience; sampling follows the target at every temperature, lenience included."""
import dataclasses
import random
import re
from types import SimpleNamespace

import pytest
import torch

from csd_engine import Autoregressive, Cascade, Engine, SamplingParams, Speculative
from csd_engine.strategies.cascade import _validate_k_matrix
from csd_engine.strategies.cascade_plan import budgets_from_k, draft_bound
from tests.strategies.common import (assert_greedy_equals_autoregressive, assert_samples_follow_target,
                                     check_proposals)
from tests.tiny_models import perturbed, random_prompts, tiny_llama


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(seed=31)
    return target, perturbed(target, noise=0.25, seed=32), perturbed(target, noise=0.6, seed=33)


def random_k_matrix(rng: random.Random, n: int, last_is_mag: bool):
    """A valid K: upper-triangular, row 0 positive, every neural drafter given drafts from below."""
    while True:
        k = [[0] * n for _ in range(n)]
        for i in range(n):
            for j in range(i, n):
                k[i][j] = rng.randint(0, 3)
        try:
            _validate_k_matrix(k, n, [False] * (n - 1) + [last_is_mag])
            return k
        except ValueError:
            continue


def test_greedy_fuzz_random_k_lenience_batch_and_prompts(models):
    target, d1, d2 = models
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    # Both verification backends (Triton kernel under the interpreter, PyTorch reference).
    engines = {(2, b): Engine(target, drafters=[d1, "mag"], max_batch_size=4, max_seq_len=96, verify_backend=b)
               for b in ("triton", "torch")}
    engines.update({(3, b): Engine(target, drafters=[d1, d2, "mag"], max_batch_size=4, max_seq_len=96,
                                   verify_backend=b) for b in ("triton", "torch")})
    for trial in range(6):
        levels = rng.choice([2, 3])
        backend = "triton" if trial < 2 else "torch"
        k = random_k_matrix(rng, levels, last_is_mag=True)
        strategy = Cascade(k_matrix=k, lenience=rng.choice([1, 1.5, 3, 8]), mag_tokens=rng.randint(1, 5),
                           direct_match=rng.choice([0, 2, 4, 8]), direct_tokens=rng.randint(1, 12))
        # the interpreted kernel costs seconds per call with a large K: its trials stay small
        prompts = random_prompts(rng.randint(1, 2 if backend == "triton" else 4), lo=1, hi=16,
                                 seed=rng.randrange(10**6))
        prompts[0] = prompts[0][:2] * 5  # repetition: MaG's drafts get accepted too
        out = assert_greedy_equals_autoregressive(engines[levels, backend], prompts, strategy,
                                                  max_new_tokens=8 if backend == "triton" else 16)
        m = out[0].metrics
        assert m.target_forwards <= m.new_tokens and m.mean_accepted_tokens >= 1, f"seed {seed} trial {trial}"
        assert set(m.acceptance_by_level) >= {0}


def test_neural_drafters_only_review(models):
    """Drafter forwards are reviews: each counts in that level's acceptance statistics."""
    target, d1, _ = models
    engine = Engine(target, drafters=[d1, "mag"], max_batch_size=2, max_seq_len=64)
    out = engine.generate(random_prompts(2, seed=3), SamplingParams(max_new_tokens=12),
                          strategy=Cascade(k_matrix=[[3, 1], [0, 2]], lenience=2))
    m = out[0].metrics
    assert m.drafter_forwards[0] > 0 and m.drafter_forwards[1] == 0  # MaG has no forward
    assert 1 in m.acceptance_by_level and 0 <= m.acceptance_by_level[1] <= 1
    assert m.swi > 0


@pytest.mark.parametrize("levels,temperature,lenience", [(2, 1.0, 1.0), (2, 0.7, 3.0), (3, 1.0, 2.0), (3, 0.7, 1.0)])
def test_sampling_follows_the_target(models, levels, temperature, lenience):
    target, d1, d2 = models
    drafters = [d1, "mag"] if levels == 2 else [d1, d2, "mag"]
    k = [[2, 1], [0, 2]] if levels == 2 else [[2, 1, 1], [0, 2, 1], [0, 0, 2]]
    engine = Engine(target, drafters=drafters, max_batch_size=2000, max_seq_len=32, verify_backend="torch")
    prompt = [7, 3, 7, 3, 7]
    results = assert_samples_follow_target(engine, target, prompt, Cascade(k_matrix=k, lenience=lenience, mag_tokens=2),
                                           temperature=temperature, draws=2000)
    assert sum(r.metrics.accepted for r in results) > 0


@pytest.mark.parametrize("k,words", [
    ([[2, 1]], r"must be square .* got 1 rows of lengths \[2\]"),
    ([[2, 1], [0]], r"lengths \[2, 1\]"),
    ([[2]], r"must be 2x2 .* got 1x1"),
    ([[2, 1], [1, 2]], "upper-triangular"),
    ([[2, -1], [0, 2]], "non-negative"),
    ([[2, 1.5], [0, 2]], "non-negative integers"),
    ([[0, 0], [0, 2]], "sums to 0"),
])
def test_bad_k_matrix_names_the_rule(models, k, words):
    target, d1, _ = models
    engine = Engine(target, drafters=[d1, "mag"], max_batch_size=1, max_seq_len=32)
    with pytest.raises(ValueError, match=words):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2), strategy=Cascade(k_matrix=k))
    assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].token_ids  # still usable


def test_level_that_cannot_progress_is_refused(models):
    target, d1, d2 = models
    engine = Engine(target, drafters=[d1, d2], max_batch_size=1, max_seq_len=32)
    with pytest.raises(ValueError, match="never make progress"):
        engine.generate([[1, 2]], strategy=Cascade(k_matrix=[[2, 1], [0, 2]]))
    engine = Engine(target, drafters=[d1, "mag"], max_batch_size=1, max_seq_len=32)
    with pytest.raises(ValueError, match="never make progress"):
        engine.generate([[1, 2]], strategy=Cascade(k_matrix=[[2, 1], [0, 0]]))


def test_auto_refuses_drafters_it_cannot_tune_naming_them(models):
    """Cascade.auto() needs [model, 'mag'] or ['mag']: anything else is refused naming the
    drafters it got and what to give instead; the engine stays usable."""
    target, d1, d2 = models
    for drafters, kinds in (([d1], r"\['model'\]"), ([d1, d2, "mag"], r"\['model', 'model', 'mag'\]"),
                            (["mag", d1], r"\['mag', 'model'\]")):
        engine = Engine(target, drafters=drafters, max_batch_size=1, max_seq_len=32)
        with pytest.raises(ValueError, match=rf"drafters are {kinds}: add 'mag' last, or give an explicit "
                                             r"Cascade\(k_matrix=\.\.\.\) \(--k-matrix\)"):
            engine.generate([[1, 2]], SamplingParams(max_new_tokens=2), strategy=Cascade.auto())
        assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].token_ids  # still usable


def test_bad_settings_are_refused_by_the_fixed_and_the_self_tuning_cascade():
    shared = [("lenience", bad) for bad in (0.5, -1, "2", True, float("nan"), float("inf"))] + \
        [("mag_tokens", bad) for bad in (0, 1.0, True)] + [("direct_match", bad) for bad in (-1, "a", 2.0)] + \
        [("direct_tokens", bad) for bad in (0, None)]
    for make, owner in ((Cascade, "Cascade"), (Cascade.auto, "Cascade.auto")):
        for name, bad in shared:
            with pytest.raises(ValueError, match=rf"^{re.escape(owner)}\({name}=\.\.\.\) must be"):
                make(**{name: bad})
    pricing = [("prior", bad) for bad in (0, -1, float("nan"), "4")] + [("prior_rate", bad) for bad in (1, -0.1, True)] \
        + [(name, bad) for name in ("model_cost", "width_cost") for bad in (-0.1, "a", True, float("inf"))]
    for make, owner in ((Cascade.auto, "Cascade.auto"), (Speculative.auto, "Speculative.auto")):
        for name, bad in pricing:
            with pytest.raises(ValueError, match=rf"^{re.escape(owner)}\({name}=\.\.\.\) must be"):
                make(**{name: bad})


def test_auto_is_lossless(models):
    target, d1, _ = models
    engine = Engine(target, drafters=[d1, "mag"], max_batch_size=3, max_seq_len=160, verify_backend="torch")
    prompts = random_prompts(3, lo=2, hi=10, seed=int(torch.randint(0, 10**6, (1,))))
    prompts[1] = prompts[1][:2] * 6
    out = assert_greedy_equals_autoregressive(engine, prompts, Cascade.auto(max_tokens=4), max_new_tokens=60)
    # it speculates (a row may rightly choose plain decoding: its drafts were rejected and MaG matched nothing)
    assert max(o.metrics.mean_accepted_tokens for o in out) > 1.0
    assert_samples_follow_target(Engine(target, drafters=[d1, "mag"], max_batch_size=1500, max_seq_len=32,
                                        verify_backend="torch"),
                                 target, [4, 9, 4, 9], Cascade.auto(), temperature=1.0, draws=1500)


def test_auto_tree_is_lossless_and_counts_the_siblings_the_target_takes(models, monkeypatch):
    """Cascade.auto(tree=...) emits plain greedy decoding's tokens on a ragged batch; its rows
    check trees (width is cheap here) and the target takes some siblings where it rejected the
    model's trunk token: the counts sigma is priced from. A row that wants no tree in a tree
    step (here: a direct row, whose draft is MaG's) has its siblings masked, its trunk kept."""
    import csd_engine.strategies.cascade as cascade
    from csd_engine.ops import PADDING
    target = models[0]
    near = perturbed(target, noise=0.1, seed=34)  # accepted often enough to draft; its second choice often right
    seen, trees = {}, []
    record, verify = cascade.CascadeDecoder._record_siblings, cascade.verify_tree_and_commit

    def spy_record(self, state, *args):
        record(self, state, *args)
        seen["metrics"] = state.metrics

    def spy_verify(models, state, tokens, tree, *args, drafted=None):
        trees.append((tree.parents.clone(), tree.depth[0].clone(), drafted.clone(), state.plan[-1].clone(),
                      state.active.clone()))
        return verify(models, state, tokens, tree, *args, drafted=drafted)

    monkeypatch.setattr(cascade.CascadeDecoder, "_record_siblings", spy_record)
    monkeypatch.setattr(cascade, "verify_tree_and_commit", spy_verify)
    engine = Engine(target, drafters=[near, "mag"], max_batch_size=3, max_seq_len=160, verify_backend="torch")
    prompts = random_prompts(3, lo=2, hi=10, seed=int(torch.randint(0, 10**6, (1,))))
    prompts[1] = prompts[1][:2] * 6  # MaG's long matches: the row goes direct
    strategy = Cascade.auto(max_tokens=4, model_cost=0.05, tree=(3, 2))
    assert_greedy_equals_autoregressive(engine, prompts, strategy, max_new_tokens=60)
    checked, taken = int(seen["metrics"].sibling_checked.sum()), int(seen["metrics"].sibling_accepted.sum())
    assert 0 < taken < checked, (taken, checked)  # some rejected trunk tokens had no sibling the target took
    mixed = 0
    for parents, depth, drafted, wants, active in trees:
        sibling = torch.cat([torch.tensor([False]), depth[1:] == depth[:-1]])  # after its depth's trunk node
        inside = (depth[None, :] <= drafted[:, None]) & (depth[None, :] > 0)
        assert (parents[inside & ~sibling] >= 0).all()  # every row's trunk is checked
        assert (parents[inside & sibling & (wants > 0)[:, None]] >= 0).all()
        assert (parents[sibling & (wants == 0)[:, None]] == PADDING).all()
        mixed += bool(((wants > 0) & active).any() and ((wants == 0) & active & (drafted > 0)).any())
    assert mixed > 0, "no tree step held a row that wanted none"


@pytest.mark.parametrize("trim", [True, False])
def test_auto_counts_mag_slots_it_left_empty_where_the_target_reads_them(models, trim):
    """Cascade.auto()'s verdict counts, three rows asking 2 model and 3 top-level MaG tokens: MaG
    proposed none and the target took both model tokens (row 0), proposed all 3 and the target took
    all 5 (row 1), proposed none and the target rejected a model token (row 2). Where the target
    reads the plan's whole width (no trim: a GPU) row 0's empty slots cost width for nothing: one MaG
    token checked, not accepted. Where drafts are trimmed (the CPU) they cost nothing and count nothing."""
    import dataclasses

    from csd_engine.strategies.base import Draft, StepMetrics
    target, d1, _ = models
    engine = Engine(target, drafters=[d1, "mag"], max_batch_size=3, max_seq_len=32)
    decoder = Cascade.auto().decoder(dataclasses.replace(engine._decoder_models(), trim_drafts=trim))
    model, mag = decoder.neural_source.index, decoder.mag_source.index
    budgets = [torch.zeros(3, dtype=torch.int64) for _ in decoder.sources]  # a MaG level below the model: none
    budgets[model], budgets[mag] = torch.tensor([2, 2, 2]), torch.tensor([3, 3, 3])
    origin = torch.full((3, 6), -1)
    origin[:, :2] = model
    origin[1, 2:5] = mag
    plan = torch.zeros(3, 3, dtype=torch.int64)  # only its last two columns are read: not direct, no tree
    state = SimpleNamespace(metrics=StepMetrics.zeros(3, "cpu", levels=3, sources=len(decoder.sources)),
                            active=torch.ones(3, dtype=torch.bool), plan=plan.t())
    work = SimpleNamespace(origin=origin, width=5, tree=False)
    draft = Draft(torch.zeros(3, 5, dtype=torch.int64), torch.tensor([2, 5, 2]))
    decoder._record_verdicts(state, work, budgets, draft, torch.tensor([2, 5, 1]), None)
    assert state.metrics.source_accepted[mag].tolist() == [0, 3, 0]
    assert state.metrics.source_checked[mag].tolist() == ([0, 3, 0] if trim else [1, 3, 0])
    assert state.metrics.source_accepted[model].tolist() == [2, 2, 1]
    assert state.metrics.source_checked[model].tolist() == [2, 2, 2]


def test_auto_chooses_the_tree_where_its_siblings_pay(models):
    """A row checks its draft as the tree where the target took its siblings (sigma 0.9) and
    width is cheap; not where it never took one, nor where each node costs 0.5 of a forward,
    nor when it goes direct (its draft is MaG's). The plan carries the choice in its last column."""
    from csd_engine.strategies.base import StepMetrics
    target, d1, _ = models
    engine = Engine(target, drafters=[d1, "mag"], max_batch_size=2, max_seq_len=32)
    wants = {}
    for width in (0.02, 0.5):
        decoder = Cascade.auto(max_tokens=6, model_cost=0.05, width_cost=width, tree=(3, 2)).decoder(
            engine._decoder_models())
        state = SimpleNamespace(metrics=StepMetrics.zeros(2, "cpu", levels=3, sources=len(decoder.sources)), batch=2,
                                rows_in_use=None, pending=torch.zeros(2, dtype=torch.int64))
        model = decoder.neural_source.index
        state.metrics.source_accepted[model] = torch.tensor([700, 700])  # the model's tokens: alpha 0.7
        state.metrics.source_checked[model] = torch.tensor([1000, 1000])
        state.metrics.sibling_accepted[:] = torch.tensor([900, 0])
        state.metrics.sibling_checked[:] = torch.tensor([1000, 1000])
        for direct in (False, True):
            budgets, _, tree = decoder.plan_budgets(state, torch.tensor([direct, False]), None)
            wants[width, direct] = tree.tolist()
            assert budgets[model][1] > 0  # the row without siblings still drafts with the model
    assert wants == {(0.02, False): [True, False], (0.02, True): [False, False],
                     (0.5, False): [False, False], (0.5, True): [False, False]}, wants
    with pytest.raises(ValueError, match=r"Cascade.auto\(tree=...\) needs a neural drafter"):
        Engine(target, drafters=["mag"], max_batch_size=1, max_seq_len=32).generate(
            [[1, 2]], SamplingParams(max_new_tokens=2), strategy=Cascade.auto(tree=(3, 2)))
    with pytest.raises(ValueError, match=r"tree=...\) must be a tuple of ints >= 1"):
        Cascade.auto(tree=(3, 0))


def test_auto_counts_no_direct_row_toward_mag_rate(models, monkeypatch):
    """gamma prices MaG's top-level tokens in steps that are not direct: a direct row's long
    verbatim match is left out of the per-source counts (record_sources sees it inactive)."""
    from csd_engine.strategies.base import StepMetrics
    from csd_engine.strategies.cascade import CascadeDecoder
    target, d1, _ = models
    engine = Engine(target, drafters=[d1, "mag"], max_batch_size=2, max_seq_len=96, verify_backend="torch")
    seen = []
    direct_of = CascadeDecoder._direct
    record = StepMetrics.record_sources

    def spy_direct(self, state):
        out = direct_of(self, state)
        seen.append([out[0].clone()])
        return out

    def spy_record(self, origin, length, accepted, active, sources):
        seen[-1].append(active.clone())
        return record(self, origin, length, accepted, active, sources)
    monkeypatch.setattr(CascadeDecoder, "_direct", spy_direct)
    monkeypatch.setattr(StepMetrics, "record_sources", spy_record)
    prompts = [[5, 6, 7, 8] * 6, [9, 3] * 5]
    assert_greedy_equals_autoregressive(engine, prompts, Cascade.auto(direct_match=2), max_new_tokens=16)
    steps = [s for s in seen if len(s) == 2]  # the step's call (the plan's reads the same flags)
    assert any(direct.any() for direct, _ in steps)
    assert all(not (direct & active).any() for direct, active in steps)


def test_auto_verifies_no_wider_than_the_rows_budgets(models):
    """A row that drafts nothing with its model sends the target MaG's tokens only: the target
    reads pending + 4 tokens, not the envelope's 1 + 13 (K = [[6, 4], [0, 4]]) run masked."""
    target, d1, _ = models
    engine = Engine(target, drafters=[d1, "mag"], max_batch_size=2, max_seq_len=64, verify_backend="torch")
    prompts = random_prompts(2, lo=4, hi=10, seed=5)
    widths, forward = [], engine.target.forward

    def recording(batch):
        if batch.need_logits:
            widths.append(batch.input_ids.shape[1])
        return forward(batch)

    engine.target.forward = recording
    try:  # a model this costly never pays: every budget is 0
        out = assert_greedy_equals_autoregressive(
            engine, prompts, Cascade.auto(max_tokens=6, mag_tokens=4, model_cost=50.0, direct_match=0),
            max_new_tokens=20)
    finally:
        del engine.target.forward
    assert all(sum(r.metrics.drafter_forwards) == 0 for r in out)
    assert widths and max(widths) <= 5, widths


def test_auto_model_reviews_no_more_mag_tokens_than_its_budget_needs(models):
    """A model asked for a tokens gets its first from its own forward and needs at most a - 1
    of MaG's: at max_tokens=1 it reviews none, while with a larger budget (and a model forward
    costly enough that fewer, wider reviews pay) it reviews MaG's matches on the same repetitive
    prompts."""
    target, d1, _ = models
    engine = Engine(target, drafters=[d1, "mag"], max_batch_size=2, max_seq_len=96, verify_backend="torch")
    prompts = [p[:3] * 5 for p in random_prompts(2, lo=3, hi=6, seed=11)]
    reviewed = {}
    for a in (1, 6):
        out = assert_greedy_equals_autoregressive(
            engine, prompts, Cascade.auto(max_tokens=a, mag_tokens=4, model_cost=0.5, prior_rate=0.99,
                                          direct_match=0), max_new_tokens=24)
        reviewed[a] = [1 in r.metrics.acceptance_by_level for r in out]
        assert all(sum(r.metrics.drafter_forwards) > 0 for r in out), a  # the model drafted
    assert not any(reviewed[1]) and any(reviewed[6]), reviewed


def test_a_cpu_engine_feeds_only_real_drafts_with_the_same_tokens(models):
    """Engine.trim_drafts (on for a CPU engine): the target and the drafter's reviews read only
    up to the batch's longest real draft, fewer tokens than the host-known bounds the device path
    feeds (K's envelope, MaG budgets its matches leave unfilled), with the same greedy tokens."""
    target, d1, _ = models
    engine = Engine(target, drafters=[d1, "mag"], max_batch_size=3, max_seq_len=64, verify_backend="torch")
    prompts = random_prompts(3, lo=4, hi=12, seed=9)
    strategy = Cascade(k_matrix=[[2, 4], [0, 4]], lenience=2.0, mag_tokens=4)
    fed = {}
    for trim in (True, False):
        engine.trim_drafts = trim
        counts = {"target": 0, "drafter": 0}
        for name, runner in (("target", engine.target), ("drafter", engine.drafters[0])):
            def recording(batch, forward=runner.forward, name=name):
                if batch.need_logits:
                    counts[name] += batch.input_ids.shape[1]
                return forward(batch)
            runner.forward = recording
        try:
            out = assert_greedy_equals_autoregressive(engine, prompts, strategy, max_new_tokens=24)
        finally:
            del engine.target.forward, engine.drafters[0].forward
        fed[trim] = counts, [r.token_ids for r in out]
    assert Engine(target, max_batch_size=1, max_seq_len=16, device="cpu").trim_drafts
    assert fed[True][1] == fed[False][1]
    assert fed[True][0]["target"] < fed[False][0]["target"] and fed[True][0]["drafter"] < fed[False][0]["drafter"], fed


@pytest.mark.parametrize("trim", [True, False])
def test_reviews_by_a_copy_of_the_target_draft_only_what_the_target_accepts(models, trim):
    """A drafter that is the target itself, reviewing MaG's tokens at lenience 1, passes on only
    tokens the target chose: the target accepts every token the step drafts. Exactness alone
    cannot see a review that checks the wrong tokens or logits (the target still decides), this
    can: e.g. a later review reading its logits one slot off. On the device path (no trim) and
    the CPU's."""
    target = models[0]
    engine = Engine(target, drafters=[perturbed(target, noise=0.0, seed=0), "mag"], max_batch_size=2,
                    max_seq_len=96, verify_backend="torch")
    engine.trim_drafts = trim
    prompts = [[5, 6, 7, 8, 9] * 4, [3, 1, 4, 1, 5, 9, 2, 6] * 2]  # repeats: MaG proposes
    # one MaG token per review: a step's budget of 6 takes several reviews, the later ones with drafts
    out = assert_greedy_equals_autoregressive(engine, prompts, Cascade(k_matrix=[[6, 0], [0, 1]], lenience=1.0,
                                                                       mag_tokens=1), max_new_tokens=40)
    for r in out:
        assert r.metrics.drafted > 0 and r.metrics.accepted == r.metrics.drafted, (r.metrics.accepted,
                                                                                   r.metrics.drafted)


def test_a_cpu_engine_stops_a_drafters_reviews_once_no_row_needs_one():
    """On the CPU (trim_drafts) a neural source's review rounds end once every row has its
    budget; the device path runs the rest masked. A target whose final norm is zeroed emits
    token 0 forever (all logits tie), so MaG's one-token proposals are always right and the
    drafter (the target itself) takes them: 2 tokens a review, a budget of 6 in 3 reviews, not 6.
    Same tokens either way."""
    target = tiny_llama(seed=31)
    with torch.no_grad():
        target.model.norm.weight.zero_()
    engine = Engine(target, drafters=[perturbed(target, noise=0.0, seed=0), "mag"], max_batch_size=2,
                    max_seq_len=96, verify_backend="torch")
    prompts = [[5, 6, 7, 8, 9] * 4, [3, 1, 4, 1, 5, 9, 2, 6] * 2]
    strategy = Cascade(k_matrix=[[6, 0], [0, 1]], lenience=1.0, mag_tokens=1)
    runs = {}
    for trim in (True, False):
        engine.trim_drafts = trim
        out = assert_greedy_equals_autoregressive(engine, prompts, strategy, max_new_tokens=40)
        runs[trim] = [r.token_ids for r in out], [r.metrics.drafter_forwards[0] / r.metrics.target_forwards
                                                  for r in out]
    assert runs[True][0] == runs[False][0]
    assert all(f == 6 for f in runs[False][1]), runs  # every round, every step
    assert all(f < 4 for f in runs[True][1]), runs


def test_a_drafters_later_reviews_feed_only_the_new_tokens(models):
    """On the device path (no trim) a review's forward width is a host-known bound on how far the
    drafter's cache trails the draft: after its first review of a step the drafter holds the draft
    but its last token, so its later reviews feed 1 + MaG's tokens (5 here), not a bound that grows
    by every earlier review's width (5, 10, 15, 20); the tokens stay plain decoding's."""
    target, d1, _ = models
    engine = Engine(target, drafters=[d1, "mag"], max_batch_size=2, max_seq_len=96, verify_backend="torch")
    engine.trim_drafts = False
    widths = []

    def recording(batch, forward=engine.drafters[0].forward):
        if batch.need_logits:
            widths.append(batch.input_ids.shape[1])
        return forward(batch)
    engine.drafters[0].forward = recording
    try:
        assert_greedy_equals_autoregressive(engine, random_prompts(2, lo=4, hi=10, seed=3),
                                            Cascade(k_matrix=[[4, 2], [0, 4]], lenience=2.0, mag_tokens=4),
                                            max_new_tokens=32)
    finally:
        del engine.drafters[0].forward
    assert widths and widths.count(5) >= len(widths) // 2 and max(widths) < 15, widths


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_review_seeds_are_mixed_once_per_request_never_in_a_step(models, monkeypatch, temperature):
    """Seed mixing is ~20 kernels on a GPU: a cascade derives every review's seed of a request
    once, when it is admitted (one call per neural drafter for the rows admitted together), and
    no step mixes any (a sampling step asks for the target's stream 0 once, which mixes nothing)."""
    import csd_engine.strategies.base as base
    import csd_engine.strategies.cascade as cascade
    calls = []
    for module in (base, cascade):
        real = module.stream_seed
        monkeypatch.setattr(module, "stream_seed", lambda seed, stream, real=real: calls.append(1) or real(seed, stream))
    target, d1, d2 = models
    engine = Engine(target, drafters=[d1, d2, "mag"], max_batch_size=2, max_seq_len=64, verify_backend="torch")
    strategy = Cascade(k_matrix=[[2, 1, 1], [0, 2, 1], [0, 0, 2]], lenience=2.0, mag_tokens=2)
    out = engine.generate(random_prompts(2, lo=4, hi=8, seed=5),
                          SamplingParams(temperature=temperature, seed=1, max_new_tokens=16), strategy=strategy)
    steps = max(r.metrics.target_forwards for r in out)
    reviews = sum(sum(r.metrics.drafter_forwards) for r in out)
    assert len(calls) == 2 + (steps if temperature else 0) < reviews, (len(calls), steps, reviews)


@pytest.mark.parametrize("direct_match", [0, 3])
def test_the_plan_selected_from_k_rows_equals_the_plan_computed(models, direct_match):
    """A fixed K's plan is a per-row selection of two rows built once (a row drafting by K, a
    direct row with MaG's proposal length as its width): the same plan as computing every
    column from the row's budgets, for a row that goes direct and one that does not."""
    target, d1, _ = models
    engine = Engine(target, drafters=[d1, "mag"], max_batch_size=2, max_seq_len=48)
    decoder = Cascade(k_matrix=((2, 4), (0, 4)), lenience=2.0, direct_match=direct_match,
                      direct_tokens=6).decoder(engine._decoder_models())
    scheduler = engine.scheduler(Autoregressive(), rows=2)
    scheduler.add([5, 6, 7, 8, 9, 10, 5, 6, 7, 8])  # ends on a 4-token repeat: a long MaG match
    scheduler.add([1, 2, 3, 4])
    scheduler._admit()
    state = scheduler.state
    scheduler.close()
    lag = [state.committed - engine.drafters[0].cache.lengths, torch.zeros_like(state.committed)]  # d1, MaG
    for _ in range(2):  # the first call builds the two rows, the second reuses them
        direct, ready = decoder._direct(state)
        direct = torch.zeros(2, dtype=torch.bool) if direct is None else direct  # None: no row can go direct
        budgets = budgets_from_k(decoder.levels, 2, "cpu")  # sources: d1 (its MaG below), then MaG at the top
        m = decoder.mag_tokens
        caps = [torch.zeros(2, dtype=torch.int64), torch.full((2,), m), torch.full((2,), m)]
        if direct_match:  # the first row: no neural tokens, one MaG call of up to direct_tokens
            budgets[0][0], budgets[2][0], caps[2][0] = 0, 1, 6
        width = draft_bound(decoder.levels, budgets, decoder.mag_tokens)
        width = width if ready is None else torch.where(direct, ready, width)
        no_tree = torch.zeros(2, dtype=torch.int64)  # K's cascade without a tree: no row checks one
        computed = torch.stack(lag + budgets + [width] + caps + [direct.long(), no_tree], 1)
        assert torch.equal(decoder.plan(state), computed)
    assert direct.tolist() == ([True, False] if direct_match else [False, False])


def test_auto_budgets_follow_counted_acceptance_and_costs(models):
    """Each row picks its own model and MaG budgets from its counted rates and the fixed costs: a
    row whose drafts the target always accepts drafts as much as allowed with a cheap model; a row
    whose drafts are always rejected runs no neural forward; MaG's top-level tokens are sent only
    where their rate pays for the width they add; a row with a long MaG match goes direct."""
    from csd_engine.strategies.base import StepMetrics
    target, d1, _ = models
    engine = Engine(target, drafters=[d1, "mag"], max_batch_size=2, max_seq_len=32)
    decoder = Cascade.auto(max_tokens=6, model_cost=0.05).decoder(engine._decoder_models())
    scheduler = engine.scheduler(Autoregressive(), rows=2)
    scheduler.add([1, 2, 3])
    scheduler.add([4, 5, 6])
    scheduler._admit()
    state = scheduler.state
    scheduler.close()
    model = decoder.neural_source.index
    state.metrics = StepMetrics.zeros(2, "cpu", levels=3, sources=len(decoder.sources))
    state.metrics.level_accepted[1] = torch.tensor([1000, 0])
    state.metrics.level_drafted[1] = torch.tensor([1000, 1000])
    state.metrics.source_accepted[model] = torch.tensor([1000, 0])
    state.metrics.source_checked[model] = torch.tensor([1000, 1000])
    budgets, caps = decoder.plan_budgets(state, torch.tensor([False, False]), None)[:2]
    assert budgets[decoder.neural_source.index].tolist() == [6, 0]
    # the model's 6 tokens in the fewest reviews: 2, of 1 + 3 MaG tokens each where it takes (nearly) every one
    assert caps[decoder.sub_mag_source.index].tolist() == [3, 0]
    budgets, _ = decoder.plan_budgets(state, torch.tensor([True, False]), None)[:2]
    assert budgets[decoder.neural_source.index][0] == 0 and budgets[decoder.mag_source.index][0] > 0
    # MaG's top-level tokens: proposed in full where the target takes them, not at all where it never does
    mag = decoder.mag_source.index
    state.metrics.source_accepted[mag] = torch.tensor([1000, 0])
    state.metrics.source_checked[mag] = torch.tensor([1000, 1000])
    budgets, caps = decoder.plan_budgets(state, torch.tensor([False, False]), None)[:2]
    assert budgets[mag].tolist() == [4, 0] and caps[mag].tolist() == [4, 0]
    # ... and only where they pay for the width they add: at a 12% rate (row 1, whose model drafts
    # nothing) one token pays at width_cost 0.02 (1.12 tokens for 1.02), none at 0.15 (for 1.15)
    state.metrics.source_accepted[mag] = torch.tensor([120, 120])
    for width, paid in ((0.02, True), (0.15, False)):
        wide = Cascade.auto(max_tokens=6, model_cost=0.05, width_cost=width).decoder(engine._decoder_models())
        budgets, caps = wide.plan_budgets(state, torch.tensor([False, False]), None)[:2]
        assert (budgets[mag][1] > 0) == paid and caps[mag][1] == budgets[mag][1], (width, budgets[mag])


def test_auto_model_reviews_mag_tokens_only_where_it_takes_them(models):
    """The MaG tokens c the model reviews per forward follow its own share of them: where it
    takes (nearly: the prior) every one, the fewest reviews for its budget (6 tokens: 2 reviews of 1 + 3); where it
    takes none, c = 0 (the model drafts alone, one-token forwards, instead of widening each)."""
    from csd_engine.strategies.base import StepMetrics
    target, d1, _ = models
    engine = Engine(target, drafters=[d1, "mag"], max_batch_size=2, max_seq_len=32)
    decoder = Cascade.auto(max_tokens=6, model_cost=0.3, width_cost=0.1).decoder(engine._decoder_models())
    state = SimpleNamespace(metrics=StepMetrics.zeros(2, "cpu", levels=3, sources=len(decoder.sources)), batch=2,
                            rows_in_use=None, pending=torch.zeros(2, dtype=torch.int64))
    model = decoder.neural_source.index
    state.metrics.source_accepted[model] = state.metrics.source_checked[model] = torch.tensor([1000, 1000])
    state.metrics.level_accepted[1] = torch.tensor([1000, 0])
    state.metrics.level_drafted[1] = torch.tensor([1000, 1000])
    budgets, caps = decoder.plan_budgets(state, torch.tensor([False, False]), None)[:2]
    assert budgets[model].tolist() == [6, 6] and caps[decoder.sub_mag_source.index].tolist() == [3, 0]
    # where a step runs every review round its widest row asks for (the device path: no trim), fewer,
    # wider reviews save no forward: the model drafts alone however many MaG tokens it would take, and
    # its plan has no MaG level below it (no MaG call, one-token reviews)
    device = Cascade.auto(max_tokens=6, model_cost=0.3, width_cost=0.1).decoder(
        dataclasses.replace(engine._decoder_models(), trim_drafts=False))
    assert device.sub_mag_source is None and device.neural_source.below.sources == ()
    budgets, caps = device.plan_budgets(state, torch.tensor([False, False]), None)[:2]
    assert budgets[device.neural_source.index].tolist() == [6, 6]


def test_auto_prices_a_review_as_the_models_forward_plus_the_width_increment(models):
    """A review of 1 + c tokens costs model_cost + width(1 + c) - 1: a cheap model (0.05) on a
    steep curve (0.3 a token) drafts alone (c = 0: 6 one-token reviews of 0.05) even where it
    takes every MaG token (2 reviews of 1 + 3 cost 0.95 each). Priced as the model's forward
    scaled by the curve (0.05 * width), it would review 3 at a time: on the bench prompts that
    chose worse (the model's lenient acceptance of MaG's tokens overstates their worth)."""
    from csd_engine.strategies.base import StepMetrics
    target, d1, _ = models
    engine = Engine(target, drafters=[d1, "mag"], max_batch_size=1, max_seq_len=32)
    decoder = Cascade.auto(max_tokens=6, model_cost=0.05, width_cost=0.3).decoder(engine._decoder_models())
    state = SimpleNamespace(metrics=StepMetrics.zeros(1, "cpu", levels=3, sources=len(decoder.sources)), batch=1,
                            rows_in_use=None, pending=torch.zeros(1, dtype=torch.int64))
    model = decoder.neural_source.index
    state.metrics.source_accepted[model] = state.metrics.source_checked[model] = torch.tensor([1000])
    state.metrics.level_accepted[1] = state.metrics.level_drafted[1] = torch.tensor([1000])
    budgets, caps = decoder.plan_budgets(state, torch.tensor([False]), None)[:2]
    assert budgets[model].tolist() == [6] and caps[decoder.sub_mag_source.index].tolist() == [0]


def test_auto_weighs_mag_by_what_it_proposes_now(models):
    """With no model tokens, MaG's top-level tokens are the ones it proposes at the committed end
    (`ready`): a row whose model rate fell to 0.64 after one rejected token sits the model out
    while MaG holds a match (MaG's 0.5-rate tokens pay more), and drafts with it again where MaG
    holds nothing, instead of decoding plainly for good; g never exceeds MaG's proposal."""
    from csd_engine.strategies.base import StepMetrics
    target, d1, _ = models
    engine = Engine(target, drafters=[d1, "mag"], max_batch_size=2, max_seq_len=32)
    decoder = Cascade.auto(model_cost=0.35, width_cost=0.15).decoder(engine._decoder_models())
    state = SimpleNamespace(metrics=StepMetrics.zeros(2, "cpu", levels=3, sources=len(decoder.sources)), batch=2,
                            rows_in_use=None, pending=torch.zeros(2, dtype=torch.int64))
    model, mag = decoder.neural_source.index, decoder.mag_source.index
    state.metrics.source_checked[model] = torch.tensor([1, 1])  # one model token checked, rejected
    budgets, caps = decoder.plan_budgets(state, torch.tensor([False, False]), torch.tensor([4, 0]))[:2]
    assert budgets[model].tolist() == [0, 1], budgets
    assert budgets[mag][0] == caps[mag][0] == 2
    budgets, caps = decoder.plan_budgets(state, torch.tensor([False, False]), torch.tensor([1, 0]))[:2]
    assert budgets[model][0] == 0 and budgets[mag][0] == caps[mag][0] == 1  # no more than MaG holds


def test_auto_starts_from_an_optimistic_model_rate(models):
    """A row learns the model's rate only by drafting: a fresh row starts at prior_rate (0.8) and
    drafts more model tokens than at 0.5 (a model costing 0.2 of the target, 0.15 a token of
    width); a rate outside [0, 1) is refused."""
    from csd_engine.strategies.base import StepMetrics
    target, d1, _ = models
    engine = Engine(target, drafters=[d1, "mag"], max_batch_size=1, max_seq_len=32)
    picked = {}
    for rate in (0.8, 0.5):
        decoder = Cascade.auto(model_cost=0.2, width_cost=0.15, prior_rate=rate).decoder(engine._decoder_models())
        state = SimpleNamespace(metrics=StepMetrics.zeros(1, "cpu", levels=3, sources=len(decoder.sources)), batch=1,
                                rows_in_use=None, pending=torch.zeros(1, dtype=torch.int64))
        budgets, _ = decoder.plan_budgets(state, torch.tensor([False]), torch.tensor([0]))[:2]  # MaG holds nothing
        picked[rate] = int(budgets[decoder.neural_source.index][0])
    assert picked[0.8] > picked[0.5], picked
    for bad in (1.0, -0.1, True):
        with pytest.raises(ValueError, match=r"prior_rate=\.\.\.\) must be a number in \[0, 1\)"):
            Cascade.auto(prior_rate=bad)


@pytest.mark.parametrize("native_bf16", [False, True])
@pytest.mark.parametrize("forced", ["1", "0"])
def test_auto_prices_width_by_platform(forced, native_bf16, models, monkeypatch):
    """The auto strategies' default width costs: where a bf16 target runs on csd_engine's CPU
    kernel without native bf16, the measured AVX2 curve (1x at 2 tokens, 1.36x at 5, 2.19x at 9,
    interpolated between its points, extended past 17 tokens); on the kernel with native bf16 the
    AVX-512 one; elsewhere 1 + 0.02 (n - 1); a given width_cost is a slope; a negative one is refused."""
    from csd_engine import ops
    target, d1, _ = models
    monkeypatch.setenv("CSD_BF16_LINEAR", forced)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)  # AMX has native bf16 too
    monkeypatch.setattr(ops, "cpu_kernel_isa", lambda: "avx512_bf16" if native_bf16 else "avx2")
    ops.bf16_kernel_pays.cache_clear()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            engine = Engine(target, drafters=[d1, "mag"], max_batch_size=1, max_seq_len=32, dtype=dtype)
            on_kernel = dtype == torch.bfloat16 and ops.bf16_kernel_pays()
            kernel = on_kernel and not native_bf16
            costs = Cascade.auto().decoder(engine._decoder_models()).prices(1).width
            expected = [1, 1, 1, 1.07, 1.13, 1.36, 1.48, 1.85, 1.95, 2.19] if kernel else \
                [1, 1, 1.1, 1.1, 1.11, 1.12, 1.305, 1.49, 1.57, 1.65] if on_kernel else \
                [1, 1, 1.02, 1.04, 1.06, 1.08, 1.1, 1.12, 1.14, 1.16]
            assert costs[:10].tolist() == pytest.approx(expected, abs=1e-4)
            chain = Speculative.auto(max_tokens=8).decoder(engine._decoder_models()).prices(1).width
            assert chain.tolist() == pytest.approx(expected, abs=1e-4)
            linear = Cascade.auto(width_cost=0.1).decoder(engine._decoder_models()).prices(1).width
            assert linear[5] == pytest.approx(1.4)
            # between points (10 tokens: halfway from 2.19x at 9 to 2.66x at 11), and past the
            # last (17 tokens, 3.87x) at its last slope, 0.23 a token
            wide = Cascade.auto(max_tokens=20).decoder(engine._decoder_models()).prices(1).width
            assert wide[10] == pytest.approx(2.425 if kernel else 1.75 if on_kernel else 1.18)
            # the AVX-512 curve's points past 17 tokens price torch's matmul there (24: 3.3x, 32: 3.75x)
            assert wide[25] == pytest.approx(5.71 if kernel else 3.35625 if on_kernel else 1.48)
    finally:
        monkeypatch.undo()
        ops.bf16_kernel_pays.cache_clear()
    with pytest.raises(ValueError, match=r"width_cost=\.\.\.\) must be a number >= 0"):
        Cascade.auto(width_cost=-0.1)



def test_on_a_cpu_curve_a_step_of_several_rows_is_priced_by_its_rows_and_chosen_for_all(models, monkeypatch):
    """Where a CPU curve prices the target, a step of r rows forwards r times the tokens, so the
    self-tuning strategies price a forward of w tokens a row at curve(r w) / curve(r), the model's
    forward at model_cost curve(r) / curve(r) and its first at model_cost curve(2r) / curve(r), and
    the active rows share one choice. One row, batch_invariant=True and a given width_cost keep
    one row's prices, chosen per row. Greedy output still equals plain decoding, ragged prompts."""
    from csd_engine.strategies import budget
    from csd_engine.strategies.base import StepMetrics
    target, d1, _ = models
    curve = budget.AVX512_KERNEL_WIDTH_COSTS
    monkeypatch.setattr(budget, "target_curve", lambda models: curve)
    on = lambda x: float(budget._on_curve(curve, torch.tensor(float(x), dtype=torch.float64)))  # noqa: E731
    engine = Engine(target, drafters=[d1, "mag"], max_batch_size=3, max_seq_len=64)
    decoder = Speculative.auto(max_tokens=4, model_cost=0.1).decoder(engine._decoder_models())
    one, three = decoder.prices(1), decoder.prices(3)
    assert not one.shared and one.width[:6].tolist() == pytest.approx([1, 1, 1.1, 1.1, 1.11, 1.12], abs=1e-4)
    assert three.shared
    assert three.width.tolist() == pytest.approx([on(3 * max(w, 1)) / on(3) for w in range(6)], rel=1e-5)
    assert float(three.model) == pytest.approx(0.1) and float(three.first) == pytest.approx(0.1 * on(6) / on(3))
    assert not Speculative.auto(width_cost=0.02).decoder(engine._decoder_models()).prices(3).shared
    invariant = Engine(target, drafters=[d1, "mag"], max_batch_size=3, max_seq_len=64, batch_invariant=True)
    assert not Speculative.auto().decoder(invariant._decoder_models()).prices(3).shared
    # rows that counted 0.97 and 0.1 acceptance, and an inactive one: the active rows draft alike
    state = SimpleNamespace(metrics=StepMetrics.zeros(3, "cpu", levels=2, sources=1), batch=3, rows_in_use=None,
                            pending=torch.zeros(3, dtype=torch.int64), active=torch.tensor([True, True, False]))
    state.metrics.source_accepted[0] = torch.tensor([970, 100, 0])
    state.metrics.source_checked[0] = torch.tensor([1000, 1000, 0])
    lengths = decoder.budget(state).tolist()
    assert lengths[0] == lengths[1] and lengths[2] == 0, lengths
    prompts = random_prompts(3, lo=3, hi=20, seed=41)
    for strategy in (Speculative.auto(max_tokens=4, model_cost=0.01), Cascade.auto(max_tokens=4, model_cost=0.01)):
        fast = assert_greedy_equals_autoregressive(engine, prompts, strategy, max_new_tokens=16)
        assert sum(r.metrics.drafted for r in fast) > 0, f"{strategy} drafted nothing: the shared path went untried"


@pytest.mark.parametrize("isa", ["amx", "avx512_bf16"])
def test_the_kernel_runs_on_a_cpu_with_amx_and_width_is_priced_by_its_curve(isa, models, monkeypatch):
    """With AMX (a Sapphire Rapids Xeon) the kernel runs by default, on AMX's bf16 tiles, and the
    auto strategies price width by budget.AMX_TILE_WIDTH_COSTS (nearly flat to 16 tokens); where
    the kernel runs its FMA tiles there (CSD_CPU_ISA=avx512_bf16: the one-token forward 0.56x
    torch's, its wide ones dearer), by budget.AMX_KERNEL_WIDTH_COSTS."""
    from csd_engine import ops
    target, d1, _ = models
    monkeypatch.delenv("CSD_BF16_LINEAR", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx2_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(ops, "cpu_kernel_isa", lambda: isa)
    ops.bf16_kernel_pays.cache_clear()
    try:
        assert ops.bf16_kernel_pays() == ("cpu" in ops._BF16_LINEAR_DEVICES) and not ops.kernel_without_native_bf16()
        if not ops.bf16_kernel_pays():
            pytest.skip("the extension's bf16 kernel is not built here")
        assert ops.bf16_kernel_on_amx() == (isa == "amx")
        engine = Engine(target, drafters=[d1, "mag"], max_batch_size=1, max_seq_len=32, dtype=torch.bfloat16)
        costs = Cascade.auto().decoder(engine._decoder_models()).prices(1).width
        expected = [1, 1, 1.02, 1.03, 1.09, 1.15, 1.205, 1.26, 1.27, 1.28] if isa == "amx" else \
            [1, 1, 1.09, 1.16, 1.22, 1.36, 1.69, 2.02, 2.095, 2.17]
        assert costs[:10].tolist() == pytest.approx(expected, abs=1e-4)
    finally:
        monkeypatch.undo()
        ops.bf16_kernel_pays.cache_clear()


def test_auto_prices_a_float32_target_that_streams_its_weights_by_the_float32_curve(models, monkeypatch):
    """A float32 target on the CPU whose weights stream from memory pays about twice a one-token
    forward for any wider one (torch's matrix-matrix path): the auto strategies price width by
    budget.FLOAT32_CPU_WIDTH_COSTS there, and so at the prior rates draft nothing with a drafter a
    third of its size; a model small enough for the caches keeps the near-flat default."""
    from csd_engine.models.llama import LlamaRunner
    from csd_engine.strategies import budget
    target, d1, _ = models
    engine = Engine(target, drafters=[d1, "mag"], max_batch_size=1, max_seq_len=32)
    decoder_models = engine._decoder_models()
    assert Speculative.auto().decoder(decoder_models).prices(1).width[2] == pytest.approx(1.02)
    monkeypatch.setattr(LlamaRunner, "weight_bytes", property(lambda self: budget.STREAMED_WEIGHT_BYTES))
    costs = Speculative.auto(max_tokens=8).decoder(decoder_models).prices(1).width
    assert costs.tolist() == pytest.approx([1, 1, 2.15, 3.04, 2.09, 2.24, 2.61, 2.98, 2.81, 2.64], abs=1e-4)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    result = engine.generate([[5, 9, 2, 7]], params, strategy=Speculative.auto(model_cost=0.33))[0]
    assert result.metrics.drafter_forwards[0] == 0 and result.metrics.mean_accepted_tokens == 1.0


def test_per_source_counts_stop_at_the_first_rejection():
    """record_sources: a source's tokens count as checked up to the first rejected slot of the row
    (the tokens after it were never judged), as accepted before it; inactive rows count nothing."""
    from csd_engine.strategies.base import StepMetrics
    m = StepMetrics.zeros(4, "cpu", sources=2)
    origin = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, -1, -1]])
    length, accepted = torch.tensor([5, 5, 5, 3]), torch.tensor([1, 3, 5, 3])
    m.record_sources(origin, length, accepted, torch.tensor([True, True, True, False]), [0, 1])
    assert m.source_accepted[0].tolist() == [1, 2, 2, 0] and m.source_checked[0].tolist() == [2, 2, 2, 0]
    assert m.source_accepted[1].tolist() == [0, 1, 3, 0] and m.source_checked[1].tolist() == [0, 2, 3, 0]
    m.reset_rows(torch.tensor([False, False, True, False]))
    assert m.source_checked[1].tolist() == [0, 2, 0, 0]


def test_tree_at_the_top_level_greedy_fuzz(models):
    """Cascade(tree=...): the target verifies the cascade's draft as the trunk of a tree with the
    reviews' other likely tokens beside it; greedy output stays plain greedy decoding for random
    K, lenience, tree shapes, batch sizes and prompts, on both verification backends."""
    target, d1, d2 = models
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    engines = {b: Engine(target, drafters=[d1, d2, "mag"], max_batch_size=4, max_seq_len=96, verify_backend=b)
               for b in ("triton", "torch")}
    for trial in range(5):
        k = random_k_matrix(rng, 3, last_is_mag=True)
        tree = tuple(rng.randint(1, 3) for _ in range(rng.randint(1, 4)))
        strategy = Cascade(k_matrix=k, lenience=rng.choice([1, 2, 5]), mag_tokens=rng.randint(1, 4), tree=tree)
        backend = "triton" if trial < 2 else "torch"  # interpreted: small trials (seconds per call)
        prompts = random_prompts(rng.randint(1, 2 if backend == "triton" else 4), lo=1, hi=16,
                                 seed=rng.randrange(10**6))
        out = assert_greedy_equals_autoregressive(engines[backend], prompts, strategy,
                                                  max_new_tokens=8 if backend == "triton" else 16)
        assert out[0].metrics.mean_accepted_tokens >= 1, f"seed {seed} trial {trial}"


def test_tree_siblings_are_used_when_the_trunk_misses(models):
    """With a drafter that often disagrees, the target takes a sibling at depth 1 in some steps:
    the tree accepts more tokens per target forward than the same cascade as a chain."""
    target, _, d2 = models
    engine = Engine(target, drafters=[d2, "mag"], max_batch_size=4, max_seq_len=96, verify_backend="torch")
    prompts = random_prompts(4, lo=3, hi=12, seed=5)
    params = SamplingParams(max_new_tokens=40)
    chain = engine.generate(prompts, params, strategy=Cascade(k_matrix=[[3, 0], [0, 2]]))
    tree = engine.generate(prompts, params, strategy=Cascade(k_matrix=[[3, 0], [0, 2]], tree=(4, 3)))
    assert [r.token_ids for r in tree] == [r.token_ids for r in chain]
    assert sum(r.metrics.target_forwards for r in tree) < sum(r.metrics.target_forwards for r in chain)


@pytest.mark.parametrize("temperature,lenience", [(1.0, 1.0), (0.7, 2.0)])
def test_tree_at_the_top_level_samples_follow_the_target(models, temperature, lenience):
    target, d1, _ = models
    engine = Engine(target, drafters=[d1, "mag"], max_batch_size=2000, max_seq_len=32, verify_backend="torch")
    strategy = Cascade(k_matrix=[[2, 1], [0, 2]], lenience=lenience, mag_tokens=2, tree=(3, 2))
    assert_samples_follow_target(engine, target, [7, 3, 7, 3, 7], strategy, temperature=temperature, draws=2000)


def test_bad_tree_is_refused(models):
    target, d1, _ = models
    for bad in ((0,), (2, "3"), 4, (True,)):
        with pytest.raises(ValueError, match="Cascade.tree"):
            Cascade(tree=bad)
    engine = Engine(target, drafters=["mag"], max_batch_size=1, max_seq_len=32)
    with pytest.raises(ValueError, match="needs a neural drafter"):
        engine.generate([[1, 2]], strategy=Cascade(k_matrix=[[4]], tree=(2,)))
    assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].token_ids  # still usable


@pytest.mark.parametrize("drafters,strategy", [
    (("mag",), Cascade(k_matrix=[[4]], mag_tokens=2)),  # two MaG calls fill the draft to its last slot
    (("d1", "mag"), Cascade(k_matrix=[[1, 4], [0, 2]], lenience=2, mag_tokens=2)),
    (("d1", "mag"), Cascade(k_matrix=[[1, 4], [0, 2]], lenience=2, mag_tokens=2, tree=(2, 2))),
])
def test_every_drafted_token_reaches_the_target_with_its_proposal(models, drafters, strategy):
    """Every verification (the target's and the reviews) gets, for every draft slot a row fills, the
    distribution that slot's token was drawn from (a probability vector giving the token mass;
    one-hot for MaG's tokens), also for a draft that fills the plan's last slot. A lost proposal (zeros) would make the target
    accept that token whatever its probability: not lossless. Checked directly, since a
    distribution test over the first two tokens never sees the last slot of a wide draft
    (test_every_strategy checks every strategy the same way)."""
    target, d1, _ = models
    engine = Engine(target, drafters=[d1 if d == "d1" else d for d in drafters], max_batch_size=16, max_seq_len=48,
                    verify_backend="torch")
    full = check_proposals(engine)
    prompts = [[5, 6, 7, 8] * 3] * 16
    params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=24) for s in range(16)]
    engine.generate(prompts, params, strategy=strategy)
    assert sum(full) > 0, "no draft filled the plan's last slot: the check saw nothing"


def test_a_match_exactly_direct_match_long_goes_direct(models):
    """direct_match is inclusive: a row whose MaG match is exactly that long goes direct, one
    token shorter does not (the prompt ends on a 4-token repeat: a match of 4)."""
    target, d1, _ = models
    engine = Engine(target, drafters=[d1, "mag"], max_batch_size=2, max_seq_len=48)
    scheduler = engine.scheduler(Autoregressive(), rows=2)
    scheduler.add([5, 6, 7, 8, 9, 10, 5, 6, 7, 8])
    scheduler.add([1, 2, 3, 4])
    scheduler._admit()
    state = scheduler.state
    scheduler.close()
    for direct_match, expected in ((4, [True, False]), (5, [False, False])):
        decoder = Cascade(k_matrix=((2, 4), (0, 4)), direct_match=direct_match,
                          direct_tokens=6).decoder(engine._decoder_models())
        direct, _ = decoder._direct(state)
        assert direct.tolist() == expected, direct_match
