"""Cascade Speculative Drafting (docs/algorithms.md: Lenience, The K matrix): vertical and
horizontal cascade, compiled into a fixed plan of rounds (cascade_plan.py).

Glossary:
* working sequence: per row, tokens[:committed] + pending + the draft being built, in
  `state.tokens`; every model's cache is a prefix of it and rolls back by length.
* review: a neural drafter checks the tokens its sub-cascade appended (chain verification
  with lenience l); the working sequence keeps what it accepted plus its correction / bonus.
* emitted distribution e: what a review's tokens were drawn from (exactly computable, with
  lenience); the level above uses e, never the raw drafter distribution, as their proposal
  q. That is what keeps every level lossless at any temperature; the target reviews with
  l = 1, so the output follows the target exactly.
* budget: per row and source, how many tokens the source adds (K's entry, or less: a row
  whose next MaG match is at least `direct_match` tokens long sends up to `direct_tokens` of
  MaG's tokens straight to the target and skips the neural levels).
* plan: per row, what the next step needs (how far each drafter's cache trails the committed
  prefix, its budget and cap of each source, the draft width it may fill, whether it goes
  direct, whether its draft is checked as a tree), computed at the end of the step before and
  read with its tokens: its maxima fix the host-known widths and review rounds of the next
  step (none for a level no row uses; the target reads no wider than the widest row needs;
  a tree only where some row wants one), and the step takes its per-row budgets from the
  plan's device copy (state.plan), never pricing them twice.

Tree at the top level (`tree=(b_1, b_2, ...)`): the target verifies the draft as the trunk of
a token tree with b_d - 1 extra children at depth d: the most likely other tokens of the last
neural review that scored that position with an all-accepted prefix. Such a child is a
function of the prefix alone (a deterministic child of the tree rule): lossless at any
temperature. After a branch wins, every drafter rolls back to where the path left the trunk.
A row whose plan says no tree (Cascade.auto() chooses per row) has its siblings masked out; a
step where no row wants one verifies a chain.

Random numbers: a row's review r at drafter d draws from stream 1 + 1024 (d + 1) + r, r
counted per row, so a row's tokens never depend on what else shares the batch. The seeds of
every review a step can run are derived once per request, when it is admitted, and carried
in the state (`state.carried`: neural drafter -> [B, reviews per step]).
"""
from dataclasses import dataclass

import torch

from csd_engine.checks import is_int
from csd_engine.drafters.mag import MaG
from csd_engine.kernels import use_kernels
from csd_engine.kernels.random import stream_seed
from csd_engine.kernels.review import review_bookkeeping, review_bookkeeping_ref
from csd_engine.kernels.sampling import one_hot
from csd_engine.models.runner import ForwardBatch
from csd_engine.ops import PADDING, ROOT
from csd_engine.strategies.base import (DecodeState, Decoder, Draft, Models, StepOutput, commit,
                                        require_one_device, require_trees, roll_back_drafters, verify_chain)
from csd_engine.strategies.cascade_plan import Level, Source, budgets_from_k, compile_plan, draft_bound
from csd_engine.strategies.tree import TreeShape, verify_tree_and_commit


def _reviews_per_step(level: Level) -> int:
    """Host bound on the reviews one row has in a step of this plan (any drafter's)."""
    return sum(s.calls * (1 + _reviews_per_step(s.below)) for s in level.sources if s.below is not None)


def _check_k_entries(rows) -> None:
    """K's own rules, whatever the engine: square, non-negative integers, upper-triangular."""
    if any(len(r) != len(rows) for r in rows):
        raise ValueError(f"K matrix must be square (n x n for n drafters, largest first); got {len(rows)} rows of "
                         f"lengths {[len(r) for r in rows]}")
    for i, r in enumerate(rows):
        for j, v in enumerate(r):
            if isinstance(v, bool) or not isinstance(v, int) and not (isinstance(v, float) and v.is_integer()):
                raise ValueError(f"K[{i}][{j}]={v!r}: entries must be non-negative integers")
            if v < 0:
                raise ValueError(f"K[{i}][{j}]={v}: entries must be non-negative integers")
            if j < i and v != 0:
                raise ValueError(f"K[{i}][{j}]={v}: K must be upper-triangular (entries below the diagonal are 0)")


