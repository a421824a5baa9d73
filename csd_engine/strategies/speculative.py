"""Chain speculative decoding: one drafter (a model or MaG) drafts up to k tokens, the target
verifies them in one forward, every cache rolls back by length (docs/algorithms.md, chain
verification).

With MaG the draft is what MaG matched, per row (0..k tokens): a row with nothing worth
proposing decodes one token. MaG's proposal depends on the committed sequence only, so its
length is the step's `plan`, read with the previous step's tokens: the target reads exactly
as many tokens as the longest proposal in the batch, none past it.
"""
from dataclasses import dataclass

import torch

from csd_engine.drafters.mag import MaG
from csd_engine.strategies.base import (DRAFT_STREAM, DecodeState, Draft, Models, StepOutput, catch_up_tokens,
                                        commit, forward_tokens, logits_at, require_one_device, roll_back_drafters,
                                        verify_chain)


@dataclass(frozen=True)
class Speculative:
    """Up to k draft tokens per target forward from drafters[drafter] (a model drafts exactly k)."""

    k: int = 4
    drafter: int = 0

    def __post_init__(self):
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= 64:
            raise ValueError(f"Speculative.k must be an int in [1, 64], got {self.k!r}")

    def decoder(self, models: Models):
        if not 0 <= self.drafter < len(models.drafters):
            raise ValueError(f"Speculative(drafter={self.drafter}) needs engine.drafters[{self.drafter}]; "
                             f"the engine has {len(models.drafters)} drafter(s)")
        require_one_device(models, "Speculative")
        return SpeculativeDecoder(models, self.k, self.drafter)


def draft_chain(drafter, state: DecodeState, k: int, verifier, stream: int, metrics_index: int) -> Draft:
    """k tokens drafted autoregressively by a neural drafter (sampled at the request's own
    temperature / top-k / top-p; q is None when every row is greedy). The drafter ends with
    pending, x_1..x_{k-1} written after the committed prefix."""
    ids, counts = catch_up_tokens(state, drafter, max_behind=1)
    logits = logits_at(forward_tokens(drafter, state, ids), counts - 1)
    drafter.cache.advance(counts * state.active)
    args = state.sampling_args(stream)
    none = torch.zeros(state.batch, 0, dtype=torch.int64, device=ids.device)
    zero = torch.zeros(state.batch, dtype=torch.int64, device=ids.device)
    tokens, probs = [], []
    for j in range(k):
        if j > 0:
            logits = forward_tokens(drafter, state, tokens[-1][:, None], ahead=j)[:, 0]
            drafter.cache.advance(state.active.to(torch.int64))
        args["offset"] = state.offset + j
        tokens.append(verifier.chain(logits[:, None], none, zero, None, lenience=1.0, **args).next_token)
        if not state.all_greedy:
            probs.append(verifier.reviewer_probs(logits, state.temperature, state.top_k, state.top_p,
                                                filtered=state.any_filtered, max_top_k=state.max_top_k))
    state.metrics.count_drafter(metrics_index, k)
    return Draft(torch.stack(tokens, 1), torch.full_like(zero, k), torch.stack(probs, 1) if probs else None)


def mag_draft(mag: MaG, state: DecodeState, k: int) -> Draft:
    """What MaG proposes after each row's committed sequence (pending included), up to k tokens."""
    end = state.committed + 1
    proposal = mag.propose(state.tokens, end, end, k, search_bound=state.max_committed + 1)
    return Draft(proposal.tokens, proposal.length * state.active)


class SpeculativeDecoder:
    def __init__(self, models: Models, k: int, drafter_index: int):
        self.models = models
        self.drafter = models.drafters[drafter_index]
        self.drafter_index = drafter_index
        self.k = k
        self.max_tokens_per_forward = k + 2

    def plan(self, state: DecodeState) -> torch.Tensor | None:
        """[B, 1]: the length of each row's next MaG proposal (None with a model drafter)."""
        return mag_draft(self.drafter, state, self.k).length[:, None] if isinstance(self.drafter, MaG) else None

    def step(self, state: DecodeState, plan=None) -> StepOutput:
        if isinstance(self.drafter, MaG):
            width = max((row[0] for row in plan), default=0)  # the longest proposal of an active row
            draft = mag_draft(self.drafter, state, self.k)
            draft = Draft(draft.tokens[:, :width], draft.length.clamp(max=width))
        else:
            draft = draft_chain(self.drafter, state, self.k, self.models.verifier, DRAFT_STREAM, self.drafter_index)
        out, accepted = verify_chain(self.models, state, draft, counters=self.k + 1)
        roll_back_drafters([self.drafter], state.committed + accepted + 1)  # drafts past the accepted are stale
        commit(state, out)
        return out
