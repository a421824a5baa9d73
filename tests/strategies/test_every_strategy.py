"""Claims every strategy must keep, checked on every strategy alike (one parametrisation):

* a seeded request gives the same tokens alone, inside batches of other requests (ragged
  prompts, mixed greedy / sampled / top-k / top-p rows, other lengths), and when run again;
* stop tokens end a request at their first occurrence, also inside an accepted draft, greedy
  and sampled; per-row `max_new_tokens` and `max_seq_len` end it with finish reason `length`;
* every drafted token reaches its verification with the distribution it was drawn from;
* acceptance floor: with drafters identical to the target, every draft the target is offered
  is accepted (a cache that keeps a rejected token, or loses one, makes the drafter see
  another context and fails this without CSD_DEBUG).

The PyTorch verification backend keeps these fast (tests/kernels prove that the Triton
kernels draw the same tokens).
"""
import copy

import pytest
import torch

import csd_engine.models.llama
from csd_engine import Autoregressive, Cascade, Engine, Pearl, SamplingParams, Speculative, Staged, ops
from csd_engine.models.loader import load_runner
from csd_engine.models.runner import Runner
from tests.strategies.common import check_proposals
from tests.tiny_models import VOCAB, perturbed, random_prompts, tiny_llama

MAX_SEQ_LEN = 64

# name -> (drafters, strategy); drafters name the fixture models ("d1", "d2") or "mag".
STRATEGIES = {
    "autoregressive": ((), Autoregressive()),
    "speculative-model": (("d1",), Speculative(k=3)),
    "speculative-mag": (("mag",), Speculative(k=4)),
    # priced to draft (the fixture drafters are as large as the target); the drafter's top probability
    # is 0.10-0.27 on most positions here (10th-90th percentile): 0.15 stops drafts often, not always
    "speculative-auto": (("d1",), Speculative.auto(max_tokens=3, model_cost=0.1, min_confidence=0.15)),
    "cascade2-l1": (("d1", "mag"), Cascade(k_matrix=[[2, 1], [0, 2]], lenience=1, mag_tokens=2)),
    "cascade2-l2": (("d1", "mag"), Cascade(k_matrix=[[2, 1], [0, 2]], lenience=2, mag_tokens=2)),
    "cascade3-l1": (("d1", "d2", "mag"), Cascade(k_matrix=[[2, 1, 1], [0, 2, 1], [0, 0, 2]], lenience=1,
                                                 mag_tokens=2)),
    "cascade3-l2": (("d1", "d2", "mag"), Cascade(k_matrix=[[2, 1, 1], [0, 2, 1], [0, 0, 2]], lenience=2,
                                                 mag_tokens=2)),
    "cascade-tree": (("d1", "mag"), Cascade(k_matrix=[[2, 1], [0, 2]], lenience=2, mag_tokens=2, tree=(3, 2))),
    # rows whose MaG match is >= 3 tokens send up to 6 MaG tokens (more than K's plan) straight to the target;
    # K's top-level MaG entry takes 3 calls of 1 token, a direct row takes one call
    "cascade-direct": (("d1", "mag"), Cascade(k_matrix=[[2, 3], [0, 2]], lenience=2, mag_tokens=1, direct_match=3,
                                              direct_tokens=6)),
    "cascade-auto": (("d1", "mag"), Cascade.auto()),
    "cascade-auto-tree": (("d1", "mag"), Cascade.auto(tree=(3, 2))),
    "staged": (("d1", "mag"), Staged(branching=(2, 2, 1), mag_tokens=2)),
    "pearl": (("d1",), Pearl(gamma=3, overlap=True)),
}


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(seed=41)
    return {"target": target, "d1": perturbed(target, noise=0.2, seed=42), "d2": perturbed(target, noise=0.5, seed=43)}


_engines = {}


def engine_for(models, name: str, batch: int = 8, tokenizer=None) -> Engine:
    drafters = STRATEGIES[name][0]
    key = (drafters, batch, type(tokenizer))
    if key not in _engines:
        _engines[key] = Engine(models["target"], drafters=[models[d] if d != "mag" else "mag" for d in drafters],
                               max_batch_size=batch, max_seq_len=MAX_SEQ_LEN, verify_backend="torch",
                               tokenizer=tokenizer)
    return _engines[key]


