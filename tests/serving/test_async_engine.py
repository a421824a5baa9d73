"""AsyncEngine without HTTP: concurrent callers get exactly their offline tokens, a burst into free
rows is not refused while a full queue is, and a consumer that stops reading frees its row."""
import asyncio
import gc
import subprocess
import sys
import threading

import pytest
import torch

from csd_engine import Engine, SamplingParams, Speculative
from csd_engine.serving import AsyncEngine, EngineStopped, QueueFull
from tests.tiny_models import random_prompts, tiny_llama


@pytest.fixture(scope="module")
def engine():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread beats several on a busy machine
    yield Engine(tiny_llama(seed=5), drafters=["mag"], max_batch_size=3, max_seq_len=64)
    torch.set_num_threads(threads)


async def collect(async_engine, prompt, params):
    tokens, increments = [], 0
    async for out in async_engine.generate(prompt, params):
        tokens += out.token_ids
        increments += 1
    assert out.finished and out.result.token_ids == tokens
    return tokens, out.result, increments


def test_concurrent_requests_equal_offline_generate(engine):
    """More requests than rows, of different lengths, submitted together: each one's increments
    add up to the tokens offline generate gives it, and the totals count them all."""
    prompts = random_prompts(7, seed=3)
    params = [SamplingParams(max_new_tokens=4 + 3 * i) for i in range(7)]
    strategy = Speculative(k=3)
    expected = [engine.generate([p], q, strategy=strategy)[0] for p, q in zip(prompts, params)]
    async_engine = AsyncEngine(engine, strategy)
    try:
        async def main():
            return await asyncio.gather(*(collect(async_engine, p, q) for p, q in zip(prompts, params)))
        got = asyncio.run(main())
        assert [tokens for tokens, _, _ in got] == [e.token_ids for e in expected]
        stats = async_engine.stats()
        assert stats["finished"] == {"length": 7} and stats["running"] == stats["waiting"] == 0
        assert stats["generation_tokens"] == sum(len(e.token_ids) for e in expected)
        assert stats["prompt_tokens"] == sum(map(len, prompts))
        assert stats["draft_tokens"] == sum(r.metrics.drafted for _, r, _ in got)
        assert stats["accepted_tokens"] == sum(stats["accepted_per_position"]) == sum(r.metrics.accepted for _, r, _ in got)
    finally:
        async_engine.close()


def test_queue_limit_counts_only_requests_without_a_free_row(engine):
    """rows=1, max_waiting=1: the first request takes the row, the second waits, the third is
    refused (QueueFull) and leaves nothing behind; bad requests raise at the first iteration."""
    async_engine = AsyncEngine(engine, rows=1, max_waiting=1)
    try:
        async def main():
            long = SamplingParams(max_new_tokens=40)
            results = await asyncio.gather(*(collect(async_engine, [1, 2, 3], long) for _ in range(3)),
                                           return_exceptions=True)
            with pytest.raises(ValueError, match="prompt is empty"):
                await anext(async_engine.generate([], long))
            with pytest.raises(TypeError, match="params must be a SamplingParams"):
                await anext(async_engine.generate([1], {"max_tokens": 3}))
            with pytest.raises(ValueError, match="prompt is empty"):
                await async_engine.encode([])
            return results
        first, second, third = asyncio.run(main())
        assert first[0] == second[0] and len(first[0]) == 40
        assert isinstance(third, QueueFull) and "max_waiting=1" in str(third)
        assert async_engine.stats()["finished"] == {"length": 2}
    finally:
        async_engine.close()


