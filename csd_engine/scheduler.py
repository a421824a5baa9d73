"""Continuous batching: requests join and leave the engine's static batch between steps.

    with engine.scheduler(Cascade(...)) as s:
        s.add("Hello", SamplingParams(max_new_tokens=32))
        while s.has_unfinished():
            for out in s.step():  # RequestOutput: the tokens and text each request gained
                ...

The batch has `rows` slots (the engine's max_batch_size by default). Each `step` first
admits waiting requests into free slots (a prefill of only those rows, while the other rows
keep their caches mid-generation; with `prefill_chunk`, a longer prompt is prefilled that many
tokens per step while the others go on decoding), then runs one step of the strategy over every
slot (free slots masked), reads its tokens once, and returns each request's increment. A request whose
tokens end (stop token, stop string, length, abort, non-finite logits) leaves its slot at once.
A request's tokens do not depend on when it arrived or what shares its batch: its row starts
from fresh caches, with its own random counter and per-row random streams.

Host reads: the step's one read (`read_host`), plus one read of the decoder's plan in a step
where requests start or are aborted (the live rows' plan rows), plus each finished request's
counters.

Thread safety: a scheduler holds the engine's caches, so an engine has at most one at a time
(a second, or `generate` meanwhile, raises "busy"), and one thread drives it. Serve many
callers through `csd_engine.serving.AsyncEngine`, which drives one from its own thread.
"""
import itertools
import os
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

from csd_engine.checks import is_int
from csd_engine.drafters.mag import MaG
from csd_engine.kernels.random import fold_seed
from csd_engine.params import SamplingParams
from csd_engine.models.llama import LlamaRunner
from csd_engine.models.runner import on_device, without_autocast
from csd_engine.step_graphs import CudaCapture, StepGraphs
from csd_engine.strategies.base import DecodeState, Decoder, StepMetrics
from csd_engine.text import IncrementalText


def _max_top_k(params: list[SamplingParams]) -> int | None:
    """The largest top_k when every filtered row has one (a top-k sort that wide then holds every
    cut-off), else None."""
    filtered = [p for p in params if not p.greedy and (p.top_k > 0 or p.top_p < 1)]
    return max(p.top_k for p in filtered) if filtered and all(p.top_k > 0 for p in filtered) else None


def read_host(tensor: torch.Tensor) -> list:
    """The engine's one device-to-host read per step (tests count the calls)."""
    return tensor.tolist()


class StepRead:
    """A step's output, every model's non-finite flags and the next plan, read from the device
    in one copy (read_host) and unpacked per row. Columns: [count | tokens (m) | a flag per
    model | logprobs' float bits (m, when asked) | plan]."""

    def __init__(self, out, nonfinite: torch.Tensor, next_plan: torch.Tensor | None):
        parts = [out.counts[:, None], out.tokens, nonfinite.long()]
        if out.logprobs is not None:
            parts.append(out.logprobs.view(torch.int32).long())
        if next_plan is not None:
            parts.append(next_plan)
        self.rows = read_host(torch.cat(parts, dim=1))
        m, n_models = out.tokens.shape[1], nonfinite.shape[1]
        self._flags = slice(1 + m, 1 + m + n_models)
        self._plan_from = self._flags.stop + (m if out.logprobs is not None else 0)
        self.logprobs = None
        if out.logprobs is not None:  # every row's bits decoded at once
            bits = torch.tensor([row[self._flags.stop:self._plan_from] for row in self.rows], dtype=torch.int64)
            self.logprobs = bits.to(torch.int32).view(torch.float32).tolist()
        self.has_plan = next_plan is not None

    def tokens(self, row: int) -> list[int]:
        """The row's committed tokens this step (its count of them)."""
        return self.rows[row][1:1 + self.rows[row][0]]

    def failed_models(self, row: int) -> list[int]:
        """The models (0 = target) whose logits for the row were ever non-finite."""
        return [i for i, flag in enumerate(self.rows[row][self._flags]) if flag]

    def plan(self, row: int) -> list[int]:
        return self.rows[row][self._plan_from:]


# Room past max_seq_len for the blocks a strategy feeds (draft + bonus, or tree nodes): writes
# beyond a row's committed length must stay inside the buffer.
HEADROOM = 256


