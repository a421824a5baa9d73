"""Cascade Speculative Drafting (ALGORITHMS.md sections 2 and 3): vertical + horizontal cascade.

Every row keeps one working sequence in `state.tokens`: the committed prefix, `pending`,
then the draft being built. Row 0 of K says how many tokens each drafter (largest first)
contributes to the target's draft; a neural drafter's own proposals come from the cascade
below it (the sub-matrix), and it only ever *reviews* them — never decodes on its own.
A review appends the accepted tokens plus the reviewer's correction/bonus and cuts the rest,
so the working sequence only grows by verified-at-that-level tokens; every model's cache is
a prefix of it and rolls back by length.

Lossless at any temperature: a reviewer at an intermediate level emits each token with an
exactly known distribution e_j (kernels.verify.emitted_distribution, lenience included),
and that e_j — not the raw drafter distribution — is the proposal the level above verifies
against. The target reviews with lenience 1, so the output follows the target exactly.

Tree at the top level (`tree=(b_1, b_2, ...)`, CS Drafting with tree attention): the target
verifies the cascade's draft as the trunk of a token tree in one forward, with b_d - 1 extra
children beside the trunk token at depth d: the most likely other tokens of the last neural
review that scored that position with an all-accepted prefix. Such a child is a function of
the prefix alone, so it is a deterministic child of the tree rule (ALGORITHMS.md section 5),
tried after the trunk token (whose proposal is its e): lossless at any temperature. After a
branch wins, every drafter rolls back to where the accepted path left the trunk.

Rows are batched: a row that already holds enough tokens at a level is masked out of the
next review instead of leaving the batch. Intermediate levels read their accept counts on
the host once per review (the loop bound is data-dependent and MaG runs on the host); the
target level's result is read once per step by the engine.
"""
import time
from dataclasses import dataclass, field

import torch

from csd_engine.drafters.mag import MaG
from csd_engine.ops import PADDING, ROOT
from csd_engine.strategies.base import DecodeState, StepOutput, require_one_device
from csd_engine.strategies.tree import TreeShape, verify_tree_and_commit


def _validate_k_matrix(k_matrix, n_drafters: int, is_mag: list[bool]) -> tuple[tuple[int, ...], ...]:
    rows = [list(r) for r in k_matrix] if not isinstance(k_matrix, torch.Tensor) else k_matrix.tolist()
    n = n_drafters
    if len(rows) != n or any(len(r) != n for r in rows):
        raise ValueError(f"K matrix must be {n}x{n} (one row and column per drafter, largest first); "
                         f"got shape {len(rows)}x{len(rows[0]) if rows else 0}")
    for i, r in enumerate(rows):
        for j, v in enumerate(r):
            if isinstance(v, bool) or not isinstance(v, int) and not (isinstance(v, float) and v.is_integer()):
                raise ValueError(f"K[{i}][{j}]={v!r}: entries must be non-negative integers")
            if v < 0:
                raise ValueError(f"K[{i}][{j}]={v}: entries must be non-negative integers")
            if j < i and v != 0:
                raise ValueError(f"K[{i}][{j}]={v}: K must be upper-triangular (entries below the diagonal are 0)")
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