def repetitive_prompt(seed: int, length: int = 12) -> list[int]:
    """A prompt that repeats itself, so MaG finds matches and drafts get accepted and rejected."""
    head = random_prompts(1, lo=3, hi=3, seed=seed)[0]
    return (head * length)[:length]


@pytest.mark.parametrize("name", STRATEGIES)
def test_seeded_request_same_alone_in_batches_and_again(models, name):
    engine = engine_for(models, name)
    strategy = STRATEGIES[name][1]
    mine = SamplingParams(temperature=1.0, seed=1234, max_new_tokens=20)
    prompt = repetitive_prompt(7)
    alone = engine.generate([prompt], mine, strategy=strategy)[0].token_ids
    others = random_prompts(5, lo=1, hi=15, seed=8)
    others[1] = repetitive_prompt(9, 14)
    other_params = [SamplingParams(max_new_tokens=7),  # greedy, ends early
                    SamplingParams(temperature=0.7, top_k=5, seed=1, max_new_tokens=25),
                    SamplingParams(temperature=1.3, top_p=0.8, seed=2, max_new_tokens=12),
                    SamplingParams(temperature=1.0, seed=1234, max_new_tokens=3),  # same seed, other prompt
                    SamplingParams(max_new_tokens=30)]
    batch_a = engine.generate(others[:2] + [prompt] + others[2:], other_params[:2] + [mine] + other_params[2:],
                              strategy=strategy)
    batch_b = engine.generate([prompt, others[4]], [mine, other_params[4]], strategy=strategy)
    again = engine.generate([prompt], mine, strategy=strategy)[0].token_ids
    assert len(alone) == 20
    assert batch_a[2].token_ids == alone, f"{name}: the request changed when others shared its batch"
    assert batch_b[0].token_ids == alone, f"{name}: the request changed when others shared its batch"
    assert again == alone, f"{name}: the same seeded request gave other tokens the second time"
    greedy_alone = engine.generate([others[0]], other_params[0], strategy=strategy)[0].token_ids
    assert batch_a[0].token_ids == greedy_alone
    # Cascade.auto(tree=...): this request's rows want no tree where the short neighbour's do, so
    # beside it the step is verified as a tree, whose walk must draw what its chain alone draws
    longer, seeded = repetitive_prompt(5, 20), SamplingParams(temperature=1.0, seed=1, max_new_tokens=12)
    alone = engine.generate([longer], seeded, strategy=strategy)[0].token_ids
    beside = engine.generate([longer, repetitive_prompt(9, 4)], [seeded, SamplingParams(max_new_tokens=28)],
                             strategy=strategy)[0].token_ids
    assert beside == alone, f"{name}: the request changed beside a greedy neighbour"


