"""What every decoding strategy shares: the per-request decoding state, the draft every
drafter returns, and the verify-commit-rollback steps every chain strategy ends with.

The committed sequence of each row lives on the device in `DecodeState.tokens`
([B, capacity + 1]: its last column is scratch, where masked writes go); `pending[b]` is the
last emitted token, which no model has cached yet.
Every model's cache is a prefix of that sequence (`runner.cache.lengths`), so any model can
catch up on what it has not seen by feeding `tokens[b, cache_len:committed] + pending`.

A step is a fixed sequence of device work whose shapes come from host-known values only:
the strategy's configuration and the `plan` the engine read with the previous step's tokens
(what each row asks of this step, e.g. how long its MaG match is). Everything that depends
on the data (accepted counts, per-row draft lengths, which rows still draft) stays on the
device as lengths and masks, so a step reads nothing back (docs: engine docstring).
"""
from dataclasses import dataclass, field, replace

import torch

from csd_engine.checks import is_int
from csd_engine.kernels import use_kernels
from csd_engine.kernels.commit import commit as commit_rows, commit_ref
from csd_engine.kernels.random import stream_seed
from csd_engine.kernels.sampling import processed_ref, top_at_zero
from csd_engine.models.runner import ForwardBatch, Runner

TARGET_STREAM, DRAFT_STREAM = 0, 1  # random streams of the target's checks and of drafters sampling


@dataclass
class Models:
    """What a strategy is given to run: runners, the verifier, sizes (never the Engine)."""

    target: Runner
    drafters: list  # Runner or MaG, largest first
    verifier: object  # csd_engine.verifier.Verifier
    capacity: int  # token slots per row (max_seq_len + headroom)
    device: torch.device
    drafter_device: torch.device
    trim_drafts: bool = False  # the target verifies only up to the longest real draft (verify_chain)
    batch_invariant: bool = False  # a row's logits, and so its strategy's choices, never depend on its neighbours


@dataclass
class DecodeState:
    tokens: torch.Tensor  # [B, capacity + 1] int64: committed tokens of each row (prompt, then output), then scratch
    committed: torch.Tensor  # [B] int64: how many of them are committed (= target cache length)
    pending: torch.Tensor  # [B] int64: last emitted token, not in any cache yet
    active: torch.Tensor  # [B] bool: rows still generating
    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int32
    top_p: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64
    offset: torch.Tensor  # [B] int64: random-number counter of each request
    max_committed: int  # host-side max of committed over rows (exact after each step's read)
    all_greedy: bool  # every row at temperature 0: strategies may skip draft distributions
    any_filtered: bool = True  # some row uses top-k / top-p (host-known: lets drafters skip the cut-off search)
    max_top_k: int | None = None  # largest top_k of a row (host-known: a top-k cut-off without a full sort)
    want_logprobs: bool = False  # some row asked for its tokens' log-probabilities (host-known)
    # host-known: the rows from this one on hold no request, and forwards skip them (the scheduler
    # sets it for eager steps; None: every row is computed, as a step graph's fixed shapes need)
    rows_in_use: int | None = None
    metrics: "StepMetrics | None" = None  # the scheduler allocates it (StepMetrics.zeros)
    plan: torch.Tensor | None = None  # [C, B] int64: the plan the next step follows, by column (follow_plan)
    # what the decoder carries per row from one step to the next (Decoder.start makes it, its
    # step and admit update it); kept with the state, so step graphs read these very tensors
    carried: object = None

    @property
    def batch(self) -> int:
        return self.pending.shape[0]

    def clear(self) -> None:
        """Every row free and every per-row counter zero, in place (step graphs hold these
        tensors): what a new state holds, but the host counts of forwards, which only count up."""
        for per_row in (self.tokens, self.committed, self.pending, self.active, self.temperature, self.top_k,
                        self.seed, self.offset):
            per_row.zero_()
        self.top_p.fill_(1.0)
        self.max_committed, self.all_greedy, self.any_filtered = 0, True, True
        self.max_top_k, self.want_logprobs = None, False
        self.metrics.reset_rows(torch.ones_like(self.active))

    def follow_plan(self, plan: torch.Tensor | None) -> None:
        """Keep `plan` ([B, C], Decoder.plan's) as the plan the next step reads its per-row
        values from, one contiguous [B] row per column, copied in place after the first time:
        a step graph reads this very tensor."""
        if plan is None:
            return
        if self.plan is None or self.plan.shape != plan.shape[::-1]:
            self.plan = plan.t().contiguous()
        else:
            self.plan.copy_(plan.t())

    def sampling_args(self, stream: int | torch.Tensor = 0, seed: torch.Tensor | None = None) -> dict:
        """Per-row arguments of the verification kernels, with an independent random stream
        per `stream` id (an int, or a [B] tensor of per-row ids) or the caller's own stream
        seeds (`seed`, [B]: stream_seed's values, derived ahead), and the host-known hints that
        keep the PyTorch references free of host reads (no value checks on the hot path). An
        all-greedy step draws no random number: its seeds go unmixed (the mix is ~20 kernels)."""
        if seed is None:
            seed = self.seed if self.all_greedy else stream_seed(self.seed, stream)
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                    seed=seed, offset=self.offset, check_values=False,
                    filtered=self.any_filtered, max_top_k=self.max_top_k, all_greedy=self.all_greedy)