@dataclass(frozen=True)
class Cascade:
    """k_matrix: n x n for the engine's n drafters (largest first, optionally ending in MaG).
    lenience >= 1 relaxes reviews by drafters (never the target's). mag_tokens: how many
    tokens MaG proposes per call. tree: candidates per depth at the top level (trunk token
    included), e.g. (3, 2); () verifies a plain chain."""

    k_matrix: tuple = ((4,),)
    lenience: float = 1.0
    mag_tokens: int = 10
    tree: tuple = ()
    stream_base: int = field(default=16, repr=False)

    def __post_init__(self):
        if not isinstance(self.lenience, (int, float)) or not self.lenience >= 1:
            raise ValueError(f"lenience must be a number >= 1, got {self.lenience!r}")
        if isinstance(self.mag_tokens, bool) or not isinstance(self.mag_tokens, int) or self.mag_tokens < 1:
            raise ValueError(f"mag_tokens must be an int >= 1, got {self.mag_tokens!r}")
        rows = self.k_matrix.tolist() if isinstance(self.k_matrix, torch.Tensor) else self.k_matrix
        if not isinstance(rows, (list, tuple)) or not rows or not all(isinstance(r, (list, tuple)) for r in rows):
            raise ValueError(f"k_matrix must be a square list of lists of non-negative ints, got {self.k_matrix!r}")
        object.__setattr__(self, "k_matrix", tuple(tuple(r) for r in rows))
        if not isinstance(self.tree, (tuple, list)) or not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in self.tree):
            raise ValueError(f"Cascade.tree must be a tuple of ints >= 1 (candidates per depth, trunk token "
                             f"included, e.g. (3, 2)), got {self.tree!r}")
        object.__setattr__(self, "tree", tuple(self.tree))

    @staticmethod
    def auto(**kwargs) -> "AutoCascade":
        """A cascade that picks K and lenience itself from measured acceptance and costs."""
        return AutoCascade(**kwargs)

    def decoder(self, engine):
        if not engine.drafters:
            raise ValueError("Cascade needs at least one drafter (e.g. drafters=['mag'])")
        require_one_device(engine, "Cascade")
        is_mag = [isinstance(d, MaG) for d in engine.drafters]
        k = _validate_k_matrix(self.k_matrix, len(engine.drafters), is_mag)
        if self.tree and all(is_mag):
            raise ValueError("Cascade.tree needs a neural drafter: the extra children are a neural review's "
                             "most likely tokens (MaG proposes one token per position)")
        if self.tree and max(self.tree) > engine.target.vocab_size:
            raise ValueError(f"Cascade.tree={self.tree} asks for more candidates than the vocabulary has tokens")
        return CascadeDecoder(engine, k, float(self.lenience), self.mag_tokens, self.tree)


def _max_growth(k, is_mag, mag_tokens) -> int:
    """Host-side bound on how many tokens one draft(...) call can add (sizes the buffers)."""
    total = 0
    for i in range(len(k)):
        target = sum(k[0][:i + 1])
        step = mag_tokens if is_mag[i] else _max_growth([r[i + 1:] for r in k[i + 1:]], is_mag[i + 1:], mag_tokens) + 1
        total = max(total, target - 1 + step) if k[0][i] else total
    return total