@pytest.mark.parametrize("name", STRATEGIES)
def test_the_plan_a_step_leaves_is_the_plan_of_the_state_it_left(models, name):
    """A step computes the next step's plan (Decoder.step_and_plan) before the host read that
    updates max_committed, and the next step reads its per-row values on the device: it must
    be the plan of the state the read leaves, computed afresh. (Bounded by the stale
    max_committed, MaG's search missed the last step's tokens: other direct rows, budgets and
    widths than the step's own, for repetitive text.)"""
    engine = engine_for(models, name, batch=3)
    checked = 0
    with engine.scheduler(STRATEGIES[name][1], rows=3) as scheduler:
        for prompt in random_prompts(3, lo=3, hi=10, seed=2):  # the models' output repeats itself here
            scheduler.add(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
        while scheduler.has_unfinished():
            scheduler.step()
            if scheduler.plan is None or not scheduler.has_unfinished():
                continue
            fresh = scheduler.decoder.plan(scheduler.state).tolist()
            live = scheduler._live()
            assert scheduler.plan == [row for row, on in zip(fresh, live) if on], f"{name}: step {checked}"
            kept = scheduler.state.plan.t().tolist()  # what the next step reads on the device
            assert [row for row, on in zip(kept, live) if on] == scheduler.plan
            checked += 1
    assert checked > 5 or scheduler.decoder.plan(scheduler.state) is None


def _free_run(engine, strategy, prompt, params, n):
    return engine.generate([prompt], SamplingParams(temperature=params.temperature, seed=params.seed,
                                                    max_new_tokens=n), strategy=strategy)[0]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", STRATEGIES)
def test_stop_tokens_end_the_request_at_their_first_occurrence(models, name, temperature):
    """One row per candidate stop token (every token that first appears at position >= 1 of
    the free output), all in one batch: each row stops at its own token. With more tokens
    than target forwards, some step committed several tokens at once, so some stop token
    sits inside an accepted draft."""
    engine = engine_for(models, name)
    strategy = STRATEGIES[name][1]
    prompt = repetitive_prompt(11)
    base = SamplingParams(temperature=temperature, seed=77, max_new_tokens=24)
    free = _free_run(engine, strategy, prompt, base, 24)
    ids = free.token_ids
    firsts = [j for j in range(1, len(ids)) if ids[j] not in ids[:j]][:engine.max_batch_size]
    assert firsts, "the free output repeats one token: no stop token to test"
    params = [SamplingParams(temperature=temperature, seed=77, max_new_tokens=24, stop_token_ids=[ids[j]])
              for j in firsts]
    results = engine.generate([prompt] * len(firsts), params, strategy=strategy)
    for j, r in zip(firsts, results):
        assert r.token_ids == ids[:j + 1], f"{name}: stop token {ids[j]} (first at {j}) did not end the request there"
        assert r.finish_reason == "stop"
    # (not those whose MAT is ~1 here; Cascade.auto() learns that drafting does not pay on it)
    if name not in ("autoregressive", "speculative-mag", "pearl", "cascade-auto"):
        assert free.metrics.target_forwards < len(ids), "no step committed more than one token"


@pytest.mark.parametrize("name", STRATEGIES)
def test_per_row_max_new_tokens_and_max_seq_len(models, name):
    engine = engine_for(models, name)
    strategy = STRATEGIES[name][1]
    prompt = repetitive_prompt(13)
    base = SamplingParams(temperature=1.0, seed=5, max_new_tokens=16)
    ids = _free_run(engine, strategy, prompt, base, 16).token_ids
    limits = [1, 2, 3, 5, 8, 13, 16]
    results = engine.generate([prompt] * len(limits),
                              [SamplingParams(temperature=1.0, seed=5, max_new_tokens=n) for n in limits],
                              strategy=strategy)
    for n, r in zip(limits, results):
        assert r.token_ids == ids[:n] and r.finish_reason == "length", f"{name}: max_new_tokens={n}"
    # max_seq_len bounds prompt + output, also when a step would commit past it.
    long_prompt = (prompt * 8)[:MAX_SEQ_LEN - 5]
    long = engine.generate([long_prompt, prompt], [SamplingParams(temperature=1.0, seed=5, max_new_tokens=40)] * 2,
                           strategy=strategy)
    assert len(long[0].token_ids) == 5 and long[0].finish_reason == "length"
    assert len(long[1].token_ids) == 40 and long[1].finish_reason == "length"


# Acceptance floor: drafters that are the target itself. Strategies whose target-level drafts
# all come from neural levels reviewed at lenience 1 (MaG drafts at the top, or lenience, would
# be accepted at their own rates).
FLOOR = {
    "speculative": Speculative(k=4),
    "speculative-auto": Speculative.auto(max_tokens=4, model_cost=0.1),
    "cascade": Cascade(k_matrix=[[3, 0], [0, 2]], lenience=1, mag_tokens=2),
    "cascade3": Cascade(k_matrix=[[2, 2, 0], [0, 2, 1], [0, 0, 2]], lenience=1, mag_tokens=2),
    "pearl": Pearl(gamma=3, overlap=True),
}


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", FLOOR)
def test_drafters_identical_to_the_target_are_always_accepted(models, name, temperature):
    target = models["target"]
    drafters = {"speculative": [target], "speculative-auto": [target], "cascade": [target, "mag"], "cascade3": [target, target, "mag"],
                "pearl": [target]}[name]
    engine = Engine(target, drafters=drafters, max_batch_size=4, max_seq_len=MAX_SEQ_LEN, verify_backend="torch")
    prompts = random_prompts(3, lo=2, hi=12, seed=17) + [repetitive_prompt(19)]
    params = [SamplingParams(temperature=temperature, seed=100 + i, max_new_tokens=30) for i in range(4)]
    results = engine.generate(prompts, params, strategy=FLOOR[name])
    for r in results:
        m = r.metrics
        assert m.drafted > 0
        assert m.accepted == m.drafted, f"{name}: the target rejected {m.drafted - m.accepted} of {m.drafted} " \
                                        "drafts of a drafter identical to it"


class WrongEveryThird(Runner):
    """A drafter with a known greedy acceptance: the target's own model, except that its top
    token is forbidden wherever the predicted token's position is a multiple of 3. With a
    correct cache its draft at position t is the target's greedy token iff t % 3 != 0."""

    def __init__(self, model):
        self.inner, _ = load_runner(copy.deepcopy(model), "cpu", torch.float32)
        self.vocab_size, self.num_params, self.device = self.inner.vocab_size, self.inner.num_params, self.inner.device

    @property
    def cache(self):
        return self.inner.cache

    def allocate(self, batch: int, capacity: int) -> None:
        self.inner.allocate(batch, capacity)

    def use_rows(self, batch: int) -> None:
        self.inner.use_rows(batch)

    def prefill(self, rows, ids) -> None:
        self.inner.prefill(rows, ids)

    def forward(self, batch):
        logits = self.inner(batch)
        if logits is None:  # a prefill
            return None
        wrong = ((batch.positions + 1) % 3 == 0)[..., None]
        top = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).bool()
        return logits.masked_fill(wrong & top, -1e9)  # finite: the engine refuses NaN / inf logits


