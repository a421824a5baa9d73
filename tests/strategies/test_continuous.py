"""Continuous batching (csd_engine.scheduler), every strategy alike:

* requests arriving at different steps, joining rows that others left, each give the tokens
  they give alone (greedy: plain decoding; seeded sampling: the same draws), in float32 on the
  CPU;
* abort frees the row for the next request; idle rows never grow a cache; generate and stream
  take more prompts than rows, the others waiting for free rows;
* streamed increments concatenate to `generate`'s result (tokens, text with split UTF-8
  characters, log-probabilities); stop strings cut the text before the stop, also inside a
  multi-token step; log-probabilities are those of the target's processed distribution;
* clear refusals: a second user of a busy engine, a full queue; a request whose model output
  goes non-finite fails alone.
"""
import gc
import math
import re

import pytest
import torch

from csd_engine import Autoregressive, Engine, SamplingParams
from csd_engine.scheduler import QueueFull
from tests.strategies.common import (NON_FINITE_PARAMS, assert_a_non_finite_request_fails_alone, broken_and_plain,
                                     processed_probs)
from tests.strategies import test_every_strategy as every_strategy
from tests.strategies.test_every_strategy import STRATEGIES, models, repetitive_prompt  # noqa: F401 (fixture)
from tests.tiny_models import VOCAB, random_prompts, tiny_llama


class ByteTokenizer:
    """A byte-level tokenizer over the tiny vocabulary: some tokens are halves of a two-byte
    UTF-8 character, so a character can arrive split across steps (decoded as U+FFFD first)."""

    eos_token_id = None

    def __init__(self):
        self.pieces = [bytes([0xC3]) if t % 7 == 0 else bytes([0xA9]) if t % 7 == 1 else
                       (" " if t % 5 == 0 else chr(ord("a") + t % 26)).encode() for t in range(VOCAB)]

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.pieces[t] for t in ids).decode("utf-8", errors="replace")


def engine_for(models, name: str, rows: int = 3) -> Engine:
    """test_every_strategy's engines (same models), with the byte tokenizer and `rows` rows."""
    return every_strategy.engine_for(models, name, batch=rows, tokenizer=ByteTokenizer())


def alone(engine, strategy, prompt, params):
    return engine.generate([prompt], params, strategy=strategy)[0]


# (prompt, params, step at which it arrives)
ARRIVALS = [
    (repetitive_prompt(7), SamplingParams(temperature=1.0, seed=1234, max_new_tokens=20), 0),
    (random_prompts(1, lo=2, hi=9, seed=1)[0], SamplingParams(max_new_tokens=5), 0),
    (repetitive_prompt(9, 14), SamplingParams(temperature=0.7, top_k=5, seed=1, max_new_tokens=12), 1),
    (random_prompts(1, lo=1, hi=4, seed=2)[0], SamplingParams(max_new_tokens=18), 3),
    (random_prompts(1, lo=5, hi=15, seed=3)[0], SamplingParams(temperature=1.3, top_p=0.8, seed=2,
                                                                max_new_tokens=9), 3),
    (repetitive_prompt(7), SamplingParams(temperature=1.0, seed=1234, max_new_tokens=20), 6),  # the first, again
]


def run_arrivals(scheduler, arrivals, check=None):
    """Feed `arrivals` at their steps; returns {request index: result} and every output seen."""
    results, step, ids = {}, 0, {}
    while len(results) < len(arrivals):
        for i, (prompt, params, at) in enumerate(arrivals):
            if at == step:
                ids[scheduler.add(prompt, params)] = i
        for out in scheduler.step():
            if out.finished:
                results[ids[out.request_id]] = out.result
        if check:
            check(scheduler)
        step += 1
        assert step < 500, "the scheduler does not finish"
    return results


class IdleRowsStayShort:
    """After each step: a free slot's caches hold at most two forwards (its request's entries
    are dropped at the next step; a masked row that kept growing would run past the cache's
    end on a long-running server)."""

    def __call__(self, scheduler):
        bound = 2 * scheduler.decoder.max_tokens_per_forward
        for row, request in enumerate(scheduler.slots):
            if request is None and row not in scheduler.freed:  # freed rows are emptied next step
                lengths = [int(runner.cache.lengths[row]) for runner in scheduler.engine.models()]
                assert max(lengths) <= bound, f"row {row}'s caches grew while idle: {lengths}"