def test_requests_submitted_together_are_queued_all_or_none(engine):
    """rows=1, max_waiting=1, the row busy: two requests submitted together are refused together
    (QueueFull) and leave nothing behind, one alone waits; a submitted stream closed before it
    was ever read aborts its request. Tokenizing runs beside the engine thread, not on it."""
    async_engine = AsyncEngine(engine, rows=1, max_waiting=1)
    try:
        async def main():
            [running] = await async_engine.submit([([1, 2, 3], SamplingParams(max_new_tokens=40))])
            first = await anext(running)
            with pytest.raises(QueueFull, match="no room for 2 more"):
                await async_engine.submit([([4], SamplingParams(max_new_tokens=2))] * 2)
            [waiting] = await async_engine.submit([([4], SamplingParams(max_new_tokens=2))])
            await waiting.aclose()  # never read: aborted all the same
            tokens = first.token_ids + [t for out in [out async for out in running] for t in out.token_ids]
            tokenizer_thread = await async_engine.tokenize(threading.current_thread)
            return tokens, tokenizer_thread
        tokens, tokenizer_thread = asyncio.run(main())
        assert len(tokens) == 40 and tokenizer_thread not in (async_engine._worker.thread, threading.current_thread())
        assert async_engine.stats()["finished"] == {"length": 1, "abort": 1}
    finally:
        async_engine.close()


def test_a_consumer_that_stops_reading_frees_its_row(engine):
    """Breaking out of the iteration, or cancelling the task reading it, aborts the request at the
    next step: with one row, the requests queued behind run at once, and the totals count the
    aborts (far fewer tokens than the 2 x 60 asked for)."""
    async_engine = AsyncEngine(engine, rows=1)
    try:
        async def main():
            async for _ in async_engine.generate([1, 2, 3], SamplingParams(max_new_tokens=60)):
                break
            first = await collect(async_engine, [6, 7], SamplingParams(max_new_tokens=5))
            started = asyncio.Event()

            async def read_until_cancelled():
                async for _ in async_engine.generate([4, 5], SamplingParams(max_new_tokens=60)):
                    started.set()
            reader = asyncio.ensure_future(read_until_cancelled())
            await started.wait()
            reader.cancel()
            second = await collect(async_engine, [6, 7], SamplingParams(max_new_tokens=5))
            return first, second
        first, second = asyncio.run(main())
        assert first[0] == second[0] and len(first[0]) == 5
        stats = async_engine.stats()
        assert stats["finished"] == {"abort": 2, "length": 2} and stats["generation_tokens"] < 60
    finally:
        async_engine.close()


def test_a_consumer_cancelled_as_its_request_is_accepted_frees_its_row(engine):
    """The task is cancelled in the loop iteration that accepts its request, before it resumes:
    the request is aborted, not left decoding its 60 tokens for nobody."""
    async_engine, victim = AsyncEngine(engine, rows=1), [None]
    accepted = async_engine._worker.accepted

    def cancel_on_accept(*args):
        accepted(*args)
        victim[0].cancel()
    async_engine._worker.accepted = cancel_on_accept
    try:
        async def main():
            victim[0] = asyncio.ensure_future(collect(async_engine, [1, 2, 3], SamplingParams(
                max_new_tokens=60, ignore_eos=True)))
            with pytest.raises(asyncio.CancelledError):
                await victim[0]
            victim[0] = asyncio.ensure_future(asyncio.sleep(0))  # the next one's cancel hits nothing
            return await collect(async_engine, [6, 7], SamplingParams(max_new_tokens=5))
        asyncio.run(main())
        stats = async_engine.stats()
        assert stats["finished"] == {"abort": 1, "length": 1} and stats["generation_tokens"] < 60
    finally:
        async_engine.close()


def test_a_stale_stream_does_not_abort_a_newer_request_of_its_id(engine):
    """A's request ends in the engine while its consumer has not read the end; B reuses the id;
    then A's consumer stops: B runs to its length."""
    async_engine = AsyncEngine(engine, rows=2)
    try:
        async def main():
            a = async_engine.generate([1, 2, 3], SamplingParams(max_new_tokens=3), request_id="x")
            await anext(a)
            while async_engine.stats()["finished"].get("length", 0) < 1:  # A ended in the engine
                await asyncio.sleep(0.01)
            b = async_engine.generate([4, 5], SamplingParams(max_new_tokens=30, ignore_eos=True), request_id="x")
            first = await anext(b)  # B is accepted under "x"
            await a.aclose()
            async for last in b:
                pass
            return first, last
        first, last = asyncio.run(main())
        assert last.finish_reason == "length" and len(last.result.token_ids) == 30
    finally:
        async_engine.close()


