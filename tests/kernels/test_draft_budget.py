"""kernels/draft_budget.py: the one-launch draft choice picks what its PyTorch reference picks
(or, where a value straddles the tie tolerance, a choice worth the reference's best to 1e-5),
over random grids (with and without a model, MaG, a tree, early-stopping reviews, MaG's
proposal lengths) and counts; choices equal in exact arithmetic go to the fewest drafts in
both; and the reference is the rule its docstring states, checked by hand."""
import random

import pytest
import torch

from csd_engine.kernels.draft_budget import Counts, Grid, Prices, budget_values_ref, draft_budgets, draft_budgets_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pair(rng: random.Random, batch: int, zero: bool = False):
    checked = torch.tensor([rng.randint(0, 60) for _ in range(batch)], device=DEVICE)
    accepted = torch.zeros_like(checked) if zero else (checked * torch.rand(batch, device=DEVICE)).long()
    return accepted, checked


def random_case(rng: random.Random):
    batch = rng.randint(1, 5)
    a, m = rng.choice([(0, rng.randint(1, 4)), (rng.randint(1, 6), 0), (rng.randint(1, 6), rng.randint(1, 4))])
    tree = tuple(rng.randint(1, 3) for _ in range(rng.randint(1, 3))) if a and rng.random() < 0.5 else ()
    grid = Grid(a, m, tree, prior=rng.choice([1.0, 4.0]), prior_rate=rng.choice([0.0, 0.5, 0.8]),
                stops_early=rng.random() < 0.5)
    n = 2 + a + m + sum(b - 1 for b in tree)
    slope = rng.choice([0.0, 0.02, 0.3])
    model = rng.choice([0.0, 0.05, 0.3, 1.2])
    prices = Prices((1 + slope * (torch.arange(n, device=DEVICE).clamp(min=1) - 1)).float(),
                    torch.tensor([model], device=DEVICE), torch.tensor([model * rng.choice([1, 1.5, 3])], device=DEVICE))
    counts = Counts(pair(rng, batch, zero=rng.random() < 0.2) if a else None, pair(rng, batch) if m else None,
                    pair(rng, batch) if a and grid.stops_early else None, pair(rng, batch) if tree else None)
    ready = torch.tensor([rng.randint(0, m + 2) for _ in range(batch)], device=DEVICE) \
        if m and rng.random() < 0.5 else None
    return grid, prices, counts, ready


def assert_same_choice(grid, prices, counts, ready, where):
    got, want = draft_budgets(grid, prices, counts, ready), draft_budgets_ref(grid, prices, counts, ready)
    if torch.equal(got, want):
        return
    values, _ = budget_values_ref(grid, prices, counts, ready)
    trees, na, n, _ = grid.shape
    index = ((got[0] * na + got[1]) * n + got[2]) * n + got[3]  # g' where clamped: the same value
    picked, best = values.gather(1, index[:, None])[:, 0], values.max(1).values
    assert torch.all(picked >= best - 1e-5 * best.abs()), f"{where}: kernel {got.tolist()} ref {want.tolist()}"


def test_random_grids_choose_as_the_reference():
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    for case in range(150):
        grid, prices, counts, ready = random_case(rng)
        assert_same_choice(grid, prices, counts, ready, f"seed {seed} case {case} {grid}")


def test_the_reference_is_the_stated_rule():
    """One row by hand: alpha = (3 + 0.8 * 4) / (5 + 4), a chain of a model tokens costs a target
    forward 1 + a wide (slope 0.1) and a reviews of 0.2, the first of them 0.35; no MaG, no tree.
    Every a's value, and the pick is the best."""
    grid = Grid(4, 0, (), prior=4.0, prior_rate=0.8, stops_early=False)
    prices = Prices(1 + 0.1 * (torch.arange(6, device=DEVICE).clamp(min=1) - 1).float(),
                    torch.tensor([0.2], device=DEVICE), torch.tensor([0.35], device=DEVICE))
    counts = Counts((torch.tensor([3], device=DEVICE), torch.tensor([5], device=DEVICE)), None, None, None)
    alpha = (3 + 0.8 * 4) / (5 + 4)
    expected = [sum(alpha ** i for i in range(a + 1)) / (1 + 0.1 * a + 0.2 * a + 0.15 * (a > 0)) for a in range(5)]
    values, _ = budget_values_ref(grid, prices, counts)
    assert torch.allclose(values[0].cpu(), torch.tensor(expected), rtol=1e-6)
    best = max(range(5), key=lambda a: expected[a])
    assert draft_budgets_ref(grid, prices, counts)[:, 0].tolist() == [0, best, 0, 0]
    assert draft_budgets(grid, prices, counts)[:, 0].tolist() == [0, best, 0, 0]


