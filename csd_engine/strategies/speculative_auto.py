"""Speculative.auto(): chain speculation with a neural drafter whose rows choose their own draft
length each step, deterministically (csd_engine.strategies.budget).

Before each step a row picks the length a <= max_tokens that maximises its expected tokens per
cost: tokens(a) = 1 + alpha + ... + alpha^a, cost(a) = width(a + 1) + model_cost a (a target forward
a + 1 tokens wide, costed by the platform's width curve, budget.width_costs; a drafter forward a
token), where
alpha is the row's counted per-token rate at which the target accepted its drafts (accepted over
checked; a token after a rejection is not checked), starting from `prior_rate` worth `prior`
tokens: optimistic, because a row learns its rate only by drafting (at 0.5 a drafter costing
more than half a target forward per token would never be tried). a = 0 is plain decoding: where
no row drafts, the drafter sits out the step and catches up on the row's next draft. Within a
step the drafter also stops a row before a token its top probability puts under
`min_confidence`. At more than one row on a CPU curve the costs are the step's rows' and the
rows take one length, the best for their summed tokens (budget.prices).
"""
from dataclasses import dataclass

import torch

from csd_engine.checks import is_int
from csd_engine.drafters.mag import MaG
from csd_engine.strategies.base import (DRAFT_STREAM, DecodeState, Draft, Models, StepOutput, check_drafter_index,
                                        commit, roll_back_drafters, verify_chain)
from csd_engine.kernels import use_kernels
from csd_engine.kernels.draft_budget import Counts, Grid, draft_budgets, draft_budgets_ref
from csd_engine.strategies.budget import PriceBook, check_pricing, cost_ratio
from csd_engine.strategies.speculative import SpeculativeDecoder, check_confidence, check_drafter, draft_chain


@dataclass(frozen=True)
class AutoSpeculative:
    max_tokens: int = 6  # the longest draft a row may choose
    drafter: int = 0
    min_confidence: float = 0.0
    prior: float = 4.0  # drafts' worth of the prior acceptance rate
    prior_rate: float = 0.8
    model_cost: float | None = None  # the drafter's forward cost relative to the target's (default: budget.cost_ratio)
    width_cost: float | None = None  # one more token's cost in a target forward (default: the platform's curve)

    def __post_init__(self):
        if not is_int(self.max_tokens) or not 1 <= self.max_tokens <= 64:
            raise ValueError(f"Speculative.auto(max_tokens=...) must be an int in [1, 64], got {self.max_tokens!r}")
        check_drafter_index(self.drafter, "Speculative.auto")
        check_confidence(self.min_confidence, "Speculative.auto")
        check_pricing("Speculative.auto", self.prior, self.prior_rate, self.model_cost, self.width_cost)

    def decoder(self, models: Models):
        check_drafter(models, self.drafter, "Speculative.auto()")
        if isinstance(models.drafters[self.drafter], MaG):
            raise ValueError("Speculative.auto() tunes a neural drafter's draft length; MaG's drafts are already "
                             "only what it matched: use Speculative(k=...) with MaG")
        cost = cost_ratio(models, self.drafter) if self.model_cost is None else self.model_cost
        return AutoSpeculativeDecoder(models, self, float(cost))


class AutoSpeculativeDecoder(SpeculativeDecoder):
    sources = ("drafter",)  # one top-level source: StepMetrics.source_* count the target's verdicts on its tokens

    def __init__(self, models: Models, config: AutoSpeculative, model_cost: float):
        super().__init__(models, config.max_tokens, config.drafter, config.min_confidence)
        self.config = config
        # a chain is the draft-budget grid without MaG or a tree (kernels/draft_budget.py)
        self.grid = Grid(config.max_tokens, 0, (), config.prior, config.prior_rate, stops_early=False)
        self.prices = PriceBook(models, config.width_cost, model_cost, config.max_tokens + 1, config.drafter)

    def start(self, state: DecodeState) -> None:
        super().start(state)
        self.prices(state.batch)

    def budget(self, state: DecodeState) -> torch.Tensor:
        """[B] each active row's draft length for the next step (0 for the others): the plan's
        second column, which the step reads on the device (state.plan)."""
        counts = Counts((state.metrics.source_accepted[0], state.metrics.source_checked[0]), None, None, None)
        prices = self.prices(state.rows_in_use or state.batch)
        if prices.shared:  # the active rows take one length (budget.prices)
            return draft_budgets_ref(self.grid, prices, counts, shared_by=state.active)[1] * state.active
        choose = draft_budgets if use_kernels(state.pending) else draft_budgets_ref  # one launch on a GPU
        return choose(self.grid, prices, counts)[1] * state.active

    def plan(self, state: DecodeState) -> torch.Tensor:
        """[B, 2]: how far the drafter's cache trails the committed prefix, the row's draft length."""
        return torch.stack([state.committed - self.drafter.cache.lengths, self.budget(state)], 1)

    def graph_columns(self, columns: tuple) -> tuple:
        """A step graph's key: the lag matters only in a step where some row drafts."""
        return columns if columns[1] else (0, 0)

    def step(self, state: DecodeState, plan) -> StepOutput:
        behind, rounds = [max(column) for column in zip(*plan)] or [0, 0]
        if rounds:
            draft = draft_chain(self.drafter, state, rounds, self.models.verifier, DRAFT_STREAM, self.drafter_index,
                                max_behind=max(behind, 1), budget=state.plan[1],
                                min_confidence=self.min_confidence, stop_early=self.models.trim_drafts)
        else:  # nobody drafts: a plain decoding step, the drafter untouched
            draft = Draft.empty(state)
        out, accepted = verify_chain(self.models, state, draft, counters=self.k + 1)
        state.metrics.record_sources(torch.zeros_like(draft.tokens), draft.length, accepted, state.active, [0])
        roll_back_drafters([self.drafter], state.committed + accepted + 1)
        commit(state, out)
        return out
