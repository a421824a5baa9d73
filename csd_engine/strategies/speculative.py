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

from csd_engine.checks import is_int
from csd_engine.drafters.mag import MaG
from csd_engine.strategies.base import (DRAFT_STREAM, DecodeState, Decoder, Draft, Models, StepOutput, catch_up_tokens,
                                        check_drafter_index, commit, forward_tokens, logits_at, require_one_device,
                                        roll_back_drafters, verify_chain)


@dataclass(frozen=True)
class Speculative:
    """Up to k draft tokens per target forward from drafters[drafter] (a model drafts k, or stops
    a row before the first token where its top probability, softmax of its logits, is under
    `min_confidence`)."""

    k: int = 4
    drafter: int = 0
    min_confidence: float = 0.0

    def __post_init__(self):
        if not is_int(self.k) or not 1 <= self.k <= 64:
            raise ValueError(f"Speculative.k must be an int in [1, 64], got {self.k!r}")
        check_drafter_index(self.drafter, "Speculative")
        check_confidence(self.min_confidence, "Speculative")

    @staticmethod
    def auto(**kwargs):
        """Chain speculation whose rows choose their own draft length each step from counted
        acceptance and a fixed cost table (csd_engine.strategies.speculative_auto)."""
        from csd_engine.strategies.speculative_auto import AutoSpeculative
        return AutoSpeculative(**kwargs)

    def decoder(self, models: Models):
        check_drafter(models, self.drafter, "Speculative")
        if self.min_confidence and isinstance(models.drafters[self.drafter], MaG):
            raise ValueError("Speculative(min_confidence=...) stops a neural drafter's draft; MaG's drafts are "
                             "already only what it matched (leave min_confidence at 0)")
        return SpeculativeDecoder(models, self.k, self.drafter, self.min_confidence)


def check_confidence(value, strategy: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{strategy}(min_confidence=...) must be a number in [0, 1) (0: never stop early), "
                         f"got {value!r}")


def check_drafter(models: Models, drafter: int, strategy: str) -> None:
    if not 0 <= drafter < len(models.drafters):
        raise ValueError(f"{strategy}(drafter={drafter}) needs engine.drafters[{drafter}]; "
                         f"the engine has {len(models.drafters)} drafter(s)")
    require_one_device(models, strategy)


def draft_chain(drafter, state: DecodeState, k: int, verifier, stream: int, metrics_index: int | None,
                max_behind: int = 1, budget: torch.Tensor | None = None, min_confidence: float = 0.0,
                stop_early: bool = False) -> Draft:
    """Up to k tokens drafted autoregressively by a neural drafter (sampled at the request's own
    temperature / top-k / top-p; q is None when every row is greedy). A row drafts at most
    `budget[b]` tokens (k when None) and stops before a token where the drafter's top
    probability (softmax of its logits, before temperature) is under `min_confidence`: both
    depend on the row's prefix and earlier drafts only, never on the token itself, so
    verification stays exact (docs/algorithms.md, chain verification). `max_behind` bounds
    how far the drafter's cache trails the committed prefix. With `stop_early` (a named host
    read per token, for the CPU: Models.trim_drafts) the loop ends once no row drafts on.
    The drafter ends with pending and the drafts but the last written after the prefix."""
    ids, counts = catch_up_tokens(state, drafter, max_behind=max_behind)
    # a finished row may trail further than max_behind (it only bounds active rows): clamped
    logits = logits_at(forward_tokens(drafter, state, ids), (counts - 1).clamp(max=ids.shape[1] - 1))
    drafter.cache.advance(counts * state.active)
    args = state.sampling_args(stream)
    none = torch.zeros(state.batch, 0, dtype=torch.int64, device=ids.device)
    zero = torch.zeros(state.batch, dtype=torch.int64, device=ids.device)
    going = state.active if budget is None else state.active & (budget > 0)
    stop_early = stop_early and (budget is not None or min_confidence > 0)  # else every row drafts k
    length = zero.clone()
    tokens, probs, forwards = [], [], 1
    for j in range(k):
        if j > 0:
            logits = forward_tokens(drafter, state, tokens[-1][:, None], ahead=j)[:, 0]
            drafter.cache.advance(state.active.to(torch.int64))
            forwards += 1
        if budget is not None:
            going = going & (j < budget)
        if min_confidence:
            going = going & (torch.softmax(logits.float(), -1).amax(-1) >= min_confidence)
        if stop_early and not bool(going.any()):
            break
        length += going
        args["offset"] = state.offset + j
        drawn = verifier.chain(logits[:, None], none, zero, None, lenience=1.0, **args)
        tokens.append(drawn.next_token)
        if not state.all_greedy:  # q: the distribution the draw came from, from the check's own cut-off
            probs.append(verifier.sampled_distribution(logits, state.temperature, drawn))
    if metrics_index is not None:  # None: the caller counts the forwards itself
        state.metrics.count_drafter(metrics_index, forwards)
    if not tokens:
        return Draft(none, zero)
    return Draft(torch.stack(tokens, 1), length, torch.stack(probs, 1) if probs else None)


def mag_draft(mag: MaG, state: DecodeState, k: int) -> Draft:
    """What MaG proposes after each row's committed sequence (pending included), up to k tokens."""
    end = state.committed + 1
    proposal = mag.propose(state.tokens, end, end, k, search_bound=state.max_committed + 1)
    return Draft(proposal.tokens, proposal.length * state.active)


class SpeculativeDecoder(Decoder):
    def __init__(self, models: Models, k: int, drafter_index: int, min_confidence: float = 0.0):
        self.models = models
        self.drafter = models.drafters[drafter_index]
        self.drafter_index = drafter_index
        self.drafters_used = (drafter_index,)
        self.k = k
        self.min_confidence = min_confidence
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
            draft = draft_chain(self.drafter, state, self.k, self.models.verifier, DRAFT_STREAM, self.drafter_index,
                                min_confidence=self.min_confidence, stop_early=self.models.trim_drafts)
        out, accepted = verify_chain(self.models, state, draft, counters=self.k + 1)
        roll_back_drafters([self.drafter], state.committed + accepted + 1)  # drafts past the accepted are stale
        commit(state, out)
        return out