class BufferHoldsTheSequence:
    """After each step: a decoding row's token buffer holds its prompt and output up to its
    pending token, at the committed length (what MaG searches and the strategies extend; a wrong
    entry there would only cost acceptance, so the exactness tests cannot see it)."""

    def __call__(self, scheduler):
        state = scheduler.state
        for row, request in enumerate(scheduler.slots):
            if request is None or not request.ready or request.finish:
                continue
            sequence = list(request.prompt) + request.output
            committed = int(state.committed[row])
            assert committed == len(sequence) - 1 and int(state.pending[row]) == sequence[-1]
            assert state.tokens[row, :committed + 1].tolist() == sequence, f"row {row}'s token buffer"


def check_all(*checks):
    def check(scheduler):
        for c in checks:
            c(scheduler)
    return check


@pytest.mark.parametrize("name", STRATEGIES)
def test_requests_joining_and_leaving_give_their_tokens_alone(models, name):
    engine = engine_for(models, name)
    strategy = STRATEGIES[name][1]
    with engine.scheduler(strategy) as scheduler:
        results = run_arrivals(scheduler, ARRIVALS, check_all(IdleRowsStayShort(), BufferHoldsTheSequence()))
    for i, (prompt, params, _) in enumerate(ARRIVALS):
        expected = alone(engine, strategy, prompt, params)
        assert results[i].token_ids == expected.token_ids, f"{name}: request {i} changed under continuous batching"
        assert results[i].finish_reason == expected.finish_reason
        assert results[i].text == expected.text
        mine, theirs = results[i].metrics, expected.metrics  # its own counters, not its row's history
        assert (mine.accepted, mine.drafted, mine.target_forwards, mine.acceptance_by_level) == \
            (theirs.accepted, theirs.drafted, theirs.target_forwards, theirs.acceptance_by_level)


@pytest.mark.parametrize("name", ["autoregressive", "speculative-mag", "cascade2-l2"])
def test_generate_and_stream_take_more_prompts_than_rows(models, name):
    """generate / stream of 5 prompts on 2 rows: the others wait for free rows, and each gives
    its tokens alone, in order (stream's request ids are the prompts' indexes)."""
    engine = engine_for(models, name, rows=2)
    strategy = STRATEGIES[name][1]
    prompts = [prompt for prompt, _, _ in ARRIVALS[:5]]
    params = [params for _, params, _ in ARRIVALS[:5]]
    results = engine.generate(prompts, params, strategy=strategy)
    streamed = {out.request_id: out.result for out in engine.stream(prompts, params, strategy=strategy)
                if out.finished}
    assert sorted(streamed) == [str(i) for i in range(5)]
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        expected = alone(engine, strategy, prompt, p)
        assert results[i].token_ids == streamed[str(i)].token_ids == expected.token_ids, f"{name}: prompt {i}"
        assert results[i].finish_reason == expected.finish_reason


@pytest.mark.parametrize("name", ["autoregressive", "cascade2-l2", "pearl"])
def test_abort_frees_the_row_for_the_next_request(models, name):
    engine = engine_for(models, name, rows=1)
    strategy = STRATEGIES[name][1]
    first, second = repetitive_prompt(3), repetitive_prompt(4)
    params = SamplingParams(max_new_tokens=30)
    with engine.scheduler(strategy) as scheduler:
        a, b = scheduler.add(first, params), scheduler.add(second, params)
        partial = []
        for _ in range(2):
            partial += [t for out in scheduler.step() for t in out.token_ids if out.request_id == a]
        assert scheduler.abort(a) and len(scheduler.waiting) == 1
        outs = scheduler.step()  # the abort frees the row and `b` joins in the same step
        aborted = next(out for out in outs if out.request_id == a)
        assert aborted.finished and aborted.finish_reason == "abort"
        assert aborted.result.token_ids == partial
        assert not scheduler.waiting and scheduler.slots[0].id == b
        done = {}
        while scheduler.has_unfinished():
            done.update((out.request_id, out.result) for out in scheduler.step() if out.finished)
    assert partial == alone(engine, strategy, first, params).token_ids[:len(partial)]
    assert done[b].token_ids == alone(engine, strategy, second, params).token_ids