class CascadeDecoder:
    def __init__(self, engine, k, lenience, mag_tokens, tree: tuple = ()):
        self.engine = engine
        self.target = engine.target
        self.drafters = engine.drafters
        self.is_mag = [isinstance(d, MaG) for d in self.drafters]
        self.verifier = engine.verifier
        self.k = k
        self.lenience = lenience
        self.mag_tokens = mag_tokens
        self.max_draft = _max_growth(k, self.is_mag, mag_tokens)
        self.tree = tree[:self.max_draft]
        self.extra = sum(b - 1 for b in self.tree)  # nodes beside the trunk
        self.max_tokens_per_forward = self.max_draft + 2 + self.extra
        self.alt = None
        self.layouts = {}  # trunk width -> tree layout and mask (host-known, built once each)

    def start(self, state: DecodeState, prompt_ids) -> None:
        for d in self.drafters:
            if isinstance(d, MaG):
                d.start(prompt_ids)

    def observe(self, emitted):
        for d in self.drafters:
            if isinstance(d, MaG):
                d.commit(emitted)

    # -- the step ------------------------------------------------------------------------------
    def step(self, state: DecodeState) -> StepOutput:
        b, dev = state.batch, state.pending.device
        base = state.committed + 1  # working sequence = tokens[:committed] + pending + draft
        state.tokens.scatter_(1, state.committed[:, None], state.pending[:, None])
        self.q = None if state.all_greedy else torch.zeros(b, self.max_draft, self.target.vocab_size, device=dev)
        if self.tree:  # per row and depth: the candidates of the last valid neural review, -1 unknown
            self.alt = torch.full((b, len(self.tree), max(self.tree)), -1, dtype=torch.int64, device=dev)
        self.reviews = torch.zeros(b, dtype=torch.int64, device=dev)  # per row: its own reviews this step
        self.current_reviewer = None
        length = self._draft(state, list(range(len(self.drafters))), self.k, base.clone(), base, state.active)
        n_draft = length - base
        width = int(n_draft.max())
        drafts = torch.gather(state.tokens, 1, (base[:, None] + torch.arange(width, device=dev)).clamp(
            max=state.tokens.shape[1] - 1))
        if self.tree:
            return self._verify_tree(state, base, drafts, n_draft)
        ids = torch.cat([state.pending[:, None], drafts], 1)
        logits = self._forward(self.target, state, ids, state.committed, width + 1)
        q = None if self.q is None else self.q[:, :width]
        self.current_reviewer = -1  # the target
        res = self.verifier.chain(logits, drafts, n_draft, q, lenience=1.0, **state.sampling_args(0))
        n = res.num_accepted.to(torch.int64)
        self.target.cache.advance((n + 1) * state.active)
        for d in self.drafters:
            if not isinstance(d, MaG):
                d.cache.rollback(base + n)
        state.offset += self.max_draft + 2
        state.metrics.target_forwards += 1
        state.metrics.record(0, n, n_draft, state.active, width)
        col = torch.arange(width + 1, device=dev)[None, :]
        tokens = torch.where(col == n[:, None], res.next_token[:, None], torch.cat([drafts, drafts[:, :1]], 1))
        return StepOutput(tokens, n + 1)

    def _draft(self, state, drafters: list[int], k, length, start, rows):
        """Grow the working sequence of the `rows` (mask) from `start` by the cascade of
        `drafters` (engine indices) driven by `k`; returns the new lengths. Rows that are
        done are masked out of further reviews, never split into separate calls."""
        for i, d in enumerate(drafters):
            goal = start + sum(k[0][:i + 1])
            while True:
                need = (length < goal) & rows
                if not bool(need.any()):
                    break
                if self.is_mag[d]:
                    length = self._mag_append(state, d, length, need)
                else:
                    sub_k = [r[i + 1:] for r in k[i + 1:]]
                    sub_len = self._draft(state, drafters[i + 1:], sub_k, length.clone(), length, need)
                    length = self._review(state, d, length, sub_len, need)
        return length

    def _mag_append(self, state, d, length, need):
        """MaG proposes `mag_tokens` after each row's working sequence (one-hot q)."""
        mag = self.drafters[d]
        base = state.committed + 1
        window = torch.gather(state.tokens, 1, (base[:, None] + torch.arange(self.max_draft, device=base.device))
                              .clamp(max=state.tokens.shape[1] - 1))
        host = torch.cat([(length - base)[:, None], window], 1).tolist()  # one host read
        tails = [row[1:1 + row[0]] for row in host]
        prop = mag.propose(tails, self.mag_tokens).to(state.tokens.device)
        m = self.mag_tokens
        cols = length[:, None] + torch.arange(m, device=length.device)
        keep = need[:, None].expand(-1, m)
        cols = torch.where(keep, cols, state.tokens.shape[1] - 1)
        state.tokens.scatter_(1, cols, torch.where(keep, prop, state.tokens.gather(1, cols)))
        if self.q is not None:
            rel = (cols - base[:, None]).clamp(0, self.q.shape[1] - 1)
            onehot = torch.nn.functional.one_hot(prop, self.q.shape[2]).to(self.q.dtype)
            old = self.q.gather(1, rel[:, :, None].expand(-1, -1, self.q.shape[2]))
            self.q.scatter_(1, rel[:, :, None].expand(-1, -1, self.q.shape[2]),
                            torch.where(keep[:, :, None], onehot, old))
        return torch.where(need, length + m, length)

    def _review(self, state, d, mark, sub_len, need):
        """Drafter d reviews the tokens [mark, sub_len) its sub-cascade proposed; the working
        sequence keeps the accepted ones plus d's correction/bonus (rows in `need` only)."""
        model = self.drafters[d]
        dev = mark.device
        m = (sub_len - mark) * need  # rows not in need review nothing and change nothing
        model.cache.rollback(mark - 1)  # recompute the logits at the last token before the draft
        feed_from = model.cache.lengths.clone()
        width, fed = torch.stack([m.max(), (sub_len - feed_from).max()]).tolist()  # one host read
        logits = self._forward(model, state, None, feed_from, fed, upto=sub_len)
        # logits at working positions mark-1 .. mark-1+width (relative to what was fed)
        rel = (mark - 1 - feed_from)[:, None] + torch.arange(width + 1, device=dev)[None, :]
        rel = rel.clamp(0, logits.shape[1] - 1)
        logits = logits.gather(1, rel[:, :, None].expand(-1, -1, logits.shape[2]))
        drafts = torch.gather(state.tokens, 1, (mark[:, None] + torch.arange(width, device=dev)).clamp(
            max=state.tokens.shape[1] - 1))
        base = state.committed + 1
        q = None
        if self.q is not None:
            qrel = ((mark - base)[:, None] + torch.arange(width, device=dev)).clamp(0, self.q.shape[1] - 1)
            q = self.q.gather(1, qrel[:, :, None].expand(-1, -1, self.q.shape[2]))
        self.current_reviewer = d
        args = state.sampling_args(self.stream_id(d))
        self.reviews += need.to(torch.int64)
        res = self.verifier.chain(logits, drafts, m, q, lenience=self.lenience, **args)
        n = res.num_accepted.to(torch.int64)
        state.metrics.count_drafter(d)
        state.metrics.record(d + 1, n, m, need)
        # Keep accepted drafts, write the correction/bonus after them.
        pos = torch.where(need, mark + n, state.tokens.shape[1] - 1)
        state.tokens.scatter_(1, pos[:, None], torch.where(need, res.next_token, state.tokens.gather(1, pos[:, None])[:, 0])[:, None])
        if self.q is not None:
            e = self.verifier.emitted_distribution(logits, drafts, m, q, state.temperature, state.top_k, state.top_p,
                                                   self.lenience, res)
            dst = ((mark - base)[:, None] + torch.arange(width + 1, device=dev)).clamp(0, self.q.shape[1] - 1)
            keep = need[:, None] & (torch.arange(width + 1, device=dev)[None, :] <= n[:, None])
            old = self.q.gather(1, dst[:, :, None].expand(-1, -1, self.q.shape[2]))
            self.q.scatter_(1, dst[:, :, None].expand(-1, -1, self.q.shape[2]), torch.where(keep[:, :, None], e, old))
        for other in self.drafters:  # everything past the first rejection is gone, in every cache
            if not isinstance(other, MaG):
                other.cache.rollback(torch.where(need, mark + n, other.cache.lengths))
        if self.alt is not None:
            self._record_candidates(logits, mark - base, n, need)
        return torch.where(need, mark + n + 1, mark)

    # -- the top-level tree --------------------------------------------------------------------
    def _record_candidates(self, logits, start, n, need):
        """Keep, per depth, the top tokens of this review's logits at the positions whose prefix
        it accepted (draft offsets start .. start + n, correction included); forget every depth
        past them, whose tokens the review just discarded."""
        depths, top = self.alt.shape[1], self.alt.shape[2]
        col = torch.arange(depths, device=start.device)[None, :]
        stale = need[:, None] & (col > (start + n)[:, None])
        self.alt.masked_fill_(stale[:, :, None], -1)
        j = col - start[:, None]  # this review's logit row for each depth
        fresh = need[:, None] & (j >= 0) & (j <= n[:, None]) & (j < logits.shape[1])
        rows = j.clamp(0, logits.shape[1] - 1)[:, :, None].expand(-1, -1, logits.shape[2])
        candidates = logits.gather(1, rows).topk(top, dim=-1).indices  # only the rows a depth uses
        self.alt = torch.where(fresh[:, :, None], candidates, self.alt)

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

    def _verify_tree(self, state, base, drafts, n_draft) -> StepOutput:
        b, width = drafts.shape
        if width not in self.layouts:
            self.layouts[width] = self._tree_layout(width, drafts.device)
        shape, trunk, (sibling, sibling_depth, sibling_rank) = self.layouts[width]
        tokens = torch.zeros(b, shape.parents.shape[1], dtype=torch.int64, device=drafts.device)
        tokens[:, 0] = state.pending
        tokens[:, trunk] = drafts
        if sibling.numel():  # depth d's rank-th candidate other than the trunk token
            cand = self.alt[:, sibling_depth]  # [B, S, K]
            is_trunk = cand == drafts[:, sibling_depth, None]
            others = cand.gather(2, is_trunk.int().argsort(dim=2, stable=True))  # trunk token moved last
            pick = others.gather(2, sibling_rank[None, :, None].expand(b, -1, 1))[:, :, 0]
            # a depth no neural review scored (-1): a harmless duplicate of the trunk token
            tokens[:, sibling] = torch.where(pick >= 0, pick, drafts[:, sibling_depth])
        real = shape.depth <= n_draft[:, None]
        tree = TreeShape(torch.where(real, shape.parents, PADDING), shape.mask.expand(b, -1, -1),
                         shape.depth.expand(b, -1), width)
        q = None
        if self.q is not None:
            vocab = self.q.shape[2]
            q = torch.nn.functional.one_hot(tokens, vocab).float()  # siblings (and the unused root)
            q[:, trunk] = self.q[:, :width]
        out, path = verify_tree_and_commit(self.engine, state, tokens, tree, q, drafted=n_draft)
        on_trunk = (path == trunk[None, :]).long().cumprod(1).sum(1)  # accepted nodes before leaving the trunk
        for d in self.drafters:
            if not isinstance(d, MaG):
                d.cache.rollback(base + on_trunk)
        state.offset += self.max_draft + 1 - width  # as the chain step: max_draft + 2 counters in all
        return out

    def stream_id(self, drafter: int) -> torch.Tensor:
        """[B] random stream of each row's next review by `drafter`: counted per row, so a row's
        random numbers never depend on how many reviews the other rows of the batch needed."""
        return 1 + 1024 * (drafter + 1) + self.reviews

    def _forward(self, model, state, ids, feed_from, width, upto=None):
        """Feed `model` the working-sequence tokens from `feed_from` (its cache length) for
        `width` positions (or the given ids); returns logits [B, width, V]."""
        dev = feed_from.device
        if ids is None:
            cols = feed_from[:, None] + torch.arange(width, device=dev)[None, :]
            ids = torch.gather(state.tokens, 1, cols.clamp(max=state.tokens.shape[1] - 1))
        from csd_engine.models.runner import ForwardBatch
        # Host-known bound (no read): a cache never holds more than the committed prefix, pending
        # and the largest draft; the runner masks whatever lies past a row's own length.
        bound = min(state.max_committed + 1 + self.max_draft + ids.shape[1], self.engine.capacity)
        out = model(ForwardBatch.chain(ids, model.cache.lengths, bound))
        fed = ids.shape[1] if upto is None else (upto - feed_from).clamp(min=0)
        if model is not self.target:
            model.cache.advance(fed if isinstance(fed, torch.Tensor) else torch.full_like(feed_from, fed))
        return out