def test_choices_equal_in_exact_arithmetic_go_to_the_fewest_drafts():
    """MaG alone at its prior rate 0.5, a forward 0.2 wider per token: 1 token is worth 1.5 / 1.2
    and 2 are worth 1.75 / 1.4, both 1.25 exactly (here in float32 too): kernel and reference both
    take the fewer, 1 (and 0 where MaG proposes nothing now). Where rounding splits such a tie
    (the tree and model grids, ~1 in 250 random states), the 1e-6 tolerance keeps this rule."""
    grid = Grid(0, 4, (), prior=4.0, prior_rate=0.8, stops_early=False)
    prices = Prices(1 + 0.2 * (torch.arange(6, device=DEVICE).clamp(min=1) - 1).float(), torch.zeros(1, device=DEVICE),
                    torch.zeros(1, device=DEVICE))
    zeros = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    counts = Counts(None, (zeros, zeros), None, None)
    ready = torch.tensor([4, 0], device=DEVICE)
    for choose in (draft_budgets, draft_budgets_ref):
        assert choose(grid, prices, counts, ready)[3].tolist() == [1, 0], choose.__name__


def test_mismatched_counts_and_short_tables_are_refused():
    grid = Grid(2, 2, (), prior=4.0, prior_rate=0.8, stops_early=False)
    one = (torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    model = torch.tensor([0.1])
    with pytest.raises(ValueError, match="do not match the grid"):
        draft_budgets_ref(grid, Prices(torch.ones(6), model, model), Counts(one, None, None, None))
    with pytest.raises(ValueError, match="at least 6"):
        draft_budgets_ref(grid, Prices(torch.ones(5), model, model), Counts(one, one, None, None))
    with pytest.raises(ValueError, match="shape \\[1\\]"):
        draft_budgets_ref(grid, Prices(torch.ones(6), torch.tensor(0.1), model), Counts(one, one, None, None))


def test_shared_rows_take_the_choice_best_for_their_summed_tokens():
    """shared_by: two rows at alpha 0.95 and 0.2 (counted over 1000 drafts), a forward 0.4 dearer per
    token and 0.05 a model forward: alone the first drafts and the second does not; sharing, both
    take the length best for their tokens summed over their costs summed, computed here by hand. A
    row outside the shared set counts for nothing and still takes the choice."""
    grid = Grid(3, 0, (), prior=4.0, prior_rate=0.8, stops_early=False)
    prices = Prices(1 + 0.4 * (torch.arange(5, device=DEVICE).clamp(min=1) - 1).float(),
                    torch.tensor([0.05], device=DEVICE), torch.tensor([0.05], device=DEVICE))
    checked = torch.tensor([1000, 1000, 1000], device=DEVICE)
    counts = Counts((torch.tensor([950, 200, 1000], device=DEVICE), checked), None, None, None)
    alphas = [(950 + 3.2) / 1004, (200 + 3.2) / 1004]
    cost = [1 + 0.4 * a + 0.05 * a for a in range(4)]
    alone = [max(range(4), key=lambda a: sum(r ** i for i in range(a + 1)) / cost[a]) for r in alphas]
    shared = max(range(4), key=lambda a: sum(sum(r ** i for i in range(a + 1)) for r in alphas) / (2 * cost[a]))
    assert alone[0] > 0 and alone[1] == 0 and 0 < shared < alone[0], (alone, shared)
    assert draft_budgets_ref(grid, prices, counts)[1, :2].tolist() == alone
    rows = torch.tensor([True, True, False], device=DEVICE)
    assert draft_budgets_ref(grid, prices, counts, shared_by=rows)[1].tolist() == [shared] * 3
    nobody = torch.zeros(3, dtype=torch.bool, device=DEVICE)
    assert draft_budgets_ref(grid, prices, counts, shared_by=nobody)[1].tolist() == [0] * 3