def test_abort_of_a_waiting_request_and_unknown_ids(models):
    engine = engine_for(models, "autoregressive", rows=1)
    with engine.scheduler() as scheduler:
        a, b = scheduler.add([1, 2, 3]), scheduler.add([4, 5, 6])
        assert scheduler.abort(b) and not scheduler.abort("nope")
        outs = scheduler.step()
        assert [(o.request_id, o.finish_reason) for o in outs if o.finished] == [(b, "abort")]
        with pytest.raises(ValueError, match="already in use"):
            scheduler.add([1], request_id=a)


@pytest.mark.parametrize("name", ["autoregressive", "speculative-mag", "cascade-tree", "staged", "pearl"])
def test_stream_increments_concatenate_to_the_result(models, name):
    engine = engine_for(models, name)
    strategy = STRATEGIES[name][1]
    prompts = [repetitive_prompt(5), random_prompts(1, seed=9)[0], repetitive_prompt(6, 10)]
    params = [SamplingParams(max_new_tokens=25, logprobs=True),
              SamplingParams(temperature=1.0, seed=3, max_new_tokens=17, logprobs=True),
              SamplingParams(temperature=0.8, top_k=10, seed=4, max_new_tokens=21)]
    expected = engine.generate(prompts, params, strategy=strategy)
    tokens, text, logprobs, results = {}, {}, {}, {}
    saw_split_character = False
    for out in engine.stream(prompts, params, strategy=strategy):
        tokens.setdefault(out.request_id, []).extend(out.token_ids)
        text[out.request_id] = text.get(out.request_id, "") + out.text
        if out.logprobs is not None:
            logprobs.setdefault(out.request_id, []).extend(out.logprobs)
        saw_split_character |= "\ufffd" in engine.tokenizer.decode(tokens[out.request_id])[-1:]
        if out.finished:
            results[out.request_id] = out.result
    for i, e in enumerate(expected):
        r = results[str(i)]
        assert tokens[str(i)] == r.token_ids == e.token_ids
        assert text[str(i)] == r.text == e.text == engine.tokenizer.decode(e.token_ids)
        if params[i].logprobs:
            assert logprobs[str(i)] == r.logprobs and len(r.logprobs) == len(r.token_ids)
            assert r.logprobs == pytest.approx(e.logprobs, abs=1e-5)
        else:
            assert r.logprobs is None and str(i) not in logprobs
    assert saw_split_character, "no step ended inside a two-byte character: the hold-back went untested"


@pytest.mark.parametrize("name", ["autoregressive", "speculative-mag", "cascade2-l2", "cascade-tree", "pearl"])
def test_stop_strings_cut_the_text_before_the_stop(models, name):
    engine = engine_for(models, name)
    strategy = STRATEGIES[name][1]
    prompt = repetitive_prompt(11)
    free = alone(engine, strategy, prompt, SamplingParams(max_new_tokens=30))
    text = free.text
    starts = [i for i in range(3, len(text) - 3) if "\ufffd" not in text[i:i + 3]][:3]
    assert starts, "the free text has no clean 3-character window"
    for start in starts:
        stop = text[start:start + 3]
        cut = text.find(stop)
        r = alone(engine, strategy, prompt, SamplingParams(max_new_tokens=30, stop=[stop, "never there"]))
        assert r.finish_reason == "stop" and r.text == text[:cut]
        n = next(n for n in range(1, len(free.token_ids) + 1) if stop in engine.tokenizer.decode(free.token_ids[:n]))
        assert r.token_ids == free.token_ids[:n], "the tokens must end with the one that completed the stop string"