# -- self-tuning ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class AutoCascade:
    """Cascade that chooses K and lenience itself (for one neural drafter and/or MaG).

    Calibration: a few productive steps in each of a handful of probe configurations measure
    acceptance (target on drafter tokens, target on MaG tokens, drafter on MaG tokens, per
    lenience) and each model's forward time as a function of tokens fed. Then the
    expected-tokens-per-cost model picks the best (K, lenience) from a grid, and it is
    re-picked every `retune_every` steps from the running statistics."""

    lenience_choices: tuple = (1.0, 2.0, 4.0)
    max_tokens: int = 10  # largest K entry tried
    calibration_steps: int = 2
    retune_every: int = 8

    def decoder(self, engine):
        require_one_device(engine, "Cascade.auto()")
        neural = [i for i, d in enumerate(engine.drafters) if not isinstance(d, MaG)]
        mags = [i for i, d in enumerate(engine.drafters) if isinstance(d, MaG)]
        if len(neural) > 1 or len(engine.drafters) > 2 or not engine.drafters or (neural and mags and mags[0] < neural[0]):
            raise ValueError("Cascade.auto() tunes a target with one neural drafter and/or MaG (drafters=[model, 'mag'], "
                             "[model] or ['mag']); give an explicit Cascade(k_matrix=...) for deeper cascades")
        return AutoCascadeDecoder(engine, self, has_model=bool(neural), has_mag=bool(mags))


