"""The self-tuning strategies' draft choice (Speculative.auto(), Cascade.auto()) for every row in
one launch, with its PyTorch reference.

Per row, over the grid of choices (t, a, c, g): t = 1 checks the draft as the top-level tree
(t = 0 a chain), a <= A model tokens, c <= M MaG tokens per review by the model, g <= M top-level
MaG tokens (strategies/cascade_auto.py derives the formula; Speculative.auto() is the grid with
M = 0 and no tree), the row picks the first choice (t-, a-, c-, g-major order: no tree, fewest drafts) whose value
is within TIE (relative) of the most

    value = (tokens + t gain) / (width[1 + a + g' + t nodes(a + g')] + reviews (model + width[1 + c] - 1)
                                 + [a > 0] (first - model))
    tokens = geo(alpha, a) + alpha^a (geo(gamma, g') - 1),   geo(r, n) = 1 + r + ... + r^n
    reviews = ceil(a / (1 + beta c)) where the rounds stop early, else a
    gain = sigma (1 - alpha) (sum over depths d <= a with siblings of alpha^(d - 1))

with g' = min(g, ready) where a = 0 and MaG's current proposal length `ready` is given, and
choices whose c > max(a - 1, 0) excluded. Rates are counted: (accepted + prior_rate prior) /
(checked + prior), prior_rate the model's own for alpha and 0.5 for gamma, beta and sigma.

Why a kernel: the reference is ~50-80 tensor ops over a [B, T, A+1, M+1, M+1] grid, each a
kernel launch that a step graph replays every step; here one program per row evaluates its grid
(at most a few hundred choices) in registers; the prices are device tensors (Prices), so a step
graph replays the ones its strategy chose for its rows. Values differ from the reference's in the
last bits (exp2/log2 powers); choices equal in exact arithmetic are common (the prior rates give
equal values to several MaG budgets), and the tolerance makes both take the first of them
rather than whichever rounding favours. Only values straddling the tolerance can still be
chosen apart: that changes a budget, never a token. Shapes and host constants only:
capturable in a CUDA graph.
"""
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

TIE = 1e-6  # relative: values this close count as equal (float32 rounding of equal expressions)
_TIE = tl.constexpr(TIE)


@dataclass(frozen=True)
class Grid:
    """The host constants of a strategy's choice grid."""

    max_tokens: int  # A: the model's largest budget (0: no neural drafter)
    mag_tokens: int  # M: MaG's largest top-level budget and tokens per review (0: no MaG)
    tree: tuple  # candidates per depth of the top-level tree, trunk token included (Cascade.tree); (): none
    prior: float  # drafts' worth of the prior rates
    prior_rate: float  # alpha's prior rate (gamma's, beta's and sigma's: 0.5)
    stops_early: bool  # a step's review rounds end once no row needs more (else: a reviews)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return 2 if self.tree else 1, self.max_tokens + 1, self.mag_tokens + 1, self.mag_tokens + 1


@dataclass(frozen=True)
class Prices:
    """What the choices cost, in one-token target forwards of the step's rows
    (strategies/budget.py)."""

    width: torch.Tensor  # [W] float32: a target forward over w tokens per row, w = 0..W-1 (0 costs as 1)
    model: torch.Tensor  # [1] float32: one forward of the model, one token per row
    first: torch.Tensor  # [1] float32: a draft's first model forward (it catches up on the target's last token)
    shared: bool = False  # the step's rows take one choice (draft_budgets_ref's shared_by)


@dataclass
class Counts:
    """Per row [B] int64 (accepted, checked) pairs; None where the grid has no such source."""

    model: tuple | None  # the target's verdicts on the model's tokens: alpha
    mag: tuple | None  # ... on MaG's top-level tokens: gamma
    reviews: tuple | None  # MaG tokens the model accepted / was offered in its reviews: beta
    siblings: tuple | None  # tree checks that took a sibling / had siblings to take: sigma