@pytest.mark.parametrize("name", ["speculative-mag", "cascade2-l2", "cascade-tree", "staged", "pearl"])
def test_streamed_tokens_stop_where_a_stop_string_cuts_them(models, name):
    """A stop string completed by a token that a step emits with half a character after it: the
    text settles only when the character does, and the stop string then cuts the tokens after
    its last one from the result, so they must not have been streamed. Stops end before every
    token of the free output that starts or ends a split character."""
    engine = engine_for(models, name)
    strategy = STRATEGIES[name][1]
    prompt = repetitive_prompt(7)
    free = alone(engine, strategy, prompt, SamplingParams(max_new_tokens=30)).token_ids
    decode = engine.tokenizer.decode
    ends = [n for n in range(2, len(free)) if free[n] % 7 in (0, 1) and "\ufffd" not in decode(free[:n])[-2:]]
    assert len(ends) >= 2, "the free output splits too few characters to test"
    for n in ends:
        params = SamplingParams(max_new_tokens=30, stop=decode(free[:n])[-2:], logprobs=True)
        tokens, logprobs = [], []
        for out in engine.stream([prompt], params, strategy=strategy):
            tokens += out.token_ids
            logprobs += out.logprobs
            result = out.result
        assert result.finish_reason == "stop"
        assert tokens == result.token_ids and logprobs == result.logprobs, f"stop {params.stop!r}"


@pytest.mark.parametrize("name", STRATEGIES)
def test_logprobs_are_the_target_processed_distribution(models, name):
    """Every path (chain, tree, PEARL) reports log p(token | prefix) of the distribution the
    target's check sampled from: raw for greedy rows, tempered and filtered for sampled ones."""
    engine = engine_for(models, name)
    strategy = STRATEGIES[name][1]
    prompt = repetitive_prompt(12)
    settings = [dict(), dict(temperature=0.8, top_k=12, seed=9), dict(temperature=1.2, top_p=0.9, seed=10)]
    results = engine.generate([prompt] * 3, [SamplingParams(max_new_tokens=12, logprobs=True, **s)
                                             for s in settings], strategy=strategy)
    for s, r in zip(settings, results):
        seq = prompt + r.token_ids
        with torch.no_grad():
            logits = models["target"](torch.tensor([seq[:-1]])).logits[0, len(prompt) - 1:]
        probs = processed_probs(logits, s.get("temperature", 1.0), s.get("top_k", 0), s.get("top_p", 1.0))
        expected = probs[torch.arange(len(r.token_ids)), torch.tensor(r.token_ids)].log()
        assert r.logprobs == pytest.approx(expected.tolist(), abs=1e-4), f"{name}: {s}"
        assert all(math.isfinite(x) for x in r.logprobs)


def test_a_busy_engine_refuses_a_second_user_and_recovers(models):
    engine = engine_for(models, "autoregressive", rows=1)
    scheduler = engine.scheduler()
    with pytest.raises(RuntimeError, match="the engine is busy"):
        engine.generate([[1, 2, 3]])
    with pytest.raises(RuntimeError, match="the engine is busy"):
        engine.scheduler()
    scheduler.close()
    with pytest.raises(RuntimeError, match="closed"):
        scheduler.step()
    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))[0].token_ids) == 3
    dropped = engine.scheduler()  # never closed: garbage collection gives the caches back
    dropped.add([1, 2])
    dropped.step()
    del dropped
    gc.collect()
    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))[0].token_ids) == 3


@pytest.mark.parametrize("name", ["autoregressive", "speculative-model", "cascade2-l2"])
@pytest.mark.parametrize("failing_call", [1, 4])  # 1: the admission prefill; 4: a decoding forward
def test_a_scheduler_whose_step_raised_refuses_later_calls(models, name, failing_call, monkeypatch):
    """A step that raises (here the target's forward; Ctrl-C alike) can stop between the device's
    work and its bookkeeping: the scheduler then refuses step and add by name instead of hanging
    on a row that never went live or reading caches out of step; the engine's next scheduler
    gives plain decoding's tokens."""
    engine = engine_for(models, name, rows=2)
    strategy = STRATEGIES[name][1]
    prompts, params = [repetitive_prompt(7), repetitive_prompt(9)], SamplingParams(max_new_tokens=12)
    expected = [r.token_ids for r in engine_for(models, "autoregressive", rows=2).generate(prompts, params)]
    target, calls = engine.target, [0]
    real = type(target).forward

    def forward(self, batch):
        calls[0] += 1
        if calls[0] == failing_call:
            raise RuntimeError("injected failure")
        return real(self, batch)
    monkeypatch.setattr(type(target), "forward", forward)
    s = engine.scheduler(strategy)
    for p in prompts:
        s.add(p, params)
    with pytest.raises(RuntimeError, match="injected failure"):
        while s.has_unfinished():
            s.step()
    for call in (s.step, lambda: s.add([1, 2], params)):
        with pytest.raises(RuntimeError, match=r"a step of this scheduler raised RuntimeError\(injected failure\)"
                                               r".*close it and open a new one"):
            call()
    gc.disable()  # dropped unclosed, it gives the engine back at once: it keeps no traceback (a cycle)
    try:
        del s, call
        assert [r.token_ids for r in engine.generate(prompts, params, strategy=strategy)] == expected
    finally:
        gc.enable()


