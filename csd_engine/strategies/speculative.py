"""Chain speculative decoding: one drafter (a model or MaG) drafts k tokens, the target
verifies them in one forward, every cache rolls back by length (ALGORITHMS.md section 1)."""
from dataclasses import dataclass

import torch

from csd_engine.drafters.mag import MaG
from csd_engine.strategies.base import (DecodeState, StepOutput, catch_up_tokens, emitted_block, forward_tokens,
                                        logits_at, require_one_device)

TARGET_STREAM, DRAFT_STREAM = 0, 1


@dataclass(frozen=True)
class Speculative:
    """k draft tokens per target forward from engine.drafters[drafter]."""

    k: int = 4
    drafter: int = 0

    def __post_init__(self):
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= 64:
            raise ValueError(f"Speculative.k must be an int in [1, 64], got {self.k!r}")

    def decoder(self, engine):
        if not 0 <= self.drafter < len(engine.drafters):
            raise ValueError(f"Speculative(drafter={self.drafter}) needs engine.drafters[{self.drafter}]; "
                             f"the engine has {len(engine.drafters)} drafter(s)")
        require_one_device(engine, "Speculative")
        return SpeculativeDecoder(engine, self.k, self.drafter)


def draft_chain(drafter, state: DecodeState, k: int, verifier, stream: int, metrics_index: int):
    """k tokens drafted autoregressively by a neural drafter (sampled at the request's own
    temperature / top-k / top-p). Returns (tokens [B, k], q [B, k, V] or None when greedy).
    The drafter ends with pending, x_1..x_{k-1} written after the committed prefix."""
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
                                                filtered=state.any_filtered))
    state.metrics.count_drafter(metrics_index, k)
    return torch.stack(tokens, 1), (torch.stack(probs, 1) if probs else None)


class SpeculativeDecoder:
    def __init__(self, engine, k: int, drafter_index: int):
        self.target = engine.target
        self.drafter = engine.drafters[drafter_index]
        self.drafter_index = drafter_index
        self.verifier = engine.verifier
        self.k = k
        self.max_tokens_per_forward = k + 2

    def start(self, state: DecodeState, prompt_ids) -> None:
        if isinstance(self.drafter, MaG):
            self.drafter.start(prompt_ids)

    def observe(self, emitted: list[list[int]]) -> None:
        if isinstance(self.drafter, MaG):
            self.drafter.commit(emitted)

    def step(self, state: DecodeState) -> StepOutput:
        k, dev = self.k, state.pending.device
        if isinstance(self.drafter, MaG):
            drafts, q = self.drafter.propose([[]] * state.batch, k).to(dev), None
        else:
            drafts, q = draft_chain(self.drafter, state, k, self.verifier, DRAFT_STREAM, self.drafter_index)
        logits = forward_tokens(self.target, state, torch.cat([state.pending[:, None], drafts], 1))
        num_drafts = torch.full((state.batch,), k, dtype=torch.int64, device=dev)
        res = self.verifier.chain(logits, drafts, num_drafts, q, lenience=1.0, **state.sampling_args(TARGET_STREAM))
        n = res.num_accepted.to(torch.int64)
        self.target.cache.advance((n + 1) * state.active)
        if not isinstance(self.drafter, MaG):  # its entries past the accepted prefix are stale
            self.drafter.cache.rollback(state.committed + n + 1)
        state.offset += k + 1
        state.metrics.target_forwards += 1
        state.metrics.record(0, n, num_drafts, state.active, drafts.shape[1])
        return StepOutput(emitted_block(drafts, n, res.next_token), n + 1)