@dataclass
class Draft:
    """Draft tokens for one review: a host-known width W, a length per row (0..W)."""

    tokens: torch.Tensor  # [B, W] int64; entries at or past length[b] are padding
    length: torch.Tensor  # [B] int64
    q: torch.Tensor | None = None  # [B, W, V] what each token was drawn from; None: all deterministic (one-hot)

    @classmethod
    def empty(cls, state: "DecodeState") -> "Draft":
        """No draft token for any row: the step decodes one token plainly."""
        tokens = torch.zeros(state.batch, 0, dtype=torch.int64, device=state.pending.device)
        return cls(tokens, torch.zeros_like(state.committed))


@dataclass
class StepOutput:
    tokens: torch.Tensor  # [B, m] int64: tokens emitted this step, left-aligned
    counts: torch.Tensor  # [B] int64: how many of them are real (>= 1 for active rows)
    logprobs: torch.Tensor | None = None  # [B, m] float32 of each token (only when state.want_logprobs)


@dataclass
class StepMetrics:
    """Per-row counters in device tensors allocated once per decode state and only ever added
    to in place (a step replayed as a CUDA graph adds into the same buffers), read once at the
    end; and host counts of forwards."""

    level_accepted: torch.Tensor  # [levels, B] tokens accepted in the reviews at level l (0: the target)
    level_drafted: torch.Tensor  # [levels, B] tokens those reviews were offered
    accepted_by_position: torch.Tensor  # [B, P] the target's accepted count per draft position
    drafted_by_position: torch.Tensor  # [B, P]
    # per top-level cascade source (Source.index), [S, B]: its draft tokens the target accepted, and
    # checked (accepted, or the first rejected one): accepted / checked is the source's per-token rate
    source_accepted: torch.Tensor
    source_checked: torch.Tensor
    # [B] a top-level tree's checks where the target rejected a neural trunk token that had
    # siblings (checked) and took one of them instead (accepted): Cascade.auto()'s sibling rate
    sibling_accepted: torch.Tensor
    sibling_checked: torch.Tensor
    draft_lengths: torch.Tensor | None = None  # [B, L] rounds in which row b offered the target l draft tokens
    levels: set = field(default_factory=set)  # the levels that recorded a review (host-known)
    target_forwards: int = 0
    drafter_forwards: list = field(default_factory=list)  # per drafter level
    wait_time_s: dict = field(default_factory=dict)  # side -> seconds it waited for the other (parallel strategies)

    @classmethod
    def zeros(cls, batch: int, device, levels: int = 1, positions: int = 1, sources: int = 0) -> "StepMetrics":
        """Counters for `batch` rows: `levels` review levels (the target and each drafter),
        `positions` draft positions at the target (a bound on any draft's width), `sources`
        cascade sources."""
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=device)  # noqa: E731
        return cls(z(levels, batch), z(levels, batch), z(batch, positions), z(batch, positions),
                   z(sources, batch), z(sources, batch), z(batch), z(batch))

    def count_drafter(self, drafter: int, n: int = 1) -> None:
        """Count forwards of drafter `drafter` (an index into the engine's drafters)."""
        while len(self.drafter_forwards) <= drafter:
            self.drafter_forwards.append(0)
        self.drafter_forwards[drafter] += n

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Zero the per-row counters of `rows` ([B] bool): a new request takes those rows."""
        for per_row in (self.level_accepted, self.level_drafted, self.source_accepted, self.source_checked):
            per_row.masked_fill_(rows[None, :], 0)
        for per_row in (self.sibling_accepted, self.sibling_checked):
            per_row.masked_fill_(rows, 0)
        for per_position in (self.accepted_by_position, self.drafted_by_position, self.draft_lengths):
            if per_position is not None:
                per_position.masked_fill_(rows[:, None], 0)

    def counters(self, level: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The [B] accepted and drafted counters of the reviews at `level`, for a caller that adds
        to them in place (as `record` does)."""
        self.levels.add(level)
        return self.level_accepted[level], self.level_drafted[level]

    def record_sources(self, origin: torch.Tensor, length: torch.Tensor, accepted: torch.Tensor,
                       active: torch.Tensor, sources) -> None:
        """Per source, the target's verdicts on its tokens in one check: origin [B, W] source
        index of each draft slot, length [B] slots drafted, accepted [B] accepted slots."""
        pos = torch.arange(origin.shape[1], device=origin.device)[None, :]
        live = active[:, None]
        took = live & (pos < accepted[:, None])
        checked = live & (pos <= accepted[:, None]) & (pos < length[:, None])
        for s in sources:
            mine = origin == s
            self.source_accepted[s].add_((took & mine).sum(1))  # add_ on the row: `+=` would copy it back
            self.source_checked[s].add_((checked & mine).sum(1))

    def drafter_counts(self, n_drafters: int) -> list[int]:
        return [self.drafter_forwards[i] if i < len(self.drafter_forwards) else 0 for i in range(n_drafters)]

    def record(self, level: int, accepted: torch.Tensor, drafted: torch.Tensor, active: torch.Tensor | None,
               max_drafted: int = 0) -> None:
        """Per-row accepted/drafted counts of one review at `level` (0 = the target), of the
        `active` rows (None: both counts are already 0 elsewhere). max_drafted: a host-known
        bound on drafted (the per-position counters it touches)."""
        a, d = accepted.to(torch.int64), drafted.to(torch.int64)
        if active is not None:
            a, d = a * active, d * active
        self.levels.add(level)
        self.level_accepted[level].add_(a)  # add_ on the row: `+=` would copy it back (a kernel more)
        self.level_drafted[level].add_(d)
        if level != 0:
            return
        width = max(max_drafted, 1)
        if width > self.accepted_by_position.shape[1]:
            raise ValueError(f"a draft of up to {width} tokens, but the metrics count {self.accepted_by_position.shape[1]} "
                             "positions: allocate StepMetrics with the decoder's max_tokens_per_forward")
        pos = torch.arange(width, device=accepted.device)[None, :]
        self.accepted_by_position[:, :width].add_(pos < a[:, None])
        self.drafted_by_position[:, :width].add_(pos < d[:, None])