def _validate_k_matrix(rows, n_drafters: int, is_mag: list[bool]) -> tuple[tuple[int, ...], ...]:
    """K (entries checked by Cascade) against the engine's drafters."""
    n = n_drafters
    if len(rows) != n:
        raise ValueError(f"K matrix must be {n}x{n} (one row and column per drafter, largest first); "
                         f"got {len(rows)}x{len(rows)}")
    rows = [[int(v) for v in r] for r in rows]
    if sum(rows[0]) == 0:
        raise ValueError("K row 0 sums to 0: the target would never receive a draft")
    for i in range(n):
        if is_mag[i] or not any(rows[r][i] for r in range(i + 1)):
            continue  # MaG needs no drafts; an unused drafter needs none either
        if i == n - 1 or sum(rows[i + 1][i + 1:]) == 0:
            raise ValueError(f"drafter {i} is neural but K[{i + 1}][{i + 1}:] gives it nothing to review: a level "
                             "that can never make progress (neural drafters only review drafts from below; "
                             "end the cascade with MaG)")
    return tuple(tuple(r) for r in rows)


def check_settings(owner: str, lenience, mag_tokens, direct_match, direct_tokens) -> None:
    """The settings Cascade and Cascade.auto() share; `owner` names the strategy in the error."""
    if isinstance(lenience, bool) or not isinstance(lenience, (int, float)) or not 1 <= lenience < float("inf"):
        raise ValueError(f"{owner}(lenience=...) must be a number >= 1, got {lenience!r}")
    if not is_int(mag_tokens) or mag_tokens < 1:
        raise ValueError(f"{owner}(mag_tokens=...) must be an int >= 1, got {mag_tokens!r}")
    if not is_int(direct_match) or direct_match < 0:
        raise ValueError(f"{owner}(direct_match=...) must be an int >= 0 (0 = never), got {direct_match!r}")
    if not is_int(direct_tokens) or direct_tokens < 1:
        raise ValueError(f"{owner}(direct_tokens=...) must be an int >= 1, got {direct_tokens!r}")


def checked_tree(tree, name: str) -> tuple:
    """A top-level tree's candidates per depth as a tuple; `name` says whose (in the error)."""
    if not isinstance(tree, (tuple, list)) or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1
                                                      for b in tree):
        raise ValueError(f"{name} must be a tuple of ints >= 1 (candidates per depth, trunk token included, "
                         f"e.g. (3, 2)), got {tree!r}")
    return tuple(tree)


def check_tree_fits(tree: tuple, name: str, models: Models, neural: bool) -> None:
    """A top-level tree needs a neural drafter (its siblings are a neural review's most likely
    tokens) and no more candidates than the vocabulary has tokens."""
    if tree and not neural:
        raise ValueError(f"{name} needs a neural drafter: the extra children are a neural review's most likely "
                         "tokens (MaG proposes one token per position)")
    if tree and max(tree) > models.target.vocab_size:
        raise ValueError(f"{name}={tree} asks for more candidates than the vocabulary has tokens")
    if tree:
        require_trees(models, name)


@dataclass(frozen=True)
class Cascade:
    """k_matrix: n x n for the engine's n drafters (largest first, optionally ending in MaG).
    lenience >= 1 relaxes reviews by drafters (never the target's). mag_tokens: how many
    tokens MaG proposes per call. tree: candidates per depth at the top level (trunk token
    included), e.g. (3, 2); () verifies a plain chain. direct_match: a row whose next MaG match
    is at least this long sends MaG's tokens straight to the target (0 = never), up to
    direct_tokens of them (what MaG copies: a long verbatim match is verified in one forward)."""

    k_matrix: tuple = ((4,),)
    lenience: float = 1.0
    mag_tokens: int = 10
    tree: tuple = ()
    direct_match: int = 8
    direct_tokens: int = 16

    def __post_init__(self):
        check_settings("Cascade", self.lenience, self.mag_tokens, self.direct_match, self.direct_tokens)
        rows = self.k_matrix.tolist() if isinstance(self.k_matrix, torch.Tensor) else self.k_matrix
        if not isinstance(rows, (list, tuple)) or not rows or not all(isinstance(r, (list, tuple)) for r in rows):
            raise ValueError(f"k_matrix must be a square list of lists of non-negative ints, got {self.k_matrix!r}")
        _check_k_entries(rows)
        object.__setattr__(self, "k_matrix", tuple(tuple(r) for r in rows))
        object.__setattr__(self, "tree", checked_tree(self.tree, "Cascade.tree"))

    @staticmethod
    def auto(**kwargs):
        """A cascade whose rows choose their own drafts from counted acceptance and a fixed cost
        table (csd_engine.strategies.cascade_auto)."""
        from csd_engine.strategies.cascade_auto import AutoCascade
        return AutoCascade(**kwargs)

    def decoder(self, models: Models):
        if not models.drafters:
            raise ValueError("Cascade needs at least one drafter (e.g. drafters=['mag'])")
        require_one_device(models, "Cascade")
        is_mag = [isinstance(d, MaG) for d in models.drafters]
        k = _validate_k_matrix(self.k_matrix, len(models.drafters), is_mag)
        check_tree_fits(self.tree, "Cascade.tree", models, neural=not all(is_mag))
        return CascadeDecoder(models, compile_plan(k, is_mag, self.mag_tokens), float(self.lenience),
                              self.mag_tokens, self.tree, self.direct_match, self.direct_tokens)


