"""Many concurrent asyncio callers on one engine: a background thread drives its Scheduler.

    with AsyncEngine(engine, Speculative(k=4), max_waiting=64) as async_engine:  # close() gives the engine back
        async for out in async_engine.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.text, end="")  # each RequestOutput: what one step added

Thread-safety contract:
* The engine thread is the only thread that touches the Scheduler, and so the engine's caches
  and models. `call` runs other work there between two steps.
* Prompts are tokenized (`encode`, `tokenize`) on a thread of their own: a tokenizer's encode
  only reads it and releases the GIL, so a long prompt does not hold up the running requests'
  steps.
* Callers talk to it through a command queue (add, abort, call, close): every public method is
  safe from any thread, the async ones from any event loop. Increments go back to the loop that
  submitted the request (`loop.call_soon_threadsafe`), in step order.
* A consumer that stops iterating (break, `aclose`, its task cancelled on a client disconnect)
  aborts its request: the row is freed at the next step.
"""
import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import uuid
import weakref
from collections.abc import AsyncIterator

from csd_engine.scheduler import RequestOutput

log = logging.getLogger(__name__)


class EngineStopped(RuntimeError):
    """The engine thread has stopped (closed, or a step raised): no request can be served."""


def _resolve(future: asyncio.Future, value=None, error: BaseException | None = None) -> None:
    """Complete `future` unless its waiter is gone (runs on the future's loop)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class RequestStream:
    """One submitted request's increments, an async iterator that ends after the finished one.
    `aclose()`, or the stream's garbage collection, aborts the request if it is unfinished,
    whether or not it was ever iterated."""

    def __init__(self, engine: "AsyncEngine", request_id: str, outputs: asyncio.Queue):
        self.request_id, self._engine, self._outputs, self._finished = request_id, engine, outputs, False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished:
            raise StopAsyncIteration
        out = await self._outputs.get()
        if isinstance(out, BaseException):
            self._finished = True  # the engine stopped or the request failed: nothing follows
            raise out
        self._finished = out.finished
        return out

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            self._engine._worker.abort(self.request_id, self._outputs)

    def __del__(self):
        if not self._finished:  # SimpleQueue.put is safe here (reentrant); a stopped engine ignores it
            self._engine._worker.commands.put(("abort", self.request_id, self._outputs))


class AsyncEngine:
    """Owns one Scheduler of `engine` (`rows` slots) and the thread that steps it while requests
    are unfinished. `max_waiting`: how many requests may wait for a row (None: no limit); one
    more raises QueueFull. Requests that free rows take at the next step do not count, so a burst
    into an idle engine is not refused. `prefill_chunk`: prompt tokens prefilled per step.
    An AsyncEngine dropped without close() closes when it is garbage-collected: the thread holds
    only its _Worker, never the AsyncEngine, so it cannot keep the engine busy forever."""

    def __init__(self, engine, strategy=None, max_waiting: int | None = None, rows: int | None = None,
                 prefill_chunk: int | None = None):
        self.engine = engine
        scheduler = engine.scheduler(strategy, rows=rows, max_waiting=max_waiting, prefill_chunk=prefill_chunk)
        self.strategy = strategy
        self.rows, self.max_waiting = len(scheduler.slots), max_waiting
        if callable(engine.tokenizer):  # a tokenizer may set itself up on its first call: not beside a decode
            engine.tokenizer("")
        self._tokenizing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="csd-tokenize")
        self._worker = worker = _Worker(scheduler, self._tokenizing)
        weakref.finalize(self, worker.stop)

    # -- callers' side -------------------------------------------------------------------------
    async def generate(self, prompt, params=None, request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request (text or token ids) and yield its increments as steps commit them; the
        last one has `finished` set. The first iteration raises the submission's error: ValueError
        / TypeError for a bad prompt or params, QueueFull, EngineStopped."""
        [stream] = await self.submit([(prompt, params)], None if request_id is None else [request_id])
        async with contextlib.aclosing(stream):
            async for out in stream:
                yield out

    async def submit(self, requests: list[tuple], request_ids: list[str] | None = None) -> list[RequestStream]:
        """Submit several (prompt, params) requests at once, all or none (Scheduler.add_all: a
        response's n choices are queued together or refused together), and return a stream of
        increments for each (RequestStream). Raises as `generate`'s first iteration does."""
        loop = asyncio.get_running_loop()
        request_ids = [uuid.uuid4().hex for _ in requests] if request_ids is None else list(request_ids)
        if len(request_ids) != len(requests):
            raise ValueError(f"request_ids must be None or one per request ({len(requests)}), got {len(request_ids)}")
        queues = [asyncio.Queue() for _ in requests]
        accepted = loop.create_future()
        self._worker.send(("add", list(requests), request_ids, loop, accepted, queues))
        try:
            await accepted  # cancelled before they were accepted: _Worker.accepted aborts them
        except asyncio.CancelledError:
            if accepted.done() and not accepted.cancelled():  # accepted, then cancelled before resuming
                for request_id, outputs in zip(request_ids, queues):
                    self._worker.abort(request_id, outputs)
            raise
        return [RequestStream(self, i, q) for i, q in zip(request_ids, queues)]

    def abort(self, request_id: str) -> None:
        """End a request at the next step (a no-op for an unknown or finished one)."""
        self._worker.abort(request_id, None)

    async def call(self, fn):
        """fn() run on the engine thread between two steps (tokenizing, for one); its result or
        exception."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._worker.send(("call", fn, loop, done))
        return await done

    async def tokenize(self, fn):
        """fn() run on the tokenizing thread (one prompt at a time, beside the engine's steps)."""
        try:
            work = asyncio.get_running_loop().run_in_executor(self._tokenizing, fn)
        except RuntimeError:  # closed
            raise EngineStopped(self._worker.stopped or "the engine was closed") from None
        return await work

    async def encode(self, prompt) -> list[int]:
        """The prompt's token ids, checked as `add` checks them (ValueError naming the problem:
        empty, too long for max_seq_len, ids outside the vocabulary, no tokenizer for text)."""
        return await self.tokenize(lambda: self.engine.encode_prompt(prompt))

    def stats(self) -> dict:
        """Requests waiting for a row and running (as of the last step), rows, max_waiting, and
        counters since the start over finished requests: `finished` by finish reason, the
        prompt tokens prefilled and tokens generated, and speculation's `drafts` (target reviews
        of at least one draft token), `draft_tokens`, `accepted_tokens` and
        `accepted_per_position` (tokens accepted at each draft position)."""
        worker = self._worker
        with worker.lock:
            totals = {**worker.totals, "finished": dict(worker.totals["finished"]),
                      "accepted_per_position": list(worker.totals["accepted_per_position"])}
        return {**worker.queued, "rows": self.rows, "max_waiting": self.max_waiting, **totals}

    @property
    def error(self) -> str | None:
        """Why the engine thread stopped (None while it serves)."""
        return self._worker.stopped

    def close(self, timeout: float | None = 30) -> None:
        """Stop the thread: unfinished requests end with EngineStopped, the engine is released."""
        self._worker.stop()
        if threading.current_thread() is not self._worker.thread:  # close() from a `call` stops the thread after it
            self._worker.thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Worker:
    """The engine thread and everything it shares with callers: the command queue (add, abort,
    call, close), the lock that orders "stopped?" checks against its last drain, the counters.
    Only this thread touches the Scheduler."""

    def __init__(self, scheduler, tokenizing: concurrent.futures.ThreadPoolExecutor):
        self.scheduler, self.tokenizing = scheduler, tokenizing
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, tuple] = {}  # request id -> (loop, asyncio.Queue); engine thread only
        self.lock = threading.Lock()
        self.stopped: str | None = None  # why the thread stopped
        self.queued = {"waiting": 0, "running": 0}
        self.prompt_tokens: dict[str, int] = {}  # request id -> prompt length; engine thread only
        self.totals = {"finished": {}, "prompt_tokens": 0, "generation_tokens": 0, "drafts": 0,
                       "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_position": []}
        self.thread = threading.Thread(target=self.run, name="csd-engine", daemon=True)
        self.thread.start()

    def send(self, command: tuple) -> None:
        with self.lock:
            if self.stopped is not None:
                raise EngineStopped(self.stopped)
            self.commands.put(command)

    def abort(self, request_id: str, outputs: asyncio.Queue | None) -> None:
        """Abort a request; with `outputs` only while the request of that id streams there."""
        with contextlib.suppress(EngineStopped):
            self.send(("abort", request_id, outputs))

    def stop(self) -> None:
        """Ask the thread to close after the commands before this one (a no-op once stopped)."""
        with contextlib.suppress(EngineStopped):
            self.send(("close",))

    def run(self) -> None:
        why = "the engine was closed"
        scheduler = self.scheduler
        try:
            while True:
                if not self.handle_commands(block=not scheduler.has_unfinished()):
                    break
                outputs = scheduler.step() if scheduler.has_unfinished() else []
                self.queued = {"waiting": len(scheduler.waiting), "running": scheduler.running}
                for out in outputs:  # after the counts, so that a caller seeing its end sees them too
                    if out.finished:
                        self.count(out)
                    self.deliver(out)
        except BaseException as exc:  # a bug in a step: the scheduler's state is unknown, so stop serving
            log.exception("the engine thread stopped")
            why = f"the engine failed: {type(exc).__name__}: {exc}"
        with self.lock:
            self.stopped = why
        stopped = EngineStopped(why)
        for loop, outputs in self.streams.values():
            _post(loop, outputs.put_nowait, stopped)
        self.streams.clear()
        while True:  # commands sent before `stopped` was set
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                _post(command[3], _resolve, command[4], None, stopped)
            elif command[0] == "call":
                _post(command[2], _resolve, command[3], None, stopped)
        self.queued = {"waiting": 0, "running": 0}
        self.tokenizing.shutdown(wait=False, cancel_futures=True)
        scheduler.close()

    def handle_commands(self, block: bool) -> bool:
        """Run the queued commands (waiting for one if `block`); False once asked to close."""
        while True:
            try:
                command = self.commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            kind = command[0]
            if kind == "close":
                return False
            if kind == "add":
                self.add(*command[1:])
            elif kind == "abort":
                request_id, outputs = command[1:]
                if outputs is None or self.streams.get(request_id, (None, None))[1] is outputs:
                    self.scheduler.abort(request_id)
            elif kind == "call":
                fn, loop, done = command[1:]
                try:
                    _post(loop, _resolve, done, fn())
                except BaseException as exc:  # CancelledError or SystemExit too: the caller's, not the thread's
                    _post(loop, _resolve, done, None, exc)

    def add(self, requests, request_ids, loop, accepted, queues) -> None:
        scheduler = self.scheduler
        try:  # QueueFull unless there is room for all of them
            scheduler.add_all([(prompt, params, i) for (prompt, params), i in zip(requests, request_ids)])
        except Exception as exc:  # ValueError, TypeError, QueueFull: the caller's to handle
            _post(loop, _resolve, accepted, None, exc)
            return
        for request_id, outputs in zip(request_ids, queues):
            self.streams[request_id] = (loop, outputs)
            self.prompt_tokens[request_id] = len(scheduler.requests[request_id].prompt)
        if not _post(loop, self.accepted, accepted, request_ids, queues):
            for request_id in request_ids:
                scheduler.abort(request_id)

    def accepted(self, accepted: asyncio.Future, request_ids: list[str], queues: list[asyncio.Queue]) -> None:
        """On the caller's loop: the requests are queued; a caller cancelled meanwhile aborts them."""
        if accepted.cancelled():
            for request_id, outputs in zip(request_ids, queues):
                self.abort(request_id, outputs)
        else:
            accepted.set_result(None)

    def count(self, out: RequestOutput) -> None:
        """Add a finished request to the totals; its prompt counts if it was prefilled (had a row)."""
        prompt, result = self.prompt_tokens.pop(out.request_id, 0), out.result
        metrics = result.metrics
        with self.lock:
            totals = self.totals
            totals["finished"][out.finish_reason] = totals["finished"].get(out.finish_reason, 0) + 1
            totals["generation_tokens"] += len(result.token_ids)
            if metrics is None:
                return
            totals["prompt_tokens"] += prompt
            totals["drafts"] += metrics.drafted_per_position[0] if metrics.drafted_per_position else 0
            totals["draft_tokens"] += metrics.drafted
            totals["accepted_tokens"] += metrics.accepted
            per_position = totals["accepted_per_position"]
            per_position.extend([0] * (len(metrics.accepted_per_position) - len(per_position)))
            for position, accepted in enumerate(metrics.accepted_per_position):
                per_position[position] += accepted

    def deliver(self, out: RequestOutput) -> None:
        stream = self.streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self.streams[out.request_id]
        if not _post(stream[0], stream[1].put_nowait, out) and not out.finished:
            self.scheduler.abort(out.request_id)  # its loop is closed: nobody will read it


def _post(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """Run fn(*args) on `loop`; False if that loop is closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:
        return False