class Decoder:
    """What the scheduler calls on a strategy's decoder, each with the default of a decoder that
    needs none of it. A decoder implements `step` and sets `max_tokens_per_forward`."""

    max_tokens_per_forward: int = 1  # the widest target forward a step feeds (cache headroom, position counters)
    sources: tuple = ()  # the draft sources whose verdicts StepMetrics.source_* count, by index
    step_graphs: bool = True  # False: the step is not one stream's device work, never captured
    # the drafters (indexes) whose caches the steps read; the scheduler prefills only these. None: all
    drafters_used: tuple[int, ...] | None = None

    def start(self, state: DecodeState) -> None:
        """Once per scheduler, before any request: the per-row state the decoder carries
        between steps (`state.carried`; a kept state may hold it already) and its metrics."""

    def admit(self, state: DecodeState, rows: torch.Tensor) -> None:
        """New requests took `rows` ([B] bool; their settings are in `state`): forget what the
        decoder kept of theirs, derive what it keeps per request."""

    def plan(self, state: DecodeState) -> torch.Tensor | None:
        """[B, C] int64 per-row values the next step depends on, read by the scheduler with the
        step's tokens (its one host read) for the step's host-known shapes (their column maxima),
        and kept on the device for the step's per-row values (state.plan); None: none needed."""
        return None

    def graph_columns(self, columns: tuple) -> tuple:
        """The plan's column maxima as a step graph's key; a decoder zeroes what its step reads
        from the device only (state.plan), or not at all."""
        return columns

    def step(self, state: DecodeState, plan) -> StepOutput:
        """One decoding step over every row of `state`, given the plan's host rows (or the graph
        key's column maxima when replayed from a graph) and its device copy, state.plan: emit,
        commit, roll back."""
        raise NotImplementedError

    def step_and_plan(self, state: DecodeState, plan) -> tuple[StepOutput, torch.Tensor | None]:
        """The step, then the next step's plan from the state it leaves: what the scheduler runs
        before its one read, so that a step graph holds the plan's work too (none of it is
        launched from Python between graphs). The plan is also kept for the next step (state.plan).
        The step committed up to max_tokens_per_forward tokens per row past the host's
        max_committed, which the plan's work (MaG's search) must still cover."""
        out = self.step(state, plan)
        plan = self.plan(replace(state, max_committed=state.max_committed + self.max_tokens_per_forward))
        state.follow_plan(plan)
        return out, plan


