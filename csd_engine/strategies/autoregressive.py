"""Plain decoding: one target forward per token. The baseline every strategy must equal."""
from dataclasses import dataclass

import torch

from csd_engine.strategies.base import DecodeState, StepOutput, forward_tokens


@dataclass(frozen=True)
class Autoregressive:
    """Greedy or sampled decoding with the target alone."""

    def decoder(self, engine):
        return AutoregressiveDecoder(engine)


class AutoregressiveDecoder:
    max_tokens_per_forward = 1

    def __init__(self, engine):
        self.target = engine.target
        self.verifier = engine.verifier

    def step(self, state: DecodeState) -> StepOutput:
        logits = forward_tokens(self.target, state, state.pending[:, None])  # [B, 1, V]
        b = state.batch
        none = torch.zeros(b, 0, dtype=torch.int64, device=logits.device)
        out = self.verifier.chain(logits, none, torch.zeros(b, dtype=torch.int64, device=logits.device),
                                  None, lenience=1.0, **state.sampling_args())
        one = torch.ones(b, dtype=torch.int64, device=logits.device)
        self.target.cache.advance(one * state.active)
        state.offset += 1
        state.metrics.target_forwards += 1
        return StepOutput(tokens=out.next_token[:, None], counts=one)