@pytest.mark.parametrize("name,strategy", [("speculative", Speculative(k=4)),
                                           ("cascade", Cascade(k_matrix=[[3, 0], [0, 2]], mag_tokens=2, direct_match=0))])
def test_acceptance_matches_a_drafter_of_known_rate(models, monkeypatch, name, strategy):
    """A cache that keeps a rejected token (or drops an accepted one) shows the drafter another
    context, so it disagrees with the target where it should not: acceptance falls below the
    exact count (checked with CSD_DEBUG's bound checks off)."""
    monkeypatch.setattr(csd_engine.models.llama, "DEBUG_CHECKS", False)
    target = models["target"]
    drafter = WrongEveryThird(target)
    engine = Engine(target, drafters=[drafter] if name == "speculative" else [drafter, "mag"], max_batch_size=4,
                    max_seq_len=MAX_SEQ_LEN, verify_backend="torch")
    prompts = random_prompts(4, lo=2, hi=12, seed=23)
    for prompt, r in zip(prompts, engine.generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True),
                                                  strategy=strategy)):
        # the last step may emit past max_new_tokens: count the steps the output needed
        steps_accepted = r.metrics.accepted
        c, emitted, expected = len(prompt) - 1, 0, 0
        while emitted < len(r.token_ids):
            a = (3 - (c + 1) % 3) % 3
            expected, emitted, c = expected + a, emitted + a + 1, c + a + 1
        assert steps_accepted == expected, f"{name}: {steps_accepted} drafts accepted, a correct cache gives {expected}"


@pytest.mark.parametrize("name", [n for n in STRATEGIES if n != "autoregressive"])
def test_every_drafted_token_is_verified_with_its_proposal(models, name):
    """Sampled rows with top-k / top-p and repetitive prompts (long drafts, MaG matches): each
    verification call asserts that every slot a row drafted has a proposal giving its token mass
    (tests/strategies/common.py check_proposals)."""
    drafters, strategy = STRATEGIES[name]
    engine = Engine(models["target"], drafters=[models[d] if d != "mag" else "mag" for d in drafters],
                    max_batch_size=6, max_seq_len=MAX_SEQ_LEN, verify_backend="torch")
    calls = check_proposals(engine)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s, max_new_tokens=24)
              for s, (t, k, p) in enumerate([(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 0.9)] * 2)]
    engine.generate([repetitive_prompt(s) for s in range(6)], params, strategy=strategy)
    deterministic = name in ("speculative-mag", "staged")  # MaG's tokens, the tree's top-b children: q None
    assert calls or deterministic, "no verification with proposals ran"