def expected_tokens(alphas: list[float]) -> float:
    """Tokens per review of a chain whose j-th draft is accepted with conditional rate alphas[j]
    (bonus included): 1 + a1 + a1 a2 + ...; for a constant a this is (1 - a^(k+1)) / (1 - a)."""
    total, run = 1.0, 1.0
    for a in alphas:
        run *= a
        total += run
    return total


class AutoCascadeDecoder:
    def __init__(self, engine, cfg: AutoCascade, has_model: bool, has_mag: bool):
        self.engine, self.cfg = engine, cfg
        self.has_model, self.has_mag = has_model, has_mag
        self.costs: dict[int, dict[int, float]] = {}  # model index (-1 target) -> tokens fed -> seconds (EMA)
        self.rates: dict[tuple, list[float]] = {}  # (reviewer, source, lenience) -> [accepted, tested]
        self.probes = self._probes()
        self.steps = 0
        self.decoder = None
        m = cfg.max_tokens
        self.max_tokens_per_forward = _max_growth([[m, m], [0, m]], [False, True], m) + 2
        self.choice = None

    # probe configurations: each isolates one acceptance rate
    def _probes(self):
        m = self.cfg.max_tokens
        n = len(self.engine.drafters)
        probes = []
        if self.has_mag:
            probes.append((_k(n, self.has_model, 0, 6, 4), 1.0))
        if self.has_model:
            for lenience in self.cfg.lenience_choices if self.has_mag else (1.0,):
                probes.append((_k(n, self.has_model, 4, 0, 4), lenience))
        return [(k, lenience) for k, lenience in probes if max(map(max, k)) <= m]

    def start(self, state, prompt_ids):
        self._use(*self.probes[0])
        self.decoder.start(state, prompt_ids)

    def observe(self, emitted):
        self.decoder.observe(emitted)

    def _use(self, k, lenience):
        mag_tokens = max(k[-1][-1], 1) if self.has_mag else 1
        decoder = CascadeDecoder(self.engine, k, lenience, mag_tokens)
        decoder._forward = self._timed(decoder._forward)
        decoder.verifier = _RateRecorder(self.engine.verifier, self, lenience, decoder)
        if self.decoder is not None:
            decoder.q = self.decoder.q
        self.decoder, self.choice = decoder, (k, lenience)

    def _timed(self, forward):
        def timed(model, state, ids, feed_from, width, upto=None):
            t = time.perf_counter()
            out = forward(model, state, ids, feed_from, width, upto)
            if out.is_cuda:
                torch.cuda.synchronize()
            key = -1 if model is self.engine.target else self.engine.drafters.index(model)
            n = ids.shape[1] if ids is not None else width
            table = self.costs.setdefault(key, {})
            dt = time.perf_counter() - t
            table[n] = dt if n not in table else 0.7 * table[n] + 0.3 * dt
            return out
        return timed

    def step(self, state):
        out = self.decoder.step(state)
        self.steps += 1
        calib = self.cfg.calibration_steps
        phase = self.steps // calib
        if self.steps % calib == 0 and phase < len(self.probes):
            self._use(*self.probes[phase])
        elif phase >= len(self.probes) and (self.steps - len(self.probes) * calib) % self.cfg.retune_every == 0:
            self._use(*self.best())
        return out

    # -- the cost model ---------------------------------------------------------------------------
    def rate(self, reviewer, source, lenience=1.0, default=0.5):
        acc, tested = self.rates.get((reviewer, source, lenience), (0.0, 0.0))
        return (acc + default) / (tested + 1.0)  # a weak prior keeps unmeasured rates sane

    def cost(self, model, n):
        table = self.costs.get(model, {})
        if not table:
            return 0.0
        if n in table:
            return table[n]
        pts = sorted(table.items())
        if len(pts) == 1:
            return pts[0][1]
        (n0, c0), (n1, c1) = pts[0], pts[-1]
        return c0 + (c1 - c0) * (n - n0) / max(n1 - n0, 1)

    def predicted_speed(self, a, b, m, lenience):
        """Expected tokens per second of K = [[a, b], [0, m]] (a drafter tokens, then b MaG tokens;
        the drafter reviews m MaG tokens at a time)."""
        t_model, t_mag = self.rate(-1, "model", lenience), self.rate(-1, "mag")
        tokens = expected_tokens([t_model] * a + [t_mag] * b)
        seconds = self.cost(-1, a + b + 1)
        if a:
            d = self.engine.drafters.index(next(x for x in self.engine.drafters if not isinstance(x, MaG)))
            per_review = expected_tokens([self.rate(d, "mag", lenience)] * m) if self.has_mag else 1.0
            seconds += -(-a // max(per_review, 1.0)) * self.cost(d, m + 1)
        return tokens / max(seconds, 1e-9)

    def best(self):
        n = len(self.engine.drafters)
        grid = range(0, self.cfg.max_tokens + 1, 2)
        best, choice = -1.0, self.choice
        for a in grid if self.has_model else [0]:
            for b in grid if self.has_mag else [0]:
                if a + b == 0:
                    continue
                for m in (grid[1:] if (self.has_mag and self.has_model and a) else [0]):
                    for lenience in (self.cfg.lenience_choices if a and self.has_mag else (1.0,)):
                        speed = self.predicted_speed(a, b, m, lenience)
                        if speed > best:
                            best, choice = speed, (_k(n, self.has_model, a, b, max(m, 1)), lenience)
        return choice


def _k(n, has_model, a, b, m):
    """K for drafters [model, mag] (n=2), [model] or [mag] (n=1)."""
    if n == 2:
        return ((a, b), (0, m))
    return ((a,),) if has_model else ((b,),)


class _RateRecorder:
    """Verifier wrapper that records, per (reviewer, source of the drafts), how many drafts
    were tested and accepted, for the cost model."""

    def __init__(self, verifier, auto, lenience, decoder):
        self._v, self._auto, self._lenience, self._decoder = verifier, auto, lenience, decoder
        self.emitted_distribution = verifier.emitted_distribution
        self.reviewer_probs = verifier.reviewer_probs

    def chain(self, logits, drafts, num_drafts, q, lenience, **args):
        res = self._v.chain(logits, drafts, num_drafts, q, lenience=lenience, **args)
        n = res.num_accepted.to(torch.int64)
        tested = torch.minimum(n + 1, num_drafts.to(torch.int64))
        reviewer = self._decoder.current_reviewer
        k = self._decoder.k
        first_is_model = reviewer == -1 and self._auto.has_model and k[0][0] > 0
        source = "model" if first_is_model else "mag"
        lenience_key = self._lenience if source == "model" or reviewer != -1 else 1.0
        entry = self._auto.rates.setdefault((reviewer, source, lenience_key), [0.0, 0.0])
        entry[0] += float(n.sum())
        entry[1] += float(tested.sum())
        return res