def test_engines_built_over_one_runner_take_turns(models):
    """Engines sharing runners (the bench scripts' methods, an engine rebuilt with another batch
    size) take turns: each gets its cache shape back when it runs again and decodes as plain
    decoding does; while one generates, the others refuse (busy) instead of decoding over its
    caches, and no engine is built over its runners."""
    prompts, params = random_prompts(3, lo=2, hi=9, seed=4), SamplingParams(max_new_tokens=10)
    plain = [r.token_ids for r in Engine(models["target"], max_batch_size=3, max_seq_len=64).generate(prompts, params)]
    first = Engine(models["target"], drafters=[models["d1"]], max_batch_size=3, max_seq_len=64)
    second = Engine(first.target, drafters=[first.drafters[0]], max_batch_size=1, max_seq_len=32)
    speculative = STRATEGIES["speculative-model"][1]
    for engine, batch in ((first, 3), (second, 1), (first, 3), (second, 1)):
        assert [r.token_ids for r in engine.generate(prompts[:batch], params, strategy=speculative)] == plain[:batch]
    stream = second.stream(prompts[:1], params, strategy=speculative)
    next(stream)  # the second engine holds the runners until the stream ends
    with pytest.raises(RuntimeError, match="the engine is busy.*also among engines built over the same runners"):
        first.generate(prompts, params)
    with pytest.raises(RuntimeError, match="a runner passed to this engine is in use by another Engine's generate"):
        Engine(first.target, max_batch_size=2, max_seq_len=16)
    stream.close()
    assert [r.token_ids for r in first.generate(prompts, params, strategy=speculative)] == plain


def test_a_strategy_without_a_decoder_protocol_is_refused_clearly(models):
    """Not a strategy, or a strategy whose decoder does not subclass Decoder: a TypeError naming
    what is missing, and the engine decodes afterwards."""
    engine = engine_for(models, "autoregressive", rows=1)

    class DuckTyped:
        def decoder(self, models):
            return object()

    with pytest.raises(TypeError, match="unknown strategy 'greedy': pass one of csd_engine.Autoregressive"):
        engine.generate([[1, 2, 3]], strategy="greedy")
    with pytest.raises(TypeError, match="DuckTyped.decoder.. returned a object, not a csd_engine.strategies.base.Decoder"):
        engine.generate([[1, 2, 3]], strategy=DuckTyped())
    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))[0].token_ids) == 3


def test_full_queue_and_bad_requests_are_refused_clearly(models):
    engine = engine_for(models, "autoregressive", rows=1)
    with engine.scheduler(max_waiting=1) as scheduler:
        scheduler.add([1, 2])  # takes the free row at the next step
        scheduler.add([1, 2])  # waits
        with pytest.raises(QueueFull, match="1 requests wait for a free row .max_waiting=1."):
            scheduler.add([3, 4])
        with pytest.raises(ValueError, match="prompt has 64 tokens; max_seq_len=64"):
            scheduler.add([1] * 64)
        with pytest.raises(ValueError, match=r"token ids outside \[0, 96\)"):
            scheduler.add([1, 200])
        with pytest.raises(TypeError, match="params must be a SamplingParams"):
            scheduler.add([1], {"temperature": 1})
        with pytest.raises(ValueError, match="3 requests at once are more than this scheduler ever holds: 1 rows"):
            scheduler.add_all([([5], None, None)] * 3)
        with pytest.raises(ValueError, match="request id 'a' is already in use"):
            scheduler.add_all([([5], None, "a"), ([6], None, "a")])
        assert len(scheduler.waiting) == 2 and len(scheduler.requests) == 2  # a refused group left nothing
        scheduler.step()  # the queued request runs: nothing a refusal touched leaked into it
        # refused by name, as given: not its conversion (a dict's keys, bytes' ints), nor text no decoding gives
        for stop in ([""], 123, b"abc", {"x": 1}, ["\ud800"]):
            with pytest.raises(ValueError, match=f"stop must be a non-empty string.*got {re.escape(repr(stop))}"):
                SamplingParams(stop=stop)
        assert SamplingParams(stop={"x"}).stop == SamplingParams(stop="x").stop == ("x",)