@dataclass
class Metrics:
    new_tokens: int
    target_forwards: int  # the forwards of the steps it was decoded in (batched: each shared by its rows)
    drafter_forwards: list[int]  # likewise: a drafter forward another row needed counts for every row in the step
    wall_time_s: float  # this request's own: from its arrival (queue and prefill included) to its last token
    tokens_per_s: float
    mean_accepted_tokens: float  # tokens emitted per target forward, bonus included (AR = 1.0)
    # draft tokens the target accepted: its verdicts, also on drafts past where a stop or the
    # length then cut the output (so accepted may exceed new_tokens); likewise the per-position counts
    accepted: int = 0
    drafted: int = 0  # draft tokens offered to the target
    acceptance_by_position: list[float] = field(default_factory=list)
    acceptance_by_level: dict[int, float] = field(default_factory=dict)  # level 0 = the target; others: where drafted
    swi: float = 1.0  # standardized walltime improvement (model-size cost model)
    draft_lengths: dict[int, int] = field(default_factory=dict)  # draft length offered to the target -> rounds
    wait_time_s: dict[str, float] = field(default_factory=dict)  # "drafter" / "target": waiting on the other
    time_to_first_token_s: float = 0.0  # from its arrival (queue and prefill included) to its first token
    accepted_per_position: list[int] = field(default_factory=list)  # draft position -> tokens the target accepted
    drafted_per_position: list[int] = field(default_factory=list)  # draft position -> tokens offered


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" (stop token or string), "length" (max_new_tokens or max_seq_len), "abort", "error"
    metrics: Metrics | None
    logprobs: list[float] | None = None  # per token, when asked (SamplingParams.logprobs)
    error: str | None = None  # why, when finish_reason == "error"
    failed_models: list[int] = field(default_factory=list)  # indexes into engine.models() with non-finite logits


def _release_engine(engine) -> None:
    """What a scheduler gives back when it closes: the caches (the engine's and runners' locks) and the flags."""
    for runner in engine.models():  # a runner called outside a scheduler flags nothing
        runner.nonfinite_rows = None
    engine._release()


def request_metrics(m: StepMetrics, row: int, n_new: int, forwards: list[int], waits: dict, wall: float,
                    first_token: float, sizes: list[int]) -> Metrics:
    """A finished request's Metrics from its row's step counters and its own forwards and waits;
    `sizes`: each model's parameters (target first, MaG 0), which weigh the forwards for the SWI."""
    level_accepted, level_drafted = m.level_accepted[:, row].tolist(), m.level_drafted[:, row].tolist()
    accepted, drafted = level_accepted[0], level_drafted[0]
    a, d = m.accepted_by_position[row].tolist(), m.drafted_by_position[row].tolist()
    by_pos = [x / y for x, y in zip(a, d) if y > 0]
    a, d = a[:len(by_pos)], d[:len(by_pos)]
    # a level this row drafted nothing for has no rate (m.levels is the batch's: other rows' reviews)
    by_level = {lvl: level_accepted[lvl] / max(level_drafted[lvl], 1) for lvl in sorted(m.levels)
                if lvl == 0 or level_drafted[lvl] > 0}
    draft_lengths = {} if m.draft_lengths is None else {
        length: rounds for length, rounds in enumerate(m.draft_lengths[row].tolist()) if rounds}
    cost = sum(f * s for f, s in zip(forwards, sizes))
    ar_cost = n_new * sizes[0]
    return Metrics(new_tokens=n_new, target_forwards=forwards[0], drafter_forwards=forwards[1:],
                   wall_time_s=wall, tokens_per_s=n_new / wall if wall > 0 else 0.0,
                   mean_accepted_tokens=n_new / max(forwards[0], 1), accepted=accepted, drafted=drafted,
                   acceptance_by_position=by_pos, acceptance_by_level=by_level,
                   swi=ar_cost / cost if cost else 1.0, draft_lengths=draft_lengths,
                   wait_time_s=waits, time_to_first_token_s=first_token,
                   accepted_per_position=a, drafted_per_position=d)


class QueueFull(RuntimeError):
    """`max_waiting` requests already wait beyond the free rows."""


@dataclass
class RequestOutput:
    """What one step added to one request."""

    request_id: str
    token_ids: list[int]  # the tokens this step added
    text: str | None  # the text they added (None without a tokenizer); deltas concatenate to the result's text
    logprobs: list[float] | None = None  # per new token, when the request asked
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    result: object | None = None  # the whole request (GenerationResult) once finished
    error: str | None = None  # why, when finish_reason == "error"


