"""Plain decoding: one target forward per token. The baseline every strategy must equal."""
from dataclasses import dataclass

from csd_engine.strategies.base import DecodeState, Decoder, Draft, Models, StepOutput, commit, verify_chain


@dataclass(frozen=True)
class Autoregressive:
    """Greedy or sampled decoding with the target alone."""

    def decoder(self, models: Models):
        return AutoregressiveDecoder(models)


class AutoregressiveDecoder(Decoder):
    max_tokens_per_forward = 1
    drafters_used = ()  # an engine's drafters sit idle: their prefills would be wasted (a long prompt's seconds)

    def __init__(self, models: Models):
        self.models = models

    def step(self, state: DecodeState, plan=None) -> StepOutput:
        out, _ = verify_chain(self.models, state, Draft.empty(state), counters=1)
        commit(state, out)
        return out