def check_drafter_index(drafter, strategy: str) -> None:
    """At a strategy's construction: `drafter` is an index into engine.drafters."""
    if not is_int(drafter) or drafter < 0:
        raise ValueError(f"{strategy}(drafter=...) must be an int >= 0 (an index into engine.drafters), "
                         f"got {drafter!r}")


def require_one_device(models: Models, strategy: str) -> None:
    """Strategies other than Pearl run every model on the engine's device."""
    if models.drafter_device != models.device:
        raise ValueError(f"{strategy} runs the drafters on the target's device, but this engine puts them on "
                         f"{models.drafter_device} (target: {models.device}); a separate drafter_device is for "
                         "Pearl, whose two sides run concurrently")


def require_trees(models: Models, strategy: str, drafters: tuple = ()) -> None:
    """Strategies that verify token trees: the target (and the drafters at these indices, which
    draft trees) must compute a tree's nodes as plain decoding would (Runner.tree_limit)."""
    for role, runner in [("target", models.target)] + [(f"drafter {i}", models.drafters[i]) for i in drafters]:
        if getattr(runner, "tree_limit", None):
            raise ValueError(f"{strategy} checks token trees, which the engine's {role} cannot compute exactly: "
                             f"{runner.tree_limit}; use a chain strategy with it (Speculative, Cascade without a "
                             "tree, Pearl)")


def catch_up_tokens(state: DecodeState, runner: Runner, max_behind: int, extra: torch.Tensor | None = None):
    """What `runner` has not cached yet, per row, right-padded: tokens[cache_len:committed],
    then `pending`, then the `extra` block ([B, e]) if given. `max_behind` is a host-known
    bound on committed - cache_len (the caller knows it without a device sync).
    Returns (input_ids [B, max_behind + 1 + e], real counts [B]). Padding repeats `pending`;
    it lands beyond the row's committed length and is overwritten later."""
    lengths = runner.cache.lengths
    behind = state.committed - lengths
    e = 0 if extra is None else extra.shape[1]
    col = torch.arange(max_behind + 1 + e, device=lengths.device)[None, :]
    from_history = torch.gather(state.tokens, 1, (lengths[:, None] + col).clamp(max=state.tokens.shape[1] - 1))
    ids = torch.where(col < behind[:, None], from_history, state.pending[:, None])
    if extra is not None:
        k = (col - behind[:, None] - 1).clamp(0, e - 1)
        in_extra = (col > behind[:, None]) & (col <= behind[:, None] + e)
        ids = torch.where(in_extra, torch.gather(extra, 1, k), ids)
    return ids, behind + 1 + e


def forward_tokens(runner: Runner, state: DecodeState, ids: torch.Tensor, ahead: int = 0, need_logits: bool = True,
                   flag_all: bool = True):
    """One forward of `ids` right after each row's cached prefix (chain positions).
    `ahead`: how many slots past the committed prefix the runner's cache may already hold
    (drafters mid-draft); it bounds the attention span without reading lengths on the host.
    flag_all=False: the caller flags the non-finite logits it uses (ForwardBatch.flag_all)."""
    bound = state.max_committed + ahead + ids.shape[1]
    return runner(ForwardBatch.chain(ids, runner.cache.lengths, bound, need_logits, flag_all, state.rows_in_use))


