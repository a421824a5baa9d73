"""The cascade's K matrix compiled into a fixed plan of rounds (docs/algorithms.md, The K matrix).

Row 0 of K says how many tokens each drafter (largest first) adds to the draft a reviewer
receives; a neural drafter's own drafts come from the cascade below it (the sub-matrix).
`compile_plan` turns that into a tree of `Source`s whose number of calls per step is known
on the host: a MaG source is called ceil(K entry / mag_tokens) times, a neural source reviews
at most K entry times (each review adds at least one token). Rows that already hold enough
tokens run those calls masked, so a step is the same sequence of device work whatever the
data, and every row's draft depends on that row alone.
"""
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Source:
    drafter: int  # index into the engine's drafters
    tokens: int  # what K asks of it: tokens it adds to the draft
    calls: int  # host-known bound on its calls per draft (MaG proposals or reviews)
    below: "Level | None"  # the cascade whose drafts a neural drafter reviews (None: MaG)
    index: int  # position in `Level.all_sources()` order (per-row budgets are keyed by it)


@dataclass(frozen=True)
class Level:
    sources: tuple[Source, ...]
    max_growth: int  # host-known bound on the tokens one draft of this level adds

    def all_sources(self) -> list[Source]:
        out = []
        for source in self.sources:
            out.append(source)
            if source.below is not None:
                out += source.below.all_sources()
        return sorted(out, key=lambda s: s.index)


def compile_plan(k: tuple[tuple[int, ...], ...], is_mag: list[bool], mag_tokens: int) -> Level:
    """K (validated, n x n for drafters 0..n-1) -> the plan of the top level."""
    counter = iter(range(1 << 30))

    def level(rows, offset: int) -> Level:
        sources, growth = [], 0
        for i, tokens in enumerate(rows[0]):
            if tokens == 0:
                continue
            drafter = offset + i
            goal = sum(rows[0][:i + 1])
            index = next(counter)
            if is_mag[drafter]:
                below, calls, step = None, math.ceil(tokens / mag_tokens), mag_tokens
            else:
                below = level([r[i + 1:] for r in rows[i + 1:]], drafter + 1)
                calls, step = tokens, below.max_growth + 1
            growth = max(growth, _grown(growth, calls, step, goal))
            sources.append(Source(drafter, tokens, calls, below, index))
        return Level(tuple(sources), growth)

    return level(k, 0)


def _grown(growth, calls, step, goal):
    """Bound on a draft after a source's calls: each call adds at most `step` tokens, and the
    source stops once the draft holds its `goal` (its last call may overshoot by step - 1)."""
    return min(growth + calls * step, goal - 1 + step) if isinstance(growth, int) else \
        torch.minimum(growth + calls * step, goal - 1 + step)


def draft_bound(plan: Level, budgets: list[torch.Tensor], mag_tokens: int) -> torch.Tensor:
    """[B]: compile_plan's bound on the top-level draft, per row for the row's own budgets of
    the top-level sources (<= plan.max_growth; equal when every budget is K's)."""
    growth = goal = torch.zeros_like(budgets[plan.sources[0].index])
    for s in plan.sources:
        b = budgets[s.index]
        calls, step = (b, s.below.max_growth + 1) if s.below is not None else ((b + mag_tokens - 1) // mag_tokens,
                                                                               mag_tokens)
        goal = goal + b
        growth = torch.where(b > 0, torch.maximum(growth, _grown(growth, calls, step, goal)), growth)
    return growth


def budgets_from_k(plan: Level, batch: int, device) -> list[torch.Tensor]:
    """Every row's budget per source (`Source.index` order): what K asks."""
    return [torch.full((batch,), s.tokens, dtype=torch.int64, device=device) for s in plan.all_sources()]