@dataclass(eq=False)  # a request is itself: identity compares (field-wise == made admission quadratic)
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    stops: set
    limit: int  # new tokens allowed (max_new_tokens, capped by max_seq_len)
    arrival: float
    text: IncrementalText | None
    row: int = -1
    output: list = field(default_factory=list)
    logprobs: list | None = None
    forwards: list | None = None  # target, then each drafter
    waits: dict = field(default_factory=dict)  # side -> seconds waited in its steps (parallel strategies)
    first_token_s: float = 0.0  # since arrival
    done_s: float = 0.0
    finish: str | None = None
    error: str | None = None
    failed_models: list = field(default_factory=list)
    sent: int = 0  # tokens already handed out in increments
    prefilled: int = 0  # prompt tokens cached so far
    ready: bool = False  # prompt cached: the row decodes


@dataclass(eq=False)
class KeptSteps:
    """A scheduler's step graphs with what they were captured over (the decoder, the state's
    tensors). The engine keeps the last scheduler's, so the next one with the same strategy
    and rows (a later `generate` call) replays them instead of capturing anew; any other
    scheduler drops them, so nothing they hold (the state, the runners' flags and cache views)
    is rebound while they are kept."""

    strategy: object
    rows: int
    decoder: object
    state: DecodeState
    graphs: StepGraphs
    flags: list  # each runner's nonfinite_rows, which the graphs write


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