def test_a_request_with_non_finite_logits_fails_alone():
    broken, plain = broken_and_plain(lambda: tiny_llama(seed=7))
    engine = Engine(broken, max_batch_size=2, max_seq_len=32, verify_backend="torch")
    assert_a_non_finite_request_fails_alone(engine, Autoregressive(), plain)


@pytest.mark.parametrize("name", ["pearl", "cascade2-l2", "speculative-model"])
def test_an_idle_row_beside_a_long_request_stays_short(models, name):
    """Drafters identical to the target accept everything, also on a free row's masked input:
    the case where a row that is not masked out of the cache updates would grow every step."""
    drafters, strategy = STRATEGIES[name]
    same = [models["target"] if d != "mag" else "mag" for d in drafters]
    engine = Engine(models["target"], drafters=same, max_batch_size=2, max_seq_len=64, verify_backend="torch")
    arrivals = [([1, 2, 3], SamplingParams(max_new_tokens=1), 0), (repetitive_prompt(3), SamplingParams(max_new_tokens=50), 0)]
    with engine.scheduler(strategy) as scheduler:
        results = run_arrivals(scheduler, arrivals, IdleRowsStayShort())
    assert len(results[1].token_ids) == 50


@pytest.mark.parametrize("name", ["autoregressive", "speculative-mag", "cascade2-l2", "cascade-tree", "staged",
                                  "pearl"])
def test_chunked_prefill_gives_the_same_tokens(models, name):
    """prefill_chunk=4: long prompts enter over several steps while the other rows decode; every
    request still gives its tokens alone, and the first request decodes from the first step."""
    engine = engine_for(models, name)
    strategy = STRATEGIES[name][1]
    with engine.scheduler(strategy, prefill_chunk=4) as scheduler:
        results = run_arrivals(scheduler, ARRIVALS, check_all(IdleRowsStayShort(), BufferHoldsTheSequence()))
    for i, (prompt, params, _) in enumerate(ARRIVALS):
        expected = alone(engine, strategy, prompt, params)
        assert results[i].token_ids == expected.token_ids, f"{name}: request {i} changed under chunked prefill"
    with engine.scheduler(strategy, prefill_chunk=4) as scheduler:
        short, long = scheduler.add([1, 2, 3]), scheduler.add(repetitive_prompt(2, 30))
        first = scheduler.step()
        assert [o.request_id for o in first] == [short], "the 30-token prompt needs 8 steps of 4 tokens"
        for _ in range(6):
            assert long not in [o.request_id for o in scheduler.step()]
        assert scheduler.abort(long)
        aborted = [o for o in scheduler.step() if o.request_id == long]
        assert aborted[0].finish_reason == "abort" and aborted[0].result.token_ids == []


def test_a_row_that_failed_non_finite_serves_the_next_request():
    """One row: the request with non-finite logits fails, and the request admitted into its row
    afterwards starts from clean flags (and caches) and runs to its length."""
    broken, plain = broken_and_plain(lambda: tiny_llama(seed=7))
    engine = Engine(broken, max_batch_size=1, max_seq_len=32, verify_backend="torch")
    with engine.scheduler(Autoregressive()) as scheduler:
        bad, good = scheduler.add([4, 5, 6], NON_FINITE_PARAMS), scheduler.add([1, 2, 3], NON_FINITE_PARAMS)
        done = {}
        while scheduler.has_unfinished():
            done.update((out.request_id, out) for out in scheduler.step() if out.finished)
    assert done[bad].finish_reason == "error"
    assert done[good].finish_reason == "length" and done[good].result.token_ids == plain