@pytest.mark.skipif(not (ops.cpu_layer_ops_run() and ops.bf16_kernel_pays()),
                    reason="needs csd_engine's CPU layer ops and bf16 kernel (x86 with AVX2)")
@pytest.mark.parametrize("name", [n for n in STRATEGIES if n != "autoregressive"])
def test_bf16_greedy_output_is_plain_decodings_exactly(models, name):
    """A bf16 model on the CPU, default engine (not batch_invariant), batch 1: every strategy's
    greedy output is plain decoding's token for token. Random bf16 weights put near-ties
    everywhere, so this holds only because a token's logits depend neither on the forward's width
    nor on its place in a tree there (csd_engine's matmul kernel computes each row alone,
    ops.decode_attention each token as if decoded alone after the same keys; with SDPA for the
    wide forwards, every one of these strategies' outputs differed somewhere)."""
    drafters, strategy = STRATEGIES[name]
    engine = Engine(models["target"], drafters=[models[d] if d != "mag" else "mag" for d in drafters],
                    max_batch_size=1, max_seq_len=MAX_SEQ_LEN, verify_backend="torch", dtype=torch.bfloat16)
    prompts = [repetitive_prompt(s) for s in range(3)] + random_prompts(3, lo=2, hi=12, seed=29)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    plain = [engine.generate([p], params, strategy=Autoregressive())[0] for p in prompts]
    ours = [engine.generate([p], params, strategy=strategy)[0] for p in prompts]
    for i, (a, b) in enumerate(zip(plain, ours)):
        assert b.token_ids == a.token_ids, f"{name}, prompt {i}: first difference at token " \
            f"{next(j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)}"
    if name not in ("speculative-mag", "pearl"):
        assert sum(r.metrics.accepted for r in ours) > 0, "no draft accepted: nothing was verified wide"


@pytest.mark.parametrize("name", [n for n in STRATEGIES if n != "autoregressive"])
def test_no_random_counter_is_drawn_twice(models, name):
    """Every check (target verification, draft draws, cascade reviews, trees) draws its random
    numbers at counters offset + j of its stream's seed, j up to the position it emits at: over a
    whole sampled generation no (seed, counter) is used twice, or a token would be correlated
    with an earlier one (a step that moved its offset too little reused its bonus's Gumbel noise
    for the next step's first accept). The distribution tests look at the first two tokens
    only, and no exactness test can see a reused counter."""
    engine = engine_for(models, name)
    verifier = engine.verifier
    used = []

    def recording(check):
        def run(logits, *args, **kwargs):
            result = check(logits, *args, **kwargs)
            for b in range(logits.shape[0]):
                if kwargs["temperature"][b] > 0:
                    seed, offset = int(kwargs["seed"][b]), int(kwargs["offset"][b])
                    used.extend((seed, offset + j) for j in range(int(result.num_accepted[b]) + 1))
            return result
        return run

    verifier.chain, verifier.tree = recording(verifier.chain), recording(verifier.tree)
    try:
        for seed in range(3):  # one request at a time: no idle row replays stale counters
            used.clear()
            engine.generate([repetitive_prompt(seed)], SamplingParams(temperature=1.0, seed=seed, max_new_tokens=30,
                                                                      ignore_eos=True), strategy=STRATEGIES[name][1])
            assert used and len(used) == len(set(used)), f"{name}: a random counter was drawn twice"
    finally:
        del verifier.chain, verifier.tree  # the class's methods again


@pytest.fixture(scope="module")
def poisoned():
    """A target whose embedding of token 50 is NaN and that never emits it (its head row is 0,
    below the argmax here), and a drafter (d1's place) that proposes 50 wherever its first
    hidden unit is positive (51 elsewhere): plain decoding never feeds 50 to the target."""
    target, clean = tiny_llama(seed=41), tiny_llama(seed=41)
    lover = perturbed(clean, noise=0.2, seed=42)
    with torch.no_grad():
        target.lm_head.weight[50] = 0
        target.model.embed_tokens.weight[50] = float("nan")
        lover.model.norm.weight.zero_()
        lover.model.norm.weight[0] = 1
        lover.lm_head.weight.zero_()
        lover.lm_head.weight[50, 0], lover.lm_head.weight[51, 0] = 100.0, -100.0
    return {"target": target, "d1": lover, "d2": perturbed(clean, noise=0.5, seed=43)}


