"""Cascade.auto(): every row chooses its own draft budgets each step, deterministically.

The engine's drafters must be [model, MaG] or [MaG]. The plan is the envelope
K = [[A, M], [0, M]] (A = max_tokens model tokens for the target, then up to M = mag_tokens
MaG tokens, which MaG proposes only where it matches, at no forward's cost). Before each step a
row picks the model budget a <= A, the MaG tokens c <= min(M, a - 1) the model reviews at a time
(c = 0: the model drafts alone, one token per forward) and the top-level MaG budget g <= M that
maximise its expected tokens per cost (kernels/draft_budget.py evaluates the grid, one launch a
step on a GPU; choices of equal value go to the fewest drafts):

    tokens(a, c, g) = 1 + alpha + ... + alpha^a + alpha^a (gamma + ... + gamma^g)
    cost(a, c, g)   = width(1 + a + g) + reviews(a, c) (c_model + width(1 + c) - 1)

reviews(a, c) = ceil(a / (1 + beta c)) where a step's review rounds end once no row needs more
(the CPU, Models.trim_drafts); a where the step runs every round its widest row asks for (a GPU's
step graph, rows that are done masked): there reviewing MaG's tokens saves no forward, so c = 0,
and the plan is K = [[A, M], [0, 0]]: no MaG call below the model, whose reviews are its own
one-token forwards.

alpha: the row's counted per-token rate at which the target accepts the model's tokens (accepted
over checked, where a token after a rejection is not checked: the rate the geometric sum
assumes), gamma: the same for MaG's top-level tokens (StepMetrics.source_*; where the target reads
the plan's whole width, a GPU, a slot asked for and left empty counts as a miss), beta: the share of
MaG tokens the model accepted in its reviews, all counted in this generate call with a prior worth
`prior` drafts: `prior_rate` for alpha (0.8, optimistic as in Speculative.auto: a row learns alpha
only by drafting, so a pessimistic start stops it for good after a few misses), 0.5 for gamma and
beta; c_model: the model's forward cost relative to the target's, from the bytes its forward streams unless
`model_cost` gives it; width(n): a target forward over n tokens relative to a one-token one,
the platform's curve (budget.width_costs) unless `width_cost` gives a slope. A model review of
1 + c tokens costs its one-token forward plus the target's width increment: more than the model's
own forward (on the AVX2 kernel the Qwen 0.5B's 5-token forward costs 0.48 of the 1.5B's one-token
forward, priced 0.68), which chose better on the bench prompts than pricing it as measured: the MaG
tokens the model accepts, leniently, are worth less to the target than its own, and one alpha
does not see that.

With a = 0, MaG's top-level tokens are the ones it proposes now (g <= its proposal's length,
known before the step): where MaG holds nothing, the model competes with plain decoding, not
with MaG's hypothetical tokens, so a model whose rate was once underestimated is tried again.
a = g = 0 is plain decoding.

With `tree=(b_1, b_2, ...)` a row also chooses whether the target checks its draft as the trunk
of that top-level tree (Cascade.tree: b_d - 1 siblings at depth d, the model's next most likely
tokens there). A sibling is a leaf: where the target rejects the model's trunk token at a depth
with siblings and takes one of them, the step emits one token more. So the tree adds

    sigma (1 - alpha) (sum over depths d <= a with siblings of alpha^(d - 1))

tokens for the width of its nodes up to the draft's depth a + g (siblings past the model's tokens
duplicate MaG's and only cost): sigma is the row's counted share of such rejections where it took
a sibling (StepMetrics.sibling_*, prior 0.5). Where a forward's width is nearly free (a GPU) the
tree pays for a modest sigma; where it is not (the CPU curves), rarely.

At more than one row on a CPU curve the costs are the step's rows' and the rows take one
choice, the best for their summed tokens (budget.prices): there a forward computes every row as
wide, and the review rounds run, as the widest row asks for.

Nothing here is timed: a seeded request gives the same tokens however often it runs, and
whatever shares its batch where each row chooses alone. Rows with a long MaG match go direct
(Cascade.direct_match, direct_tokens): their tokens do not count toward gamma, and they check no
tree.
"""
from dataclasses import dataclass

import torch

from csd_engine.checks import is_int
from csd_engine.drafters.mag import MaG
from csd_engine.kernels import use_kernels
from csd_engine.kernels.draft_budget import Counts, Grid, draft_budgets, draft_budgets_ref
from csd_engine.strategies.base import DecodeState, Models, require_one_device
from csd_engine.strategies.budget import PriceBook, check_pricing, cost_ratio
from csd_engine.strategies.cascade import CascadeDecoder, check_settings, check_tree_fits, checked_tree, compile_plan