@triton.jit
def _power(x, n):
    """x^n for x >= 0 and n >= 0 (0^0 = 1)."""
    return tl.where(n == 0, 1.0, tl.where(x > 0, tl.exp2(n * tl.log2(tl.maximum(x, 1e-30))), 0.0))


@triton.jit
def _geometric(rate, n):
    return (1 - _power(rate, n + 1)) / tl.maximum(1 - rate, 1e-6)


@triton.jit
def _rate(accepted_ptr, checked_ptr, row, prior, prior_rate, PRESENT: tl.constexpr):
    if PRESENT:
        return (tl.load(accepted_ptr + row).to(tl.float32) + prior_rate * prior) / \
            (tl.load(checked_ptr + row).to(tl.float32) + prior)
    return 0.0


@triton.jit
def _budget_kernel(model_acc_ptr, model_chk_ptr, mag_acc_ptr, mag_chk_ptr, review_acc_ptr, review_chk_ptr,
                   sibling_acc_ptr, sibling_chk_ptr, ready_ptr, width_ptr, model_ptr, first_ptr, nodes_ptr, extra_ptr,
                   pick_ptr,
                   batch, prior, prior_rate, A: tl.constexpr, M: tl.constexpr, D: tl.constexpr,
                   TREES: tl.constexpr, NEURAL: tl.constexpr, HAS_MAG: tl.constexpr, STOPS_EARLY: tl.constexpr,
                   HAS_READY: tl.constexpr, BLOCK: tl.constexpr):
    # STOPS_EARLY: a neural grid whose review rounds end once the row has its tokens (beta counts)
    row = tl.program_id(0).to(tl.int64)
    alpha = _rate(model_acc_ptr, model_chk_ptr, row, prior, prior_rate, NEURAL)
    gamma = _rate(mag_acc_ptr, mag_chk_ptr, row, prior, 0.5, HAS_MAG)
    beta = _rate(review_acc_ptr, review_chk_ptr, row, prior, 0.5, STOPS_EARLY)
    sigma = _rate(sibling_acc_ptr, sibling_chk_ptr, row, prior, 0.5, TREES == 2)
    N: tl.constexpr = M + 1
    i = tl.arange(0, BLOCK)
    t = i // ((A + 1) * N * N)
    a = i // (N * N) % (A + 1)
    c = i // N % N
    g = i % N
    if HAS_READY:  # with no model tokens MaG adds what it proposes now
        g = tl.where(a == 0, tl.minimum(g, tl.load(ready_ptr + row)), g)
    af, cf, gf = a.to(tl.float32), c.to(tl.float32), g.to(tl.float32)
    tokens = _geometric(alpha, af) + _power(alpha, af) * (_geometric(gamma, gf) - 1)
    if STOPS_EARLY:
        reviews = tl.math.ceil(af / (1 + beta * cf))
    else:
        reviews = af
    model = tl.load(model_ptr)
    review_cost = model + tl.load(width_ptr + 1 + c) - 1
    width = 1 + a + g
    if TREES == 2:
        gain = tl.zeros([BLOCK], dtype=tl.float32)
        reach = alpha * 0 + 1  # alpha^d: a row reaches depth d + 1 with that probability
        for d in tl.static_range(D):
            gain += tl.where((a >= d + 1) & (tl.load(extra_ptr + d) > 0), reach, 0.0)
            reach = reach * alpha
        tokens += tl.where(t == 1, sigma * (1 - alpha) * gain, 0.0)
        width += tl.where(t == 1, tl.load(nodes_ptr + a + g), 0)
    catch_up = tl.where(a > 0, tl.load(first_ptr) - model, 0.0)
    value = tokens / (tl.load(width_ptr + width) + reviews * review_cost + catch_up)
    value = tl.where((i < TREES * (A + 1) * N * N) & (c <= tl.maximum(a - 1, 0)), value, float("-inf"))
    top = tl.max(value, axis=0)
    best = tl.min(tl.where(value >= top - _TIE * tl.abs(top), i, BLOCK), axis=0)  # the first (near-)best
    tl.store(pick_ptr + row, (best // ((A + 1) * N * N)).to(tl.int64))
    tl.store(pick_ptr + batch + row, (best // (N * N) % (A + 1)).to(tl.int64))
    tl.store(pick_ptr + 2 * batch + row, (best // N % N).to(tl.int64))
    tl.store(pick_ptr + 3 * batch + row, tl.sum(tl.where(i == best, g, 0), axis=0).to(tl.int64))  # g', clamped


@functools.cache  # made on a strategy's first (eager) call: a host-to-device copy cannot be captured
def _tree_tables(tree: tuple, drafts: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(nodes [drafts + 1]: the tree's sibling nodes within a draft of w tokens, extra [D]: each
    depth's siblings)."""
    extra = torch.tensor(tree or (1,), dtype=torch.int64, device=device) - 1
    depth = torch.arange(drafts + 1, device=device).clamp(max=len(tree))
    return torch.cat([extra.new_zeros(1), extra.cumsum(0)])[depth], extra


def _check(grid: Grid, prices: Prices, counts: Counts) -> None:
    if (counts.model is None) != (grid.max_tokens == 0) or (counts.mag is None) != (grid.mag_tokens == 0) \
            or (counts.siblings is None) != (not grid.tree) or (grid.stops_early and counts.model is not None
                                                                and counts.reviews is None):
        raise ValueError(f"draft budget counts {counts} do not match the grid {grid}")
    need = 2 + grid.max_tokens + grid.mag_tokens + sum(b - 1 for b in grid.tree)  # widths 0 .. 1 + a + g + nodes
    if prices.width.dim() != 1 or prices.width.numel() < need:
        raise ValueError(f"prices.width must be a 1-D table of at least {need} forward costs (widths 0..{need - 1}), "
                         f"got {list(prices.width.shape)}")
    for name in ("model", "first"):
        if getattr(prices, name).shape != (1,):
            raise ValueError(f"prices.{name} must hold one forward cost, shape [1], got "
                             f"{list(getattr(prices, name).shape)}")


def draft_budgets(grid: Grid, prices: Prices, counts: Counts, ready: torch.Tensor | None = None) -> torch.Tensor:
    """[4, B] int64: each row's chosen (t, a, c, g) in one launch (the module docstring's rule).
    ready [B] int64 or None: MaG's proposal length at the committed end."""
    _check(grid, prices, counts)
    pairs = [counts.model, counts.mag, counts.reviews, counts.siblings]
    batch = next(p[0].shape[0] for p in pairs if p is not None)
    device = prices.width.device
    pick = torch.empty(4, batch, dtype=torch.int64, device=device)
    if batch == 0:
        return pick
    nodes, extra = _tree_tables(grid.tree, grid.max_tokens + grid.mag_tokens, device)
    dummy = pick
    pointers = [x.contiguous() for p in pairs for x in (p if p is not None else (dummy, dummy))]  # read as [B]
    trees, na, n = grid.shape[:3]
    _budget_kernel[(batch,)](
        *pointers, ready.contiguous() if ready is not None else dummy, prices.width, prices.model, prices.first,
        nodes, extra, pick, batch, float(grid.prior), float(grid.prior_rate), A=grid.max_tokens, M=grid.mag_tokens,
        D=max(1, len(grid.tree)), TREES=trees, NEURAL=counts.model is not None, HAS_MAG=counts.mag is not None,
        STOPS_EARLY=grid.stops_early and counts.model is not None, HAS_READY=ready is not None, BLOCK=triton.next_power_of_2(trees * na * n * n))
    return pick


def _counted_rate(pair, prior: float, prior_rate: float) -> torch.Tensor:
    return (pair[0] + prior_rate * prior) / (pair[1] + prior)


def budget_values_ref(grid: Grid, prices: Prices, counts: Counts,
                      ready: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [B, T * (A+1) * (M+1) * (M+1)] in the kernel's order, g' [B, same]): every choice's
    tokens per cost, -inf where excluded. Fixed-shape tensor ops, no host read."""
    tokens, cost, g, excluded = _tokens_and_costs(grid, prices, counts, ready)
    return (tokens / cost).masked_fill(excluded, float("-inf")), g


def _tokens_and_costs(grid: Grid, prices: Prices, counts: Counts, ready: torch.Tensor | None):
    """(expected tokens [B, G], cost [B, G], g' [B, G], excluded [G]) of every choice."""
    _check(grid, prices, counts)
    width_costs = prices.width
    trees, na, n, _ = grid.shape
    device = width_costs.device
    batch = next(p[0].shape[0] for p in (counts.model, counts.mag, counts.reviews, counts.siblings) if p is not None)
    zero = torch.zeros(batch, device=device)
    alpha = zero if counts.model is None else _counted_rate(counts.model, grid.prior, grid.prior_rate)
    gamma = zero if counts.mag is None else _counted_rate(counts.mag, grid.prior, 0.5)
    flat = torch.arange(trees * na * n * n, device=device)
    t, a, c, g = flat // (na * n * n), flat // (n * n) % na, flat // n % n, flat % n  # [G] each
    g = g.expand(batch, -1)
    if ready is not None:
        g = torch.where(a == 0, torch.minimum(g, ready[:, None]), g)
    af, cf, gf = a.float(), c.float(), g.float()
    rate = alpha[:, None]
    tokens = _geometric_ref(rate, af) + rate ** af * (_geometric_ref(gamma[:, None], gf) - 1)
    if grid.stops_early and counts.model is not None:
        beta = _counted_rate(counts.reviews, grid.prior, 0.5)[:, None]
        reviews = torch.ceil(af / (1 + beta * cf))
    else:
        reviews = af.expand(batch, -1)
    review_cost = prices.model + width_costs[1 + c] - 1
    width = 1 + a + g
    if grid.tree:
        nodes, extra = _tree_tables(grid.tree, grid.max_tokens + grid.mag_tokens, device)
        depths = torch.arange(len(grid.tree), device=device)
        reach = rate ** depths.float()  # [B, D]: alpha^(d - 1), the chance a row reaches depth d
        sibling_depths = ((a[:, None] >= depths + 1) & (extra > 0)).float()  # [G, D]
        gain = _counted_rate(counts.siblings, grid.prior, 0.5)[:, None] * (1 - rate) * (reach @ sibling_depths.t())
        tokens = tokens + torch.where(t == 1, gain, 0.0)
        width = width + torch.where(t == 1, nodes[a + g], 0)
    catch_up = torch.where(a > 0, prices.first - prices.model, 0.0)
    return tokens, width_costs[width] + reviews * review_cost + catch_up, g, c > (a - 1).clamp(min=0)


def draft_budgets_ref(grid: Grid, prices: Prices, counts: Counts, ready: torch.Tensor | None = None,
                      shared_by: torch.Tensor | None = None) -> torch.Tensor:
    """The PyTorch reference of `draft_budgets`: [4, B] int64 (t, a, c, g) per row.
    shared_by [B] bool (reference only): these rows take one choice, the best for their tokens
    summed over their costs summed (where a step is as wide and runs as many reviews as its
    widest row asks for, what one row saves by asking less, the others spend anyway); every row
    takes it, its g' clamped by its own `ready`."""
    tokens, cost, g, excluded = _tokens_and_costs(grid, prices, counts, ready)
    if shared_by is None:
        value = tokens / cost
    else:
        share = shared_by[:, None].float()
        value = ((tokens * share).sum(0) / (cost * share).sum(0).clamp_min(1e-30)).expand_as(tokens)
    value = value.masked_fill(excluded, float("-inf"))
    trees, na, n, _ = grid.shape
    top = value.max(1, keepdim=True).values
    best = (value >= top - TIE * top.abs()).int().argmax(1)  # the first (near-)best, as the kernel's
    return torch.stack([best // (na * n * n), best // (n * n) % na, best // n % n, g.gather(1, best[:, None])[:, 0]])


def _geometric_ref(rate: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return (1 - rate ** (n + 1)) / (1 - rate).clamp_min(1e-6)