@dataclass
class Working:
    """What one step's drafting works on, beside `state` (explicit, rebuilt every step)."""

    base: torch.Tensor  # [B] first draft slot: committed + 1
    budgets: list  # per source (Source.index): [B] tokens each row asks of it
    mag_caps: list  # per source (Source.index): [B] tokens one MaG call may add to a row (None: neural)
    q: torch.Tensor | None  # [B, max_width + 1, V] proposal of each draft slot, then a scratch slot (None: all greedy)
    reviews: torch.Tensor  # [B] reviews each row had this step (its random stream ids)
    seeds: dict | None  # neural drafter -> [B, reviews per step] its reviews' stream seeds (None: all greedy)
    lag: int  # host bound on how far a drafter's cache trails the committed prefix at step start
    rounds: dict  # neural source index -> review rounds this step (the largest budget of an active row)
    width: int  # host bound on this step's draft (the widest active row's plan)
    tree: bool  # host: some active row's draft is checked as a top-level tree
    alt: torch.Tensor | None = None  # [B, depths, top] tree candidates per depth, -1 unknown
    origin: torch.Tensor | None = None  # [B, max_width + 1] source index of each draft slot (when tracked), scratch last


class CascadeDecoder(Decoder):
    track_sources = False  # count the target's verdicts per top-level source (StepMetrics.source_*, sibling_*)
    chooses_tree = False  # each row's plan says whether its draft is checked as a tree (else every row's is)
    reads_proposal = False  # budgets weigh MaG's proposal at the committed end (computed even without direct rows)

    def __init__(self, models: Models, plan: Level, lenience: float, mag_tokens: int, tree: tuple = (),
                 direct_match: int = 0, direct_tokens: int = 16):
        self.models = models
        # 0, 1, 2, ...: slices stand in for torch.arange, which launches a kernel per call on a GPU
        self.offsets = torch.arange(models.capacity + 1, device=models.device)
        # the token buffer's scratch column as a device scalar: `where` with a Python number
        # first launches a kernel that makes one
        self.scratch_column = torch.tensor(models.capacity, device=models.device)
        self.levels = plan
        self.sources = plan.all_sources()
        self.neural = sorted({s.drafter for s in self.sources if s.below is not None})
        self.drafters_used = tuple(self.neural)  # a drafter K gives no tokens to is never run: no prefill
        self.mag = next((d for d in models.drafters if isinstance(d, MaG)), None)
        self.lenience = lenience
        self.mag_tokens = mag_tokens
        self.max_draft = plan.max_growth
        mag_on_top = any(s.below is None for s in plan.sources)
        self.direct_match = direct_match if mag_on_top and self.neural else 0
        self.direct_tokens = direct_tokens
        # the widest draft any step may verify (buffers, random counters and cache headroom)
        self.max_width = max(self.max_draft, direct_tokens if self.direct_match else 0)
        self.tree = tree[:self.max_width]
        self.extra = sum(b - 1 for b in self.tree)  # tree nodes beside the trunk
        self.max_tokens_per_forward = self.max_width + 2 + self.extra
        # per trunk depth d (index d - 1): the tree gives it siblings; False past the tree
        self.sibling_at = torch.tensor([d < len(self.tree) and self.tree[d] > 1 for d in range(self.max_width + 1)],
                                       device=models.device)
        self.top_neural = torch.tensor([s.index for s in plan.sources if s.below is not None], dtype=torch.int64,
                                       device=models.device)
        self.layouts = {w: self._tree_layout(w, models.device) for w in range(1, self.max_width + 1)} \
            if self.tree else {}
        self.scratch_slot = torch.tensor(self.max_width, device=models.device)  # work.q's and origin's last slot
        reviews = _reviews_per_step(plan)  # stream ids of each drafter's reviews 0, 1, ... in a step
        self.review_streams = {d: torch.arange(reviews, device=models.device) + 1 + 1024 * (d + 1) for d in self.neural}
        n, count = len(models.drafters), len(self.sources)
        self.width_column = count  # in the plan's columns after the lags: budgets, width, caps, direct, tree
        self.key_columns = [True] * n + [s.below is not None for s in self.sources] + [True] + [False] * (count + 1) \
            + [True]
        self._k_rows = {}  # batch size -> _k_tail's two constant rows

    def start(self, state: DecodeState) -> None:
        """The review seeds' buffers (state.carried), unless the state kept for a later scheduler
        holds them: the step graphs it replays read these very tensors."""
        if state.carried is None:
            state.carried = {d: torch.zeros(state.batch, len(streams), dtype=torch.int64, device=streams.device)
                             for d, streams in self.review_streams.items()}

    def admit(self, state: DecodeState, rows: torch.Tensor) -> None:
        """The admitted rows' review seeds, from their request seeds (in place: a step graph reads them)."""
        for d, streams in self.review_streams.items():
            seeds = state.carried[d]
            seeds.copy_(torch.where(rows[:, None], stream_seed(state.seed[:, None], streams[None, :]), seeds))

    # -- the plan each step reads ---------------------------------------------------------------
    def plan(self, state: DecodeState) -> torch.Tensor:
        """[B, drafters + 2 sources + 3]: per row, how far each drafter's cache trails the
        committed prefix (0 for MaG); its budget of each source (for a neural one also the
        review rounds enough for the row: a review adds at least one token; 0 when the row goes
        direct or drafts nothing); the widest draft it can fill (a direct row: MaG's proposal
        length; any other: the bound of its own budgets, below the plan's where Cascade.auto
        lowers a budget, so the target never reads the envelope's masked width); the most
        tokens one call of each MaG source adds to it (0 for a neural one); whether it goes
        direct; whether its draft is checked as a tree. The step reads the lags, neural budgets,
        width and tree as host maxima (the graph key, graph_columns), the rest on the device
        only (state.plan)."""
        lag = [state.committed - d.cache.lengths if not isinstance(d, MaG) else torch.zeros_like(state.committed)
               for d in self.models.drafters]
        direct, ready = self._direct(state)
        if self.reads_proposal:  # budgets priced from what MaG holds now: computed every step
            tail = self._tail(*self.plan_budgets(state, direct, ready), direct, ready)
        else:  # K's budgets depend on the row's direct flag alone: a selection (a few launches, not ~40)
            tail = self._k_tail(state, direct)  # not written to: with no direct rows, the constant itself
            if ready is not None:  # a direct row's width is its proposal's length
                w = self.width_column
                width = torch.where(direct, ready, tail[:, w])
                tail = torch.cat([tail[:, :w], width[:, None], tail[:, w + 1:]], 1)
        return torch.cat([torch.stack(lag, 1), tail], 1)

    def _tail(self, budgets: list, caps: list, tree: torch.Tensor | None, direct: torch.Tensor,
              ready: torch.Tensor | None) -> torch.Tensor:
        """The plan's columns after the lags, from per-source budgets and caps and the rows that
        want a tree (None: every row, if the cascade has one) (plan())."""
        width = draft_bound(self.levels, budgets, self.mag_tokens)
        width = width if ready is None else torch.where(direct, ready, width)
        caps = [torch.zeros_like(width) if cap is None else cap for cap in caps]
        tree = torch.full_like(width, int(bool(self.tree))) if tree is None else tree.long()
        return torch.stack(budgets + [width] + caps + [direct.long(), tree], 1)

    def _k_tail(self, state: DecodeState, direct: torch.Tensor | None) -> torch.Tensor:
        """[B, plan columns after the lags] of K's budgets: a row that drafts by K, or a direct row
        (its width still K's; direct None: no row can go direct). Both rows are device constants
        made once per batch size, when a plan is first computed: the scheduler does that eagerly,
        before any step graph."""
        if state.batch not in self._k_rows:
            if state.pending.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("cascade budgets first asked inside a CUDA graph capture: call plan() first")
            budgets = budgets_from_k(self.levels, state.batch, state.pending.device)
            caps = [None if s.below is not None else torch.full_like(budgets[s.index], self.mag_tokens)
                    for s in self.sources]
            direct_budgets, direct_caps = list(budgets), list(caps)
            for s in self.sources:
                if s.below is not None:
                    direct_budgets[s.index] = torch.zeros_like(budgets[s.index])
                elif s in self.levels.sources:
                    direct_budgets[s.index] = torch.ones_like(budgets[s.index])
                    direct_caps[s.index] = torch.full_like(caps[s.index], self.direct_tokens)
            no = torch.zeros_like(budgets[0], dtype=torch.bool)
            self._k_rows[state.batch] = (self._tail(budgets, caps, None, no, None),
                                         self._tail(direct_budgets, direct_caps, None, ~no, None))
        by_k, when_direct = self._k_rows[state.batch]
        return torch.where(direct[:, None], when_direct, by_k) if self.direct_match else by_k

    def graph_columns(self, columns: tuple) -> tuple:
        """The plan's column maxima as a step graph's key: the lags, the neural sources' budgets
        (review rounds) and the width; the rest the step reads on the device. The drafters'
        lags are 0 in a step without reviews (nothing reads them there; they grow every step a
        drafter sits out). Not rounded up: a wider catch-up feed could write past the cache's
        headroom for a row near max_seq_len."""
        key = tuple(c if keep else 0 for c, keep in zip(columns, self.key_columns))
        n = len(self.models.drafters)
        return key if any(key[n:n + len(self.sources)]) else (0,) * n + key[n:]

    def _direct(self, state: DecodeState) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """([B] bool: the row goes direct, [B] int64: the length of MaG's proposal (up to
        direct_tokens) at the committed end), both None where nothing needs them: no direct
        rows and no budgets that read the proposal, `reads_proposal`."""
        if not self.direct_match and not self.reads_proposal:
            return None, None
        end = state.committed + 1
        proposal = self.mag.propose(state.tokens, end, end, self.direct_tokens, state.max_committed + 1)
        direct = proposal.match >= self.direct_match if self.direct_match else torch.zeros_like(state.active)
        return direct, proposal.length

    def k_budgets(self, state: DecodeState, direct: torch.Tensor) -> tuple[list, list]:
        """Per source and row, the tokens K asks, and for MaG sources the most tokens one call
        adds (mag_tokens; None for a neural source); a direct row asks nothing of its neural
        sources and one MaG call at the top, whose proposal (up to its cap, direct_tokens) is the
        whole draft: the same tokens the plan measured, however wide the step."""
        return self._budget_columns(self._k_tail(state, direct).t())

    def plan_budgets(self, state: DecodeState, direct: torch.Tensor, ready: torch.Tensor | None):
        """(budgets, caps, the rows that want a tree; None: every row) for a plan that weighs
        MaG's proposal lengths `ready` (reads_proposal: Cascade.auto)."""
        raise NotImplementedError

    def _budget_columns(self, columns) -> tuple[list, list]:
        """(budgets, caps) per source from the plan's columns after the lags (rows of [C, B])."""
        caps = columns[self.width_column + 1:]
        return ([columns[s.index] for s in self.sources],
                [None if s.below is not None else caps[s.index] for s in self.sources])

    # -- the step ------------------------------------------------------------------------------
    def step(self, state: DecodeState, plan) -> StepOutput:
        budgets, caps = self._budget_columns(state.plan[len(self.models.drafters):])  # the plan's, per row
        work = self._working(state, plan, budgets, caps)
        length = self._draft(state, work, self.levels, work.base, state.active, grown=0)
        q = None if work.q is None else work.q[:, :work.width]
        draft = Draft(self._window(state, work.base, work.width), (length - work.base).clamp(max=work.width), q)
        if work.tree:
            out, trunk = self._verify_tree(state, work, draft)
        else:
            out, trunk = verify_chain(self.models, state, draft, counters=self.max_width + 2)
        if work.origin is not None:  # the counts Cascade.auto() prices from
            self._record_verdicts(state, work, budgets, draft, trunk, out)
        roll_back_drafters(self.models.drafters, work.base + trunk)
        commit(state, out)
        return out

    def _working(self, state: DecodeState, plan, budgets, caps) -> Working:
        b, dev = state.batch, state.pending.device
        columns = [max(column) for column in zip(*plan)]  # over the active rows (a graph: its key)
        n = len(self.models.drafters)
        rounds = {s.index: columns[n + s.index] for s in self.sources if s.below is not None}
        width = max(1, min(columns[n + self.width_column], self.max_width))
        tree = bool(self.tree) and columns[-1] > 0
        # one slot more than the widest draft: the scratch slot of entries not written (_write)
        q = None if state.all_greedy else torch.zeros(b, self.max_width + 1, self.models.target.vocab_size,
                                                      dtype=torch.float32, device=dev)
        alt = torch.full((b, len(self.tree), max(self.tree)), -1, dtype=torch.int64, device=dev) if tree else None
        origin = torch.full((b, self.max_width + 1), -1, dtype=torch.int64, device=dev) if self.track_sources else None
        seeds = None if state.all_greedy else state.carried
        return Working(state.committed + 1, budgets, caps, q, torch.zeros(b, dtype=torch.int64, device=dev), seeds,
                       max(columns[:n]), rounds, width, tree, alt, origin)

    def _draft(self, state, work: Working, level: Level, length, rows, grown: int):
        """Grow the working sequence of `rows` (mask) by `level`'s sources, each up to its row's
        budget, in host-known rounds (on the CPU, where Models.trim_drafts reads the device, a
        neural source's rounds end once no row needs more). Returns the new lengths; `grown`
        bounds length - base on entry (host-known, for the forward widths). Lengths are never
        changed in place."""
        goal = length
        for source in level.sources:
            goal = goal + work.budgets[source.index]
            for call in range(min(source.calls, work.rounds.get(source.index, source.calls))):
                if source.below is None:  # MaG's kernel picks the rows short of their goal itself
                    m = work.width if level is self.levels else self.mag_tokens
                    length = self._mag_append(state, work, source, length, rows, goal, m)
                    grown += m
                else:
                    need = (length < goal) & rows
                    if self.models.trim_drafts and not bool(need.any()):  # a named host read, as _review's
                        break  # trim: no row needs more of this source (the device path runs it masked)
                    sub = self._draft(state, work, source.below, length, need, grown)
                    # after its first call the drafter's cache holds every row's sequence but its
                    # last token (its sub-cascade holds lower drafters only): its trail is 1
                    trail = 1 if call else work.lag + grown + 1
                    length = self._review(state, work, source, length, sub, need, trail)
                    grown += source.below.max_growth + 1
        return length

    def _mag_append(self, state, work: Working, source: Source, length, rows, goal, m: int):
        """MaG proposes up to m tokens after the working sequence of each row in `rows` short of
        its `goal` and writes them in place (one launch on a GPU), at most the row's cap for this
        source (work.mag_caps); their q is one-hot."""
        proposal, end = self.mag.extend(state.tokens, length, work.base, m, state.max_committed + 1,
                                        work.mag_caps[source.index], rows, goal)
        if work.q is not None or work.origin is not None:
            slot = length[:, None] + self.offsets[:m]
            self._note(work, source, slot, proposal.tokens, slot < end[:, None], None)
        return end

    def _review(self, state, work: Working, source: Source, mark, sub_len, need, trail: int):
        """Drafter `source.drafter` reviews the tokens [mark, sub_len) its sub-cascade proposed;
        the working sequence keeps the accepted ones plus its correction / bonus (rows in
        `need` only; the others review nothing and change nothing). `trail`: host bound on how
        far the drafter's cache trails `mark` (the forward's width is trail + the draft's bound);
        1 says every row's cache ends at mark - 1 (a later review), so the forward's logits and
        tokens are already in place. Afterwards its cache holds every row's sequence but the last token."""
        model = self.models.drafters[source.drafter]
        width = source.below.max_growth  # host bound on sub_len - mark
        drafted = sub_len - mark  # 0 for rows not in need: their sub-cascade grew nothing
        if trail != 1:  # recompute the logits at the last token before the draft (a later review's
            model.cache.rollback(mark - 1)  # cache ends there already)
        feed_from = model.cache.lengths  # not a copy: read before the reset below
        fed = trail + width  # host bound on sub_len - feed_from
        if self.models.trim_drafts:  # a named host read, as base.trimmed: feed only what some row has
            # read with it, free: whether some row's cache is not where trail == 1 says it is
            needed, off = torch.stack([(sub_len - feed_from).max(), (feed_from != mark - 1).any()]).tolist()
            if needed > fed or (trail == 1 and off):  # a wrong bound would leave cache slots never computed
                raise RuntimeError(f"cascade review: drafter {source.drafter}'s cache trails by up to {needed} "
                                   f"tokens, past the plan's bound {fed} (trail {trail})")
            fed = max(1, needed)
            width = min(width, fed - 1)  # every row's draft fits: drafted <= needed - 1
        cols = feed_from[:, None] + self.offsets[None, :fed]  # the fed tokens' positions
        ids = torch.gather(state.tokens, 1, cols.clamp(max=state.tokens.shape[1] - 1))
        bound = min(state.max_committed + 1 + self.max_width + fed, self.models.capacity)
        logits = model(ForwardBatch(ids, cols, bound, rows=state.rows_in_use))
        if trail == 1:  # every row fed from mark - 1: the logits and drafts are in place
            logits, drafts = logits[:, :width + 1], ids[:, 1:width + 1]
        else:  # the logits at mark-1 .. mark-1+width, the tokens mark .. mark+width-1 (past sub_len: padding)
            rel = ((mark - 1 - feed_from)[:, None] + self.offsets[None, :width + 1]).clamp(0, fed - 1)
            logits = logits.gather(1, rel[:, :, None].expand(-1, -1, logits.shape[2]))
            drafts = ids.gather(1, rel[:, 1:])
        q = None if work.q is None else self._q_at(work, mark, width)
        seed = None if work.seeds is None else work.seeds[source.drafter].gather(1, work.reviews[:, None])[:, 0]
        res = self.models.verifier.chain(logits, drafts, drafted, q, lenience=self.lenience,
                                         **state.sampling_args(seed=seed))
        if work.seeds is not None:
            work.reviews += need
        accepted = res.num_accepted  # 0 where drafted is (rows not in need)
        state.metrics.count_drafter(source.drafter)
        # new_mark = mark + accepted + need; the cache keeps new_mark - 1 (every row was fed up to
        # sub_len >= mark + accepted); at: the correction's slot, the scratch column where not in need.
        # Without draft distributions or origins to record, the accepted tokens are in place: only
        # the correction is written
        in_place = work.q is None and work.origin is None
        bookkeeping = review_bookkeeping if use_kernels(accepted) else review_bookkeeping_ref
        new_mark, at = bookkeeping(mark, accepted, drafted, need, model.cache.lengths,
                                   *state.metrics.counters(source.drafter + 1), state.tokens, self.models.capacity,
                                   res.next_token if in_place else None)
        if not in_place:
            e = None if work.q is None else self.models.verifier.emitted_distribution(
                logits, drafts, drafted, q, state.temperature, state.top_k, state.top_p, self.lenience, res,
                check_values=False)
            keep = need[:, None] & (self.offsets[None, :width + 1] <= accepted[:, None])
            block = torch.cat([drafts, res.next_token[:, None]], 1).scatter(1, accepted[:, None], res.next_token[:, None])
            self._write(state, work, source, mark, block, keep, e)
        roll_back_drafters((d for d in self.models.drafters if d is not model), at)  # the lower drafters
        if work.alt is not None:
            self._record_candidates(work, logits, mark - work.base, accepted, need)
        return new_mark

    def _window(self, state, start, width: int) -> torch.Tensor:
        cols = (start[:, None] + self.offsets[:width]).clamp(max=state.tokens.shape[1] - 1)
        return torch.gather(state.tokens, 1, cols)

    def _q_at(self, work: Working, start, width: int) -> torch.Tensor:
        rel = ((start - work.base)[:, None] + self.offsets[:width]).clamp(0, self.max_width - 1)
        return work.q.gather(1, rel[:, :, None].expand(-1, -1, work.q.shape[2]))

    def _write(self, state, work: Working, source: Source, start, block, keep, dist):
        """Write `block` [B, w] at working slots start.. where `keep`, and their proposal
        distributions into work.q (`dist` [B, w, V], or one-hot of the tokens when None) and
        `source` into work.origin (a top-level source writes last: its index is what stays).
        Entries not kept go to scratch slots (the token buffer's last column, q's last slot),
        never onto a kept entry's slot: of duplicate indexes, scatter keeps one arbitrarily."""
        slot = start[:, None] + self.offsets[:block.shape[1]]
        state.tokens.scatter_(1, torch.where(keep, slot, self.scratch_column), block)
        if work.q is not None or work.origin is not None:
            self._note(work, source, slot, block, keep, dist)

    def _note(self, work: Working, source: Source, slot, block, keep, dist):
        """_write's record of the proposals of the kept entries at working `slot`s (absolute)."""
        rel = torch.where(keep, slot - work.base[:, None], self.scratch_slot).clamp(0, self.max_width)
        if work.origin is not None:
            work.origin.scatter_(1, rel, torch.full_like(rel, source.index))
        if work.q is not None:
            vocab = work.q.shape[2]
            dist = one_hot(block, vocab) if dist is None else dist
            work.q.scatter_(1, rel[:, :, None].expand(-1, -1, vocab), dist)

    # -- the top-level tree --------------------------------------------------------------------
    def _record_candidates(self, work: Working, logits, start, n, need):
        """Keep, per depth, the top tokens of this review's logits at the positions whose prefix
        it accepted (draft offsets start .. start + n, correction included); forget every depth
        past them, whose tokens the review just discarded."""
        depths, top = work.alt.shape[1], work.alt.shape[2]
        col = self.offsets[None, :depths]
        work.alt.masked_fill_((need[:, None] & (col > (start + n)[:, None]))[:, :, None], -1)
        j = col - start[:, None]  # this review's logit row for each depth
        fresh = need[:, None] & (j >= 0) & (j <= n[:, None]) & (j < logits.shape[1])
        rows = j.clamp(0, logits.shape[1] - 1)[:, :, None].expand(-1, -1, logits.shape[2])
        candidates = logits.gather(1, rows).topk(top, dim=-1).indices  # only the rows a depth uses
        work.alt = torch.where(fresh[:, :, None], candidates, work.alt)

    def _tree_layout(self, width: int, device):
        """Node order: the root, then depth by depth the trunk token and its extra siblings, so
        a row with a shorter trunk pads only at the end. Returns (the tree of one row, trunk
        node of each depth [width], and per sibling node: its node, depth index and rank)."""
        parents, trunk, sibling, sibling_depth, sibling_rank = [ROOT], [], [], [], []
        for d in range(1, width + 1):
            parent = trunk[-1] if trunk else 0
            trunk.append(len(parents))
            parents.append(parent)
            for rank in range(self.tree[d - 1] - 1 if d <= len(self.tree) else 0):
                sibling.append(len(parents))
                sibling_depth.append(d - 1)
                sibling_rank.append(rank)
                parents.append(parent)
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        return TreeShape.build(t([parents]), width), t(trunk), (t(sibling), t(sibling_depth), t(sibling_rank))

    def _verify_tree(self, state, work: Working, draft: Draft):
        """The target checks the draft as a tree's trunk; returns (output, accepted trunk nodes)."""
        b, width = draft.tokens.shape
        shape, trunk, (sibling, sibling_depth, sibling_rank) = self.layouts[width]
        tokens = torch.zeros(b, shape.parents.shape[1], dtype=torch.int64, device=draft.tokens.device)
        tokens[:, 0] = state.pending
        tokens[:, trunk] = draft.tokens
        if sibling.numel():  # depth d's rank-th candidate other than the trunk token
            cand = work.alt[:, sibling_depth]  # [B, S, K]
            is_trunk = cand == draft.tokens[:, sibling_depth, None]
            others = cand.gather(2, is_trunk.int().argsort(dim=2, stable=True))  # trunk token moved last
            pick = others.gather(2, sibling_rank[None, :, None].expand(b, -1, 1))[:, :, 0]
            # a depth no neural review scored (-1): a harmless duplicate of the trunk token
            tokens[:, sibling] = torch.where(pick >= 0, pick, draft.tokens[:, sibling_depth])
        real = shape.depth <= draft.length[:, None]
        if self.chooses_tree and sibling.numel():  # a row whose plan wants no tree: its siblings are padding
            real[:, sibling] &= (state.plan[-1] > 0)[:, None]
        tree = TreeShape(torch.where(real, shape.parents, PADDING), shape.mask.expand(b, -1, -1),
                         shape.depth.expand(b, -1), width)
        q = None
        if draft.q is not None:
            q = one_hot(tokens, draft.q.shape[2])  # siblings (and the unused root)
            q[:, trunk] = draft.q
        out, path = verify_tree_and_commit(self.models, state, tokens, tree, q, drafted=draft.length)
        state.offset += self.max_width + 1 - width  # as the chain step: max_width + 2 counters in all
        return out, (path == trunk[None, :]).long().cumprod(1).sum(1)  # accepted nodes before leaving the trunk

    def _record_verdicts(self, state, work: Working, budgets, draft: Draft, kept, out: StepOutput) -> None:
        """The target's verdicts per top-level source (StepMetrics.source_*) for rows that did not
        go direct (a long verbatim match is not what MaG's rate prices), `kept` draft tokens
        accepted. Where the target reads the plan's whole width (no trim: a GPU), a top-level MaG
        token a row asked for and MaG did not propose cost its slot and yielded nothing: where the
        target took the whole draft and it fell short of the row's top-level budgets, MaG counts
        one token checked, not accepted (its rate then prices the slots asked for, which is what
        that width buys). Then a tree's siblings (_record_siblings)."""
        counted = state.active & (state.plan[-2] == 0)
        top = self.levels.sources
        state.metrics.record_sources(work.origin[:, :work.width], draft.length, kept, counted, [s.index for s in top])
        if not self.models.trim_drafts:
            short = counted & (kept == draft.length) & (draft.length < sum(budgets[s.index] for s in top))
            for s in top:
                if s.below is None:
                    state.metrics.source_checked[s.index].add_(short & (budgets[s.index] > 0))
        if work.tree:
            self._record_siblings(state, work, draft, kept, out, counted)

    def _record_siblings(self, state, work: Working, draft: Draft, kept, out: StepOutput, counted) -> None:
        """Count the tree rows' checks where the target rejected a top-level neural source's
        trunk token that had siblings (`kept`: the trunk tokens it accepted before), and those
        where it took a sibling instead (its path left the trunk: one token more)."""
        at = kept.clamp(max=work.width - 1)  # the rejected trunk slot (where kept < length)
        neural = (work.origin.gather(1, at[:, None]) == self.top_neural[None, :]).any(1)
        checked = counted & (state.plan[-1] > 0) & (kept < draft.length) & self.sibling_at[at] & neural
        state.metrics.sibling_checked.add_(checked)
        state.metrics.sibling_accepted.add_(checked & (out.counts > kept + 1))