class Scheduler:
    def __init__(self, engine, strategy, rows: int | None = None, max_waiting: int | None = None,
                 prefill_chunk: int | None = None):
        rows = engine.max_batch_size if rows is None else rows
        if not is_int(rows) or not 1 <= rows <= engine.max_batch_size:
            raise ValueError(f"rows must be an int in [1, max_batch_size={engine.max_batch_size}], got {rows!r}")
        if max_waiting is not None and (not is_int(max_waiting) or max_waiting < 0):
            raise ValueError(f"max_waiting must be None (unbounded) or an int >= 0, got {max_waiting!r}")
        if prefill_chunk is not None and (not is_int(prefill_chunk) or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be None (whole prompts) or an int >= 1, got {prefill_chunk!r}")
        if isinstance(strategy, type):
            raise TypeError(f"strategy must be a strategy object, e.g. {strategy.__name__}(), got the class itself")
        if not hasattr(strategy, "decoder"):
            raise TypeError(f"unknown strategy {strategy!r}: pass one of csd_engine.Autoregressive, "
                            "Speculative, Cascade, Staged, Pearl")
        if not engine._acquire():
            raise RuntimeError("the engine is busy: another generate, stream or scheduler holds its caches (one "
                               "at a time, also among engines built over the same runners; a stream holds them "
                               "until it is exhausted or closed, a Scheduler or AsyncEngine until its close(); "
                               "serve concurrent callers through csd_engine.serving.AsyncEngine)")
        # closed explicitly, or when garbage-collected: a dropped scheduler does not keep the engine busy
        self._release = weakref.finalize(self, _release_engine, engine)
        self.closed = False
        self.failed: str | None = None  # what a step raised (no traceback kept: its frames hold the scheduler)
        try:
            engine._claim_runners()
            kept = engine._kept_steps
            reuse = kept is not None and kept.rows == rows and kept.strategy == strategy
            self.model_sizes = [engine.target.num_params] + [0 if isinstance(d, MaG) else d.num_params
                                                             for d in engine.drafters]  # weigh forwards (SWI)
            # building the decoder validates the strategy against the drafters (a kept one was)
            decoder = kept.decoder if reuse else strategy.decoder(engine._decoder_models())
            if not isinstance(decoder, Decoder):
                raise TypeError(f"{type(strategy).__name__}.decoder() returned a {type(decoder).__name__}, not a "
                                "csd_engine.strategies.base.Decoder: subclass it (it declares what the scheduler "
                                "calls)")
            if 2 * decoder.max_tokens_per_forward > HEADROOM:
                # A row can commit up to one forward past its limit in its last step, and a row is
                # fed (masked) once more before it leaves: two forwards must fit.
                raise ValueError(f"{strategy!r} feeds up to {decoder.max_tokens_per_forward} tokens per forward; "
                                 f"at most {HEADROOM // 2} fit the cache headroom: shorten its drafts (k, gamma, "
                                 f"k_matrix, mag_tokens, direct_tokens, tree, branching)")
            self.engine, self.decoder, self.max_waiting, self.prefill_chunk = engine, decoder, max_waiting, \
                prefill_chunk
            engine._kept_steps = None  # kept again below while its graphs stay valid
            self.state = kept.state if reuse else self._empty_state(rows)
            if reuse:
                self.state.clear()
            for i, runner in enumerate(engine.models()):
                runner.use_rows(rows)
                # this scheduler's flags (unset at close); where kept graphs are replayed, the tensor they write
                runner.nonfinite_rows = kept.flags[i].zero_() if reuse else \
                    torch.zeros(rows, dtype=torch.bool, device=runner.device)
                runner.cache.reset()
            decoder.start(self.state)
            self.step_graphs = kept.graphs if reuse else self._step_graphs()
            if self.step_graphs is not None:
                engine._kept_steps = KeptSteps(strategy, rows, decoder, self.state, self.step_graphs,
                                               [runner.nonfinite_rows for runner in engine.models()])
        except BaseException:
            self.close()
            raise
        self.slots: list[Request | None] = [None] * rows
        self.waiting: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.to_abort: list[str] = []
        self.freed: list[int] = []  # rows freed since the last step
        self.committed = [0] * rows  # host mirror of state.committed (occupied rows)
        self.plan = None
        self._ids = itertools.count()

    # -- requests ------------------------------------------------------------------------------
    def add(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request (text or token ids); returns its id. Raises ValueError for a bad
        prompt or parameters and QueueFull when `max_waiting` requests already wait."""
        return self.add_all([(prompt, params, request_id)])[0]

    def add_all(self, requests: list[tuple]) -> list[str]:
        """Queue several (prompt, params, request_id) requests, all or none (a response's n
        choices, say): every one is checked, and QueueFull is raised unless the queue has room
        for all. ValueError if they are more than this scheduler ever holds at once."""
        self._check_open()
        built, taken = [], set(self.requests)
        for prompt, params, request_id in requests:
            built.append(self._request(prompt, params, request_id, taken))
            taken.add(built[-1].id)
        if self.max_waiting is not None:
            free = sum(r is None for r in self.slots)
            if len(built) > len(self.slots) + self.max_waiting:
                raise ValueError(f"{len(built)} requests at once are more than this scheduler ever holds: "
                                 f"{len(self.slots)} rows and max_waiting={self.max_waiting}")
            if len(self.waiting) + len(built) - free > self.max_waiting:
                raise QueueFull(f"{max(len(self.waiting) - free, 0)} requests wait for a free row "
                                f"(max_waiting={self.max_waiting})" + (f", no room for {len(built)} more"
                                                                       if len(built) > 1 else "") + ": retry later")
        for request in built:
            self.requests[request.id] = request
            self.waiting.append(request)
        return [request.id for request in built]

    def _request(self, prompt, params: SamplingParams | None, request_id: str | None, taken: set) -> Request:
        """A checked Request (not queued) whose id is not in `taken`."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.stop and self.engine.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none: use stop_token_ids")
        vocab = self.engine.target.vocab_size
        if any(t >= vocab for t in params.stop_token_ids or ()):
            raise ValueError(f"stop_token_ids {list(params.stop_token_ids)} has ids outside the vocabulary "
                             f"[0, {vocab})")
        ids = self.engine.encode_prompt(prompt)
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in taken:
                request_id = str(next(self._ids))
        elif request_id in taken:
            raise ValueError(f"request id {request_id!r} is already in use")
        engine = self.engine
        text = None if engine.tokenizer is None else IncrementalText(engine.tokenizer, params.stop or ())
        return Request(request_id, ids, params, set(params.stop_token_ids or ()) | engine.eos_token_ids(params),
                       min(params.max_new_tokens, engine.max_seq_len - len(ids)), time.perf_counter(), text,
                       logprobs=[] if params.logprobs else None, forwards=[0] * (1 + len(engine.drafters)))

    def abort(self, request_id: str) -> bool:
        """End a request at the next step (its slot is freed then); False if it is unknown or done."""
        if request_id not in self.requests:
            return False
        self.to_abort.append(request_id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.to_abort or any(self.slots))

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.slots)

    def close(self) -> None:
        """Give the engine's caches back (the scheduler cannot be used afterwards)."""
        if not self.closed:
            self.closed = True
            self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self):
        if self.closed:
            raise RuntimeError("this scheduler is closed")
        if self.failed is not None:
            raise RuntimeError(f"a step of this scheduler raised {self.failed}, which "
                               "left its requests and caches part-way through a step: close it and open a new one "
                               "(engine.scheduler(...)); the engine itself is fine")

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit waiting requests, run one decoding step, and return every request's increment.
        A step that raises (Ctrl-C included) may stop between the device's work and its
        bookkeeping, so the scheduler refuses later steps and requests; the next one starts clean."""
        self._check_open()
        if torch.get_default_dtype() != torch.float32:  # integer division, ones(...): float32 by default only
            raise RuntimeError(f"torch's default dtype is {torch.get_default_dtype()} (torch.set_default_dtype), but "
                               "csd_engine's steps compute in float32 with it as the default: set it back to "
                               "torch.float32 while generating")
        # on the engine's GPU for the thread driving this scheduler; a caller's autocast does not
        # reach in: the engine's dtype is the one its forwards compute in
        with on_device(self.engine.device), without_autocast(self.engine.device):
            try:
                return self._step()
            except BaseException as error:  # Ctrl-C or an error mid-step: device and host records disagree
                self.failed = f"{type(error).__name__}({error})"
                raise

    def _step(self) -> list[RequestOutput]:
        outputs, freed = self._abort()
        self._empty_freed_rows()
        if self._admit() | self._prefill_chunks() or freed:  # the live rows changed: their plan rows too
            self.plan = self._read_plan()
        if not any(self._live()):
            return outputs
        state, engine, n_drafters = self.state, self.engine, len(self.engine.drafters)
        if self.step_graphs is None:  # forwards skip the rows past the last one holding a request
            state.rows_in_use = 1 + max(row for row, r in enumerate(self.slots) if r is not None)
        before = [state.metrics.target_forwards] + state.metrics.drafter_counts(n_drafters)
        waited = dict(state.metrics.wait_time_s)
        out, next_plan = (self.step_graphs or self.decoder).step_and_plan(state, self.plan)
        after = [state.metrics.target_forwards] + state.metrics.drafter_counts(n_drafters)
        waited = {side: t - waited.get(side, 0.0) for side, t in state.metrics.wait_time_s.items()}
        nonfinite = torch.stack([m.nonfinite_rows.to(engine.device) for m in engine.models()], 1)  # [B, models]
        host, now, finished = StepRead(out, nonfinite, next_plan), time.perf_counter(), []
        for row, request in enumerate(self.slots):
            if request is None or not request.ready:
                continue
            request.forwards = [f + a - c for f, a, c in zip(request.forwards, after, before)]
            request.waits = {side: request.waits.get(side, 0.0) + t for side, t in waited.items()}
            bad = host.failed_models(row)
            if bad:
                request.finish, request.error = "error", engine._nonfinite_message(bad, [request.id])
                request.failed_models, request.done_s = bad, now - request.arrival
            else:
                tokens = host.tokens(row)
                self.committed[row] += len(tokens)
                self._extend(request, tokens, None if host.logprobs is None else host.logprobs[row], now)
            if request.finish:
                finished.append(request)
        outputs += [self._increment(r) for r in self.slots if r is not None and r.ready]
        for request in finished:
            self._free(request)
        if finished:
            self._rows_changed()  # a host-to-device copy when a row ends
        state.max_committed = self._max_committed()
        self.plan = [host.plan(row) for row, live in enumerate(self._live()) if live] if host.has_plan else None
        return outputs

    def _step_graphs(self) -> StepGraphs | None:
        """One CUDA graph per step (csd_engine.step_graphs) when the engine asks for it and can:
        native runners on CUDA and a decoder whose step is device work alone (not Pearl's threads)."""
        engine = self.engine
        if engine.cuda_graphs != "step" or engine.device.type != "cuda":
            return None
        if not self.decoder.step_graphs:
            raise ValueError(f"cuda_graphs='step' cannot capture {type(self.decoder).__name__}'s step (its drafter "
                             "runs in a thread of its own): use cuda_graphs=True (graphed forwards) for it")
        if not all(isinstance(r, LlamaRunner) for r in engine.models()):
            return None  # the generic runner crops its caches on the host: steps run eagerly
        limit = engine.max_seq_len + self.decoder.max_tokens_per_forward  # the largest max_committed
        return StepGraphs(self.decoder, len(engine.drafters), limit, CudaCapture(engine.device))

    def _live(self) -> list[bool]:
        """Per row: a request decodes there (admitted, its prompt prefilled)."""
        return [r is not None and r.ready for r in self.slots]

    def _rows_changed(self) -> None:
        """After rows joined or left: the device's `active` mask and the host-known summaries."""
        self.state.active.copy_(torch.tensor(self._live(), device=self.engine.device))
        self._update_hints()
        self.state.max_committed = self._max_committed()

    def _max_committed(self) -> int:
        """The longest committed prefix among the occupied rows (the host-known bound steps key on)."""
        return max((c for c, r in zip(self.committed, self.slots) if r is not None), default=0)

    def _extend(self, request: Request, tokens: list[int], logprobs, now: float) -> None:
        """Append a step's tokens to a request, ending it at a stop token, stop string or its limit."""
        request.first_token_s = request.first_token_s or now - request.arrival
        request.done_s = now - request.arrival
        for i, token in enumerate(tokens):
            request.output.append(token)
            if request.logprobs is not None:
                request.logprobs.append(logprobs[i])
            if token in request.stops:
                request.finish = "stop"
            elif len(request.output) >= request.limit:
                request.finish = "length"
            if request.finish:
                break
        if request.text is not None:
            text = request.text
            text.update(request.output)
            keep = text.stop_at(request.output)
            if keep is None and request.finish:  # the last tokens' text, an incomplete character included
                text.update(request.output, final=True)
                keep = text.stop_at(request.output)
            if keep is not None:
                del request.output[keep:]
                if request.logprobs is not None:
                    del request.logprobs[keep:]
                request.finish = "stop"

    def _increment(self, request: Request) -> RequestOutput:
        """The request's output since its last increment (`request.sent` marks it). With stop
        strings, tokens whose text is not settled yet (IncrementalText.read) wait: a stop string
        their text completes would cut the tokens after it from the result."""
        done = request.finish is not None
        text = request.text
        end = len(request.output) if done or text is None or not text.stop else text.read
        sent, request.sent = request.sent, end
        delta = None if text is None else text.delta(final=done)
        logprobs = None if request.logprobs is None else request.logprobs[sent:end]
        return RequestOutput(request.id, request.output[sent:end], delta, logprobs, done, request.finish,
                             self._result(request) if done else None, request.error)

    def _result(self, request: Request):
        text = None if request.text is None else request.text.text
        metrics = request_metrics(self.state.metrics, request.row, len(request.output), request.forwards,
                                  request.waits, request.done_s, request.first_token_s,
                                  self.model_sizes) if request.ready else None
        return GenerationResult(list(request.output), text, request.finish, metrics, request.logprobs,
                                request.error, request.failed_models)

    def _abort(self) -> tuple[list[RequestOutput], bool]:
        """End the requests `abort` named; returns their outputs and whether a running one left."""
        outputs, freed, waited = [], False, False
        for request_id in self.to_abort:
            request = self.requests.get(request_id)
            if request is None or request.finish:
                continue
            request.finish = "abort"
            if request.row < 0:
                waited = True
                outputs.append(self._increment(request))
                del self.requests[request.id]
            else:
                outputs.append(self._increment(request))
                self._free(request)
                freed = True
        if waited:  # one pass over the queue (removing each was quadratic in a long queue)
            self.waiting = deque(r for r in self.waiting if r.finish is None)
        if self.to_abort:
            self.to_abort = []
            self._rows_changed()
        return outputs, freed

    # -- slots ---------------------------------------------------------------------------------
    def _admit(self) -> bool:
        """Move waiting requests into free slots: reset their rows and prefill every model there
        (a prompt longer than `prefill_chunk` only starts: `_prefill_chunks` goes on with it).
        Returns whether a request became live."""
        free = deque(row for row, r in enumerate(self.slots) if r is None)
        new = []
        while free and self.waiting:
            request = self.waiting.popleft()
            request.row = free.popleft()
            self.slots[request.row] = request
            new.append(request)
        if not new:
            return False
        state, dev = self.state, self.engine.device
        index = torch.tensor([r.row for r in new], device=dev)
        values = lambda f, dtype: torch.tensor([f(r) for r in new], dtype=dtype, device=dev)  # noqa: E731
        state.temperature[index] = values(lambda r: r.params.temperature, torch.float32)
        state.top_k[index] = values(lambda r: r.params.top_k, torch.int32)
        state.top_p[index] = values(lambda r: r.params.top_p, torch.float32)
        state.seed[index] = values(lambda r: _fresh_seed() if r.params.seed is None else fold_seed(r.params.seed),
                                   torch.int64)
        fits = [self.prefill_chunk is None or len(r.prompt) - 1 <= self.prefill_chunk for r in new]
        whole = [r for r, f in zip(new, fits) if f]
        for r in (r for r, f in zip(new, fits) if not f):  # a masked row holding its prompt, cached chunk by chunk
            state.tokens[r.row, :len(r.prompt)] = torch.tensor(r.prompt, device=dev)
            self._prefill(r.row, [], 0)
        lengths = {r.row: len(r.prompt) - 1 for r in whole}
        for lo, hi in (group for run in _runs(sorted(lengths)) for group in _prefill_groups(run, lengths)):
            width = max(len(self.slots[row].prompt) for row in range(lo, hi)) - 1
            block = torch.zeros(hi - lo, width, dtype=torch.int64)
            for row in range(lo, hi):
                prompt = self.slots[row].prompt[:-1]
                block[row - lo] = prompt[0] if prompt else 0  # padding from the row's own prompt: never another
                block[row - lo, :len(prompt)] = torch.tensor(prompt, dtype=torch.int64)  # token's NaN
            for runner in self._cached_models():  # every prompt but its last token, right-padded
                runner.prefill(slice(lo, hi), runner.own_ids(block.to(runner.device)))
        self._go_live(whole)
        return bool(whole)

    def _prefill_chunks(self) -> bool:
        """Go on prefilling long prompts, `prefill_chunk` tokens in all per step (oldest first),
        while the other rows decode; returns whether a request became live."""
        budget = self.prefill_chunk or 0
        done = []
        for request in sorted((r for r in self.slots if r is not None and not r.ready), key=lambda r: r.arrival):
            if budget <= 0:
                break
            start = request.prefilled
            chunk = request.prompt[start:min(start + budget, len(request.prompt) - 1)]
            for runner in self._cached_models():
                runner.prefill(slice(request.row, request.row + 1),
                               runner.own_ids(torch.tensor([chunk], device=runner.device)), start)
            self._prefill(request.row, chunk, start)
            budget -= len(chunk)
            if request.prefilled == len(request.prompt) - 1:
                done.append(request)
        self._go_live(done)
        return bool(done)

    def _cached_models(self) -> list:
        """The target and the drafters whose caches the decoder reads (Decoder.drafters_used):
        the models a prompt is prefilled into."""
        used, models = self.decoder.drafters_used, self.engine.models()
        if used is None:
            return models
        return [models[0], *(m for m in models[1:] if any(m is self.engine.drafters[i] for i in used))]

    def _prefill(self, row: int, chunk: list[int], start: int) -> None:
        """Book a prefilled chunk of a masked row: its committed length and caches end after it."""
        request, end = self.slots[row], start + len(chunk)
        request.prefilled = self.committed[row] = end
        self.state.committed[row] = end
        self.state.max_committed = max(self.state.max_committed, end)
        self.state.pending[row] = request.prompt[end]
        for runner in self._cached_models():
            runner.cache.lengths[row] = end

    def _go_live(self, requests: list) -> None:
        """The prompts of `requests` are cached: their rows start decoding from fresh counters."""
        if not requests:
            return
        state, dev, rows = self.state, self.engine.device, len(self.slots)
        index = torch.tensor([r.row for r in requests], device=dev)
        block = torch.zeros(len(requests), state.tokens.shape[1], dtype=torch.int64)
        for i, r in enumerate(requests):
            block[i, :len(r.prompt)] = torch.tensor(r.prompt)
            self.committed[r.row] = r.prefilled = len(r.prompt) - 1  # the last prompt token is `pending`
            r.ready = True
        state.tokens[index] = block.to(dev)
        state.committed[index] = torch.tensor([len(r.prompt) - 1 for r in requests], device=dev)
        state.pending[index] = torch.tensor([r.prompt[-1] for r in requests], device=dev)
        state.offset[index] = 0
        mask = torch.zeros(rows, dtype=torch.bool, device=dev)
        mask[index] = True
        cached = self._cached_models()
        for runner in self.engine.models():  # a model the decoder does not run holds nothing of these rows
            runner.cache.lengths[index.to(runner.device)] = state.committed[index].to(runner.device) \
                if any(runner is c for c in cached) else 0
            runner.nonfinite_rows.masked_fill_(mask.to(runner.device), False)
        state.metrics.reset_rows(mask)
        self.decoder.admit(state, mask)
        self._rows_changed()

    def _free(self, request: Request) -> None:
        """The request leaves its slot; the next step empties the row (`_empty_freed_rows`)."""
        self.slots[request.row] = None
        self.requests.pop(request.id, None)
        self.freed.append(request.row)

    def _empty_freed_rows(self) -> None:
        """Rows freed since the last step and still free forget their request (committed and
        cache lengths 0), so an idle row never holds the attention bound up or grows, and its
        sampling settings (greedy again): the host-known hints (all_greedy, max_top_k) describe
        the occupied rows, and a kernel told every row is greedy draws nothing for any row. Done
        at the next step, not at once, so that after the last step the caches still show it."""
        rows = [row for row in self.freed if self.slots[row] is None]
        self.freed = []
        if rows:
            index = torch.tensor(rows, device=self.engine.device)
            state = self.state
            state.committed[index] = 0
            state.temperature[index], state.top_k[index], state.top_p[index] = 0.0, 0, 1.0
            for runner in self.engine.models():
                runner.cache.lengths[index.to(runner.device)] = 0

    def _read_plan(self):
        """The decoder's plan rows of the occupied slots (read once in a step that admits), also
        kept on the device for the step (DecodeState.follow_plan)."""
        rows = self.decoder.plan(self.state)
        if rows is None:
            return None
        self.state.follow_plan(rows)
        return [row for row, live in zip(read_host(rows), self._live()) if live]

    def _update_hints(self) -> None:
        """The host-known summaries of the occupied rows' sampling settings."""
        params = [r.params for r in self.slots if r is not None]
        if not params:
            return
        state = self.state
        state.all_greedy = all(p.greedy for p in params)
        state.any_filtered = any(not p.greedy and (p.top_k > 0 or p.top_p < 1) for p in params)
        state.max_top_k = _max_top_k(params)
        state.want_logprobs = any(p.logprobs for p in params)

    def _empty_state(self, rows: int) -> DecodeState:
        dev = self.engine.device
        zeros = lambda dtype: torch.zeros(rows, dtype=dtype, device=dev)  # noqa: E731
        return DecodeState(
            tokens=torch.zeros(rows, self.engine.capacity + 1, dtype=torch.int64, device=dev),  # + scratch
            committed=zeros(torch.int64), pending=zeros(torch.int64), active=zeros(torch.bool),
            temperature=zeros(torch.float32), top_k=zeros(torch.int32),
            top_p=torch.ones(rows, dtype=torch.float32, device=dev),
            seed=zeros(torch.int64), offset=zeros(torch.int64), max_committed=0, all_greedy=True,
            metrics=StepMetrics.zeros(rows, dev, levels=1 + len(self.engine.drafters),
                                      positions=self.decoder.max_tokens_per_forward,
                                      sources=len(self.decoder.sources)))


PREFILL_SLACK = 64  # padding per row a prefill group takes on regardless (short prompts batch together)


def _prefill_groups(run: tuple[int, int], lengths: dict) -> list[tuple[int, int]]:
    """A run of consecutive rows split into groups prefilled as one block each, right-padded to
    the group's longest prompt: a row joins the group while the padding stays under half the
    prompt tokens the group feeds plus PREFILL_SLACK per row, so a long prompt does not make its
    short neighbours prefill its length (the step's time, which is their time to first token,
    and its memory), while short prompts still share one forward (one read of the weights)."""
    groups, lo = [], run[0]
    longest = real = lengths[lo]  # of the group so far: one pass, not a sum per row (thousands admitted at once)
    for row in range(run[0] + 1, run[1]):
        n, grown_longest, grown_real = row + 1 - lo, max(longest, lengths[row]), real + lengths[row]
        if grown_longest * n - grown_real > grown_real / 2 + PREFILL_SLACK * n:
            groups.append((lo, row))
            lo, longest, real = row, lengths[row], lengths[row]
        else:
            longest, real = grown_longest, grown_real
    return groups + [(lo, run[1])]


def _runs(rows: list[int]):
    """Maximal runs of consecutive row indices, as (lo, hi) half-open ranges."""
    if not rows:
        return
    start = prev = rows[0]
    for row in rows[1:]:
        if row != prev + 1:
            yield start, prev + 1
            start = row
        prev = row
    yield start, prev + 1