@pytest.mark.parametrize("name", STRATEGIES)
def test_non_finite_logits_after_a_rejected_draft_fail_nothing(poisoned, name):
    """The target's logits past a rejected draft token (or off a tree's accepted path, or at a
    padding slot) are not plain decoding's: non-finite ones there fail no request. Each request
    runs to its length with plain decoding's tokens, though the target is fed token 50 (whose
    embedding is NaN) in every step that drafts it. On the CPU extension's attention, which
    computes each token alone: SDPA's and Triton's carry a NaN value row to the other positions
    of the forward (0 x NaN), which fails the request as it did before (README)."""
    drafters, strategy = STRATEGIES[name]
    engine = Engine(poisoned["target"], drafters=[poisoned[d] if d != "mag" else "mag" for d in drafters],
                    max_batch_size=3, max_seq_len=40, verify_backend="torch")
    prompts = [[3] * 10, [5] * 30, [7, 8, 9]]
    params = SamplingParams(max_new_tokens=12)
    plain = engine.generate(prompts, params, strategy=Autoregressive())
    assert all(50 not in r.token_ids for r in plain)
    with engine.scheduler(strategy) as scheduler:
        ids = [scheduler.add(p, params) for p in prompts]
        done = {}
        while scheduler.has_unfinished():
            done.update((out.request_id, out) for out in scheduler.step() if out.finished)
    for i, r in zip(ids, plain):
        assert (done[i].finish_reason, done[i].result.token_ids) == ("length", r.token_ids), done[i].error


class PaddedVocabularyTokenizer:
    """A tokenizer of VOCAB tokens for a target with padding rows past them."""

    eos_token_id = None

    def __len__(self):
        return VOCAB

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(t) for t in ids)


def shrunk(model, vocab: int):
    """`model` with its embedding and head cut to the first `vocab` rows (as Qwen2.5 0.5B's 151936
    against 7B's 152064: one tokenizer, the larger model's extra rows padding)."""
    small = tiny_llama(vocab=vocab)
    small.load_state_dict({k: v[:vocab] if k in ("model.embed_tokens.weight", "lm_head.weight") else v
                           for k, v in model.state_dict().items()})
    return small


@pytest.mark.parametrize("name", [n for n in STRATEGIES if STRATEGIES[n][0] != ("mag",)])
def test_a_drafter_without_the_targets_padding_rows_is_lossless(name):
    """A drafter whose vocabulary stops where the target's padding rows begin drafts for it: its
    logits get -inf rows there, and padding ids the target emits (its random rows here do) reach
    the drafter as its last row. Greedy output is plain decoding's; a prompt holds a padding id."""
    target = tiny_llama(seed=41, vocab=VOCAB + 24)
    models = {"d1": perturbed(shrunk(target, VOCAB), noise=0.2, seed=42),
              "d2": perturbed(shrunk(target, VOCAB), noise=0.5, seed=43)}
    drafters, strategy = STRATEGIES[name]
    engine = Engine(target, drafters=[models[d] if d != "mag" else "mag" for d in drafters], max_batch_size=3,
                    max_seq_len=48, verify_backend="torch", tokenizer=PaddedVocabularyTokenizer())
    assert all(d.vocab_pad == 24 for d in engine.drafters if d != "mag" and hasattr(d, "vocab_pad"))
    prompts = [[3, 4, 5, 3, 4, 5], [VOCAB + 3, 7, 8], random_prompts(1, seed=9)[0]]
    params = SamplingParams(max_new_tokens=16)
    plain = [r.token_ids for r in engine.generate(prompts, params, strategy=Autoregressive())]
    assert any(t >= VOCAB for r in plain for t in r), "the target never emitted a padding id: nothing clamped"
    assert [r.token_ids for r in engine.generate(prompts, params, strategy=strategy)] == plain