def test_short_prompts_are_not_prefilled_to_a_long_neighbours_length(monkeypatch):
    """Requests admitted together are prefilled in blocks padded to their longest prompt: a long
    prompt goes alone, the short ones after it share one block, and each row's tokens are what
    it gets alone."""
    from csd_engine.models.llama import LlamaRunner
    calls, real = [], LlamaRunner.prefill

    def prefill(self, rows, ids, start=0):
        calls.append((rows.start, rows.stop, ids.shape[1]))
        real(self, rows, ids, start)
    monkeypatch.setattr(LlamaRunner, "prefill", prefill)
    engine = Engine(tiny_llama(), max_batch_size=4, max_seq_len=600, verify_backend="torch")
    prompts = [random_prompts(1, lo=500, hi=500, seed=1)[0], [5, 6, 7], [8] * 12, [9, 10]]
    params = SamplingParams(max_new_tokens=3)
    together = [r.token_ids for r in engine.generate(prompts, params)]
    assert calls == [(0, 1, 499), (1, 4, 11)]
    assert together == [engine.generate([p], params)[0].token_ids for p in prompts]


def test_prefill_groups_follow_their_rule_on_random_lengths():
    """The one-pass grouping splits exactly where the rule says: a row starts a new group when
    adding it would pad the group by more than half its real tokens plus PREFILL_SLACK a row."""
    from csd_engine.scheduler import PREFILL_SLACK, _prefill_groups

    def by_the_rule(run, lengths):
        groups, lo = [], run[0]
        for row in range(run[0] + 1, run[1]):
            rows = range(lo, row + 1)
            padded, real = max(lengths[r] for r in rows) * len(rows), sum(lengths[r] for r in rows)
            if padded - real > real / 2 + PREFILL_SLACK * len(rows):
                groups.append((lo, row))
                lo = row
        return groups + [(lo, run[1])]

    gen = torch.Generator().manual_seed(0)
    for case in range(300):
        lo = int(torch.randint(0, 5, (1,), generator=gen))
        n = int(torch.randint(1, 40, (1,), generator=gen))
        top = [4, 100, 1000][case % 3]
        lengths = {lo + i: int(torch.randint(0, top, (1,), generator=gen)) for i in range(n)}
        assert _prefill_groups((lo, lo + n), lengths) == by_the_rule((lo, lo + n), lengths)
    assert len(_prefill_groups((0, 3), {0: 500, 1: 3, 2: 2})) == 2  # the rule splits at all here


@pytest.mark.parametrize("name", ["speculative-model", "cascade2-l2", "staged"])
def test_forwards_compute_only_the_rows_up_to_the_last_request(models, name):
    """A scheduler of 4 rows holding one request forwards its models over that row only (the
    rows after the last one holding a request are skipped, their logits zeros), over two once a
    second request takes row 1; tokens as decoded alone, and the idle rows' caches untouched."""
    engine = engine_for(models, name, rows=4)
    strategy = STRATEGIES[name][1]
    seen = []
    for runner in engine.models():
        forward = runner.forward
        runner.forward = lambda batch, forward=forward: seen.append(batch.input_ids.shape[0]) or forward(batch)
    try:
        arrivals = [([5, 9, 2, 7], SamplingParams(max_new_tokens=24), 0),
                    ([3, 1, 4, 1, 5], SamplingParams(max_new_tokens=6), 1)]
        with engine.scheduler(strategy, rows=4) as scheduler:
            results = run_arrivals(scheduler, arrivals, IdleRowsStayShort())
            lengths = [int(r.cache.lengths[2:].abs().sum()) for r in engine.models()]
    finally:
        for runner in engine.models():
            del runner.forward
    decoding = [n for n in seen if n < 4]  # prefills go through forward too, one row each here
    assert seen and set(seen) <= {1, 2} and 2 in decoding, seen
    assert lengths == [0] * len(lengths), "a row past the last request was written"
    for i, (prompt, params, _) in enumerate(arrivals):
        assert results[i].token_ids == alone(engine, strategy, prompt, params).token_ids