def test_a_call_that_raises_a_base_exception_reaches_its_caller_only(engine):
    """fn() raising CancelledError (a BaseException): the caller gets it, the engine serves on."""
    async_engine = AsyncEngine(engine)
    try:
        def cancelled():
            raise asyncio.CancelledError("inside fn")

        async def main():
            with pytest.raises(asyncio.CancelledError):  # (a dead engine thread never answers: fail, not hang)
                await asyncio.wait_for(async_engine.call(cancelled), timeout=60)
            return await asyncio.wait_for(collect(async_engine, [6, 7], SamplingParams(max_new_tokens=5)), timeout=60)
        assert len(asyncio.run(main())[0]) == 5 and async_engine.error is None
    finally:
        async_engine.close()


def test_close_stops_serving_and_releases_the_engine(engine):
    async_engine = AsyncEngine(engine)
    async_engine.close()
    assert async_engine.error == "the engine was closed"

    async def main():
        with pytest.raises(EngineStopped, match="closed"):
            await anext(async_engine.generate([1, 2], SamplingParams(max_new_tokens=2)))
    asyncio.run(main())
    assert len(engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].token_ids) == 2

    # closed from work run on its own thread: the thread stops after it, instead of joining itself
    async_engine = AsyncEngine(engine)
    asyncio.run(async_engine.call(async_engine.close))
    async_engine.close()
    assert async_engine.error == "the engine was closed"
    assert len(engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].token_ids) == 2



def test_an_async_engine_dropped_without_close_stops_and_releases_the_engine(engine):
    """The last reference to an AsyncEngine gone (no close(), no `with`): its thread ends and the
    engine serves again, instead of a thread blocked forever holding the engine's caches."""
    async_engine = AsyncEngine(engine, Speculative(k=3))

    async def main():
        return await collect(async_engine, [1, 2, 3], SamplingParams(max_new_tokens=3))
    assert len(asyncio.run(main())[0]) == 3
    thread = async_engine._worker.thread
    del async_engine
    gc.collect()
    thread.join(30)
    assert not thread.is_alive()
    assert len(engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].token_ids) == 2

WITHOUT_THE_SERVE_EXTRA = """
import sys
for name in ("fastapi", "uvicorn", "prometheus_client"):
    sys.modules[name] = None  # as if not installed
import csd_engine, csd_engine.serving
from csd_engine import cli
sys.exit(cli.main(["serve", "--target", "unused"]))
"""


def test_the_package_imports_without_the_serve_extra():
    """fastapi, uvicorn and prometheus_client are imported by the server module only: without
    them csd_engine and AsyncEngine import, and `serve` says which extra to install."""
    done = subprocess.run([sys.executable, "-c", WITHOUT_THE_SERVE_EXTRA], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "pip install 'csd_engine[serve]'" in done.stderr, done.stderr


def test_a_request_aborted_while_waiting_counts_no_prompt_tokens(engine):
    """prompt_tokens counts the prompts prefilled: a request aborted before it had a row counts
    as aborted, its prompt not at all."""
    async_engine = AsyncEngine(engine, Speculative(k=3), rows=1)
    try:
        async def main():
            first, second = await async_engine.submit([([1, 2, 3], SamplingParams(max_new_tokens=20)),
                                                       ([4, 5, 6, 7], SamplingParams(max_new_tokens=5))])
            await second.aclose()  # the first holds the only row: the second still waits
            async for _ in first:
                pass
        asyncio.run(main())
        stats = async_engine.stats()
        assert stats["finished"] == {"length": 1, "abort": 1}
        assert stats["prompt_tokens"] == 3
    finally:
        async_engine.close()