def test_a_drafter_vocabulary_that_is_not_the_targets_is_refused_by_what_differs():
    target, small = tiny_llama(vocab=VOCAB + 24), tiny_llama(vocab=VOCAB)
    for drafter, tokenizer, words in [
            (tiny_llama(vocab=VOCAB + 30), PaddedVocabularyTokenizer(), r"\(126 tokens\) differs from the target's \(120\)"),
            (small, None, "no tokenizer tells"),
            (tiny_llama(vocab=VOCAB - 1), PaddedVocabularyTokenizer(), f"the tokenizer has {VOCAB} tokens")]:
        with pytest.raises(ValueError, match=words):
            Engine(target, drafters=[drafter], max_batch_size=1, max_seq_len=32, tokenizer=tokenizer)


@pytest.mark.parametrize("name", ["speculative-model", "cascade2-l2"])
def test_sampling_with_a_drafter_without_the_targets_padding_rows_follows_the_target(name):
    """Sampled drafts from the shorter vocabulary (zero mass on the padding rows) keep the target's
    distribution, padding rows included (the target's random rows hold real mass here)."""
    from tests.strategies.common import assert_samples_follow_target
    target = tiny_llama(seed=41, vocab=VOCAB + 24)
    drafters, strategy = STRATEGIES[name]
    models = {"d1": perturbed(shrunk(target, VOCAB), noise=0.2, seed=42)}
    engine = Engine(target, drafters=[models[d] if d != "mag" else "mag" for d in drafters], max_batch_size=256,
                    max_seq_len=16, verify_backend="torch", tokenizer=PaddedVocabularyTokenizer())
    assert_samples_follow_target(engine, target, [3, 4, 5], strategy, draws=4000)


def test_a_padded_drafter_behind_a_graphed_runner_and_runners_passed_again():
    """The outermost runner pads (a GraphedRunner takes the wrapped runner's vocab_pad: its
    non-finite check reads the model's own rows, not the -inf ones); a runner passed to a later
    engine gets that engine's padding, none included; a drafter listed twice is refused (its
    two roles would share one cache)."""
    from csd_engine.models.graphs import GraphedRunner
    target = tiny_llama(seed=41, vocab=VOCAB + 24)
    drafter, _ = load_runner(perturbed(shrunk(target, VOCAB), noise=0.2, seed=42), "cpu", torch.float32)
    drafter.vocab_pad = 24
    graphed = GraphedRunner(drafter)
    assert (graphed.vocab_pad, drafter.vocab_pad) == (24, 0)
    engine = Engine(target, drafters=[graphed], max_batch_size=2, max_seq_len=48, tokenizer=PaddedVocabularyTokenizer())
    prompts, params = [[3, 4, 5, 3, 4, 5], [VOCAB + 3, 7, 8]], SamplingParams(max_new_tokens=12)
    assert [r.token_ids for r in engine.generate(prompts, params, strategy=Speculative(k=3))] == \
        [r.token_ids for r in engine.generate(prompts, params, strategy=Autoregressive())]
    small = tiny_llama(seed=41, vocab=VOCAB)
    again = Engine(small, drafters=[graphed], max_batch_size=1, max_seq_len=32)
    assert graphed.vocab_pad == 0
    sampled = SamplingParams(max_new_tokens=6, temperature=1.0, seed=1)
    assert len(again.generate([[1, 2, 3]], sampled, strategy=Speculative(k=3))[0].token_ids) == 6
    assert Engine(graphed, max_batch_size=1, max_seq_len=32).target.vocab_pad == 0
    # engines over one padded drafter, plain and wrapped, take turns: each sets its own padding again
    plain_engine = Engine(target, drafters=[drafter], max_batch_size=2, max_seq_len=48,
                          tokenizer=PaddedVocabularyTokenizer())
    short = SamplingParams(max_new_tokens=4)  # the graphed drafter's attention runs in Triton's interpreter
    for turn in (plain_engine, engine, plain_engine, engine):
        assert [r.token_ids for r in turn.generate(prompts, short, strategy=Speculative(k=3))] == \
            [r.token_ids for r in turn.generate(prompts, short, strategy=Autoregressive())], turn
    a, b = load_runner(small, "cpu", torch.float32)[0], load_runner(perturbed(small, 0.1), "cpu", torch.float32)[0]
    with pytest.raises(ValueError, match="drafter 1 is the same LlamaRunner object as drafter 0"):
        Engine(small, drafters=[a, a, b], max_batch_size=1, max_seq_len=32)  # two roles, one cache