def logits_at(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """logits[b, index[b]] for every row: [B, V]."""
    return logits[torch.arange(logits.shape[0], device=logits.device), index]


def emitted_block(drafts: torch.Tensor, num_accepted: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
    """[B, k+1]: the accepted drafts of each row followed by its correction / bonus token
    (entries after that are padding)."""
    col = torch.arange(drafts.shape[1] + 1, device=drafts.device)[None, :]
    padded = torch.cat([drafts, next_token[:, None]], dim=1)
    return torch.where(col == num_accepted[:, None], next_token[:, None], padded)


def emitted_logprobs(state: DecodeState, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor | None:
    """[B, m] log-probability of each emitted token under the target's processed distribution at
    its position (what the verifier sampled from: temperature, top-k, top-p; the raw model's for a
    greedy row); `logits` [B, m, V] aligned with `tokens` [B, m]. None unless a row asked."""
    if not state.want_logprobs:
        return None
    b, m, vocab = logits.shape
    per_token = lambda t: t.repeat_interleave(m)  # noqa: E731
    logits = logits if state.all_greedy else top_at_zero(logits, state.temperature)  # as the verifier samples
    z, threshold, lse = processed_ref(logits.reshape(b * m, vocab), per_token(state.temperature),
                                      per_token(state.top_k), per_token(state.top_p),
                                      filtered=state.any_filtered, max_top_k=state.max_top_k)
    chosen = z.gather(1, tokens.reshape(-1, 1))[:, 0]
    return torch.where(chosen >= threshold, chosen - lse, float("-inf")).view(b, m)


def verify_chain(models: Models, state: DecodeState, draft: Draft, counters: int) -> tuple[StepOutput, torch.Tensor]:
    """The target checks `draft` in one forward over [pending, draft] and its cache keeps
    pending and the accepted drafts. Returns (what the step emits, accepted counts [B]).
    `counters`: random counters the step consumes in all (the offset moves past them)."""
    if models.trim_drafts and draft.tokens.shape[1]:  # Autoregressive's empty draft: nothing to trim
        draft = trimmed(draft)
    ids = torch.cat([state.pending[:, None], draft.tokens], 1)
    logits = forward_tokens(models.target, state, ids, flag_all=False)
    res = models.verifier.chain(logits, draft.tokens, draft.length, draft.q, lenience=1.0,
                                **state.sampling_args(TARGET_STREAM))
    accepted = res.num_accepted
    models.target.flag_used_logits(logits, counts=accepted + 1)  # what plain decoding computes: not past a rejection
    models.target.cache.advance((accepted + 1) * state.active)
    state.offset += counters
    state.metrics.target_forwards += 1
    state.metrics.record(0, accepted, draft.length, state.active, draft.tokens.shape[1])
    tokens = emitted_block(draft.tokens, accepted, res.next_token)
    return StepOutput(tokens, accepted + 1, emitted_logprobs(state, logits, tokens)), accepted


def trimmed(draft: Draft) -> Draft:
    """`draft` cut to its longest row. A named host read, for the CPU (Engine.trim_drafts):
    there a read costs nothing and a forward's cost grows with its width, while a draft's
    host-known width is its bound (masked rows, a MaG match shorter than its budget)."""
    width = int(draft.length.max())
    return Draft(draft.tokens[:, :width], draft.length, None if draft.q is None else draft.q[:, :width])


def roll_back_drafters(drafters, length: torch.Tensor) -> None:
    """Every neural drafter keeps at most `length[b]` cached slots of row b (MaG has no cache)."""
    for drafter in drafters:
        if isinstance(drafter, Runner):
            drafter.cache.rollback(length)


def commit(state: DecodeState, out: StepOutput) -> None:
    """Append [pending, emitted[:-1]] to each active row's committed sequence, in place; the
    last emitted token becomes pending (and is written after the prefix, so that a MaG query over
    tokens[:committed + 1] ends with it). Every step ends with it (inside the step, so that the
    next step's plan can be computed from the committed sequence). One launch on a GPU."""
    run = commit_rows if use_kernels(state.pending) else commit_ref
    run(state.tokens, state.committed, state.pending, out.tokens, out.counts, state.active)