@dataclass(frozen=True)
class AutoCascade:
    max_tokens: int = 6  # largest budget tried per source
    lenience: float = 2.0
    mag_tokens: int = 4
    direct_match: int = 8
    direct_tokens: int = 16
    width_cost: float | None = None  # a slope: one more token's cost in a forward (default: the platform's curve)
    prior: float = 4.0  # drafts' worth of the prior acceptance rates
    prior_rate: float = 0.8  # the model's prior rate alpha (MaG's and the reviews' start at 0.5)
    model_cost: float | None = None  # the model's forward cost relative to the target's (default: budget.cost_ratio)
    tree: tuple = ()  # the top-level tree a row may choose (candidates per depth, trunk included); (): never

    def __post_init__(self):
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"Cascade.auto(max_tokens=...) must be an int >= 1, got {self.max_tokens!r}")
        check_settings("Cascade.auto", self.lenience, self.mag_tokens, self.direct_match, self.direct_tokens)
        check_pricing("Cascade.auto", self.prior, self.prior_rate, self.model_cost, self.width_cost)
        object.__setattr__(self, "tree", checked_tree(self.tree, "Cascade.auto(tree=...)"))

    def decoder(self, models: Models):
        require_one_device(models, "Cascade.auto()")
        kinds = ["mag" if isinstance(d, MaG) else "model" for d in models.drafters]
        if kinds not in (["model", "mag"], ["mag"]):
            raise ValueError(f"Cascade.auto() tunes a target with one neural drafter and MaG (drafters=[model, "
                             f"'mag']; on the command line --drafter MODEL --drafter mag) or MaG alone (['mag']); "
                             f"this engine's drafters are {kinds}: add 'mag' last, or give an explicit "
                             "Cascade(k_matrix=...) (--k-matrix) for other cascades")
        check_tree_fits(self.tree, "Cascade.auto(tree=...)", models, neural=len(kinds) == 2)
        a, m = self.max_tokens, self.mag_tokens
        k = ((a, m), (0, m)) if len(kinds) == 2 else ((m,),)
        if len(kinds) == 2 and not models.trim_drafts:  # every review round runs: c = 0, no MaG level below
            k = ((a, m), (0, 0))
        plan = compile_plan(k, [kind == "mag" for kind in kinds], m)
        cost = self.model_cost
        if cost is None and len(kinds) == 2:
            cost = cost_ratio(models, 0)
        return AutoCascadeDecoder(models, plan, float(self.lenience), m, self.tree, self.direct_match,
                                  self.direct_tokens, self, cost or 0.0)


class AutoCascadeDecoder(CascadeDecoder):
    track_sources = True  # alpha is the target's rate on the model's tokens alone
    chooses_tree = True  # with a tree, each row's plan says whether it wants it
    reads_proposal = True  # with a = 0, g is at most what MaG proposes now

    def __init__(self, models, plan, lenience, mag_tokens, tree, direct_match, direct_tokens, config: AutoCascade,
                 model_cost: float):
        super().__init__(models, plan, lenience, mag_tokens, tree, direct_match, direct_tokens)
        self.config = config
        top = self.levels.sources
        self.neural_source = next((s for s in top if s.below is not None), None)
        self.mag_source = next(s for s in top if s.below is None)
        below = self.neural_source.below.sources if self.neural_source else ()
        self.sub_mag_source = below[0] if below else None  # None: the model drafts alone (the device path)
        # the choice grid's host constants (kernels/draft_budget.py: one launch on a GPU)
        self.grid = Grid(config.max_tokens if self.neural_source else 0, mag_tokens, self.tree, config.prior,
                         config.prior_rate, stops_early=models.trim_drafts)
        widest = 1 + config.max_tokens + mag_tokens + sum(b - 1 for b in self.tree)
        self.prices = PriceBook(models, config.width_cost, model_cost, widest, 0 if self.neural_source else None)

    def start(self, state: DecodeState) -> None:
        super().start(state)
        self.prices(state.batch)

    def plan_budgets(self, state: DecodeState, direct: torch.Tensor, ready: torch.Tensor | None):
        """Each row's best (t, a, c, g) as budgets, caps and whether it wants the tree (None
        without one)."""
        budgets, caps = self.k_budgets(state, direct)
        m, top_mag, neural = state.metrics, self.mag_source.index, self.neural_source
        model = None if neural is None else (m.source_accepted[neural.index], m.source_checked[neural.index])
        reviews = (m.level_accepted[1], m.level_drafted[1]) if neural and self.grid.stops_early else None
        siblings = (m.sibling_accepted, m.sibling_checked) if self.tree else None
        counts = Counts(model, (m.source_accepted[top_mag], m.source_checked[top_mag]), reviews, siblings)
        prices = self.prices(state.rows_in_use or state.batch)
        if prices.shared:  # the active rows that do not go direct take one choice (budget.prices)
            pick_t, pick_a, pick_c, pick_g = draft_budgets_ref(self.grid, prices, counts, ready,
                                                               shared_by=state.active & ~direct)
        else:
            choose = draft_budgets if use_kernels(state.pending) else draft_budgets_ref
            pick_t, pick_a, pick_c, pick_g = choose(self.grid, prices, counts, ready)
        if self.neural_source is not None:
            budgets[self.neural_source.index] = torch.where(direct, budgets[self.neural_source.index], pick_a)
        if self.sub_mag_source is not None:
            caps[self.sub_mag_source.index] = pick_c
        budgets[top_mag] = torch.where(direct, budgets[top_mag], pick_g)
        caps[top_mag] = torch.where(direct, caps[top_mag], pick_g)
        return budgets, caps, (pick_t > 0) & ~direct if self.tree else None
