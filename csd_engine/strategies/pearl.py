"""PEARL (docs/algorithms.md, PEARL): the drafter and the target run at the same time.

Every round is one target forward and `gamma` drafter forwards running concurrently, then
one chain verification on the main thread. Each row is in one of two modes:

* pre-verify (nothing drafted ahead): the target reads [pending] while the drafter drafts
  e_1..e_γ from the same point; e_1 is then verified against the target's p_1. Rejected: the
  correction is emitted and the drafter rolls back, dropping e_2..e_γ. Accepted: e_1 is
  emitted, e_2..e_γ are carried and the row moves to post-verify.
* post-verify (γ-1 carried drafts d_1..d_{γ-1}): the target reads [pending, d_1..d_{γ-1}]
  while the drafter extends the carry by e_1..e_γ as if all of it were accepted. The chain
  d_1..d_{γ-1}, e_1 is verified, e_1 against the distribution at the bonus position, so no
  target output is wasted and no bonus token is drawn. All accepted: e_2..e_γ is the next
  carry. Otherwise the correction is emitted, both caches roll back by length, and the row
  returns to pre-verify.
As in the published code, pre-verify's target forward needs no draft token (p_1 depends on
the prefix only), so no drafter forward runs before the target starts. A draft grows by γ
every round while it is accepted and is cut after one token when its first token is
rejected: the draft length adapts by itself. With γ = 1 there is nothing to carry: every
round is a pre-verify round that emits one token.

Metrics: `draft_lengths` counts, per row, the rounds that offered the target 1 (pre-verify),
γ (post-verify) or γ-1 (adaptive=False) drafts; `wait_time_s` books, per round, how long the
side that finished its forwards first waited for the other (host wall clock; on CUDA that is
launch time, not kernel time).

Lossless as in section 1: every emitted token passes the standard chain rule, on the main
thread, with the same verifier call as Speculative; drafts are sampled from their own random
stream and `state.offset` moves past every counter a round uses, so no number is reused.
The parallel part is only the model forwards: decisions never depend on timing.

Modes are per row (a device mask), so ragged acceptance in a batch costs nothing: the
target reads γ tokens when any row is in post-verify (pre-verify rows pad), one otherwise;
which rows are in post-verify is the step's plan, read with the previous step's tokens.

Concurrency: the drafter side runs in a worker thread owned by the decoder (PyTorch releases
the GIL inside its ops), on CPU and GPU alike; on CUDA it also runs on a side stream, which
waits for the main stream before starting, and the main stream waits for it before the
verification.

One device: `Pearl()` decodes by chain speculative steps (Pearl.overlap); these rounds run
when the drafter has a device of its own or with `overlap=True`.

Two devices (the published setting, in one process): `Engine(..., drafter_device="cuda:1")`
builds the drafter there. Each round the worker copies the few inputs it needs (the token
buffer, pending / carried tokens, the sampling settings) to the drafter's device and the
drafts come back to the target's; with one device every such copy is a no-op. Measured on
one H100 (docs/measurements.md): the two sides, both bandwidth-bound on one memory, did not overlap.
"""
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, replace

import torch

from csd_engine.checks import is_int
from csd_engine.drafters.mag import MaG
from csd_engine.kernels.sampling import one_hot
from csd_engine.models.runner import on_device
from csd_engine.strategies.base import (DRAFT_STREAM, TARGET_STREAM, DecodeState, Decoder, Models, StepMetrics, StepOutput,
                                        check_drafter_index, commit, emitted_block, emitted_logprobs, forward_tokens)
from csd_engine.strategies.speculative import SpeculativeDecoder, draft_chain


@dataclass(frozen=True)
class Pearl:
    """gamma: drafter forwards per round (a draft grows by gamma per accepted round), from
    engine.drafters[drafter], which must be a neural model. adaptive=False turns post-verify
    off (the paper's ablation): after a successful pre-verify the remaining gamma-1 drafts are
    verified with a bonus token and the row returns to pre-verify, so drafts never exceed gamma.

    overlap: None (default) runs the two sides concurrently only when the drafter has a device
    of its own (Engine(drafter_device=...)). On one device both stream their weights through
    the same memory and did not overlap (measured on two CPU cores and on one H100, docs/measurements.md):
    run in turn, a PEARL round costs a chain speculative step and emits fewer tokens (no bonus
    token, one-token pre-verify rounds), so the rows decode by chain speculative decoding with
    k = gamma instead (Speculative's step: same greedy tokens, no PEARL metrics). True forces
    the concurrent rounds, False the chain steps."""

    gamma: int = 4
    drafter: int = 0
    adaptive: bool = True
    overlap: bool | None = None

    def __post_init__(self):
        if not is_int(self.gamma) or not 1 <= self.gamma <= 64:
            raise ValueError(f"Pearl.gamma must be an int in [1, 64], got {self.gamma!r}")
        check_drafter_index(self.drafter, "Pearl")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"Pearl.adaptive must be True or False, got {self.adaptive!r}")
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise ValueError(f"Pearl.overlap must be None (concurrent only with a drafter_device of its own), True "
                             f"or False, got {self.overlap!r}")

    def decoder(self, models: Models):
        if self.drafter >= len(models.drafters):
            raise ValueError(f"Pearl(drafter={self.drafter}) needs engine.drafters[{self.drafter}]; "
                             f"the engine has {len(models.drafters)} drafter(s)")
        if isinstance(models.drafters[self.drafter], MaG):
            raise ValueError(f"Pearl needs a neural drafter, but engine.drafters[{self.drafter}] is MaG (a suffix "
                             "match costs next to nothing: there is no drafter forward worth overlapping with the "
                             "target's): use Speculative or Cascade with MaG")
        two_devices = models.drafter_device != models.device
        if self.overlap is False and two_devices:
            raise ValueError(f"Pearl(overlap=False) runs the drafter and the target in turn on one device, but this "
                             f"engine puts the drafter on {models.drafter_device} (target: {models.device}): use "
                             "overlap=None or True there")
        if not (two_devices if self.overlap is None else self.overlap):
            return SpeculativeDecoder(models, self.gamma, self.drafter)
        return PearlDecoder(models, self.gamma, self.drafter, self.adaptive)


def submitted_chain(post: torch.Tensor, any_post: bool, carried: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The chain each row submits to the target: its carried drafts then the first new one
    (post-verify rows), or the new drafts from the first, of which only the first counts
    (pre-verify rows). Works on tokens ([B, γ-1] carried, [B, γ] new) and on their
    distributions ([B, γ-1, V], [B, γ, V]). One column when no row is in post-verify."""
    if not any_post:
        return new[:, :1]
    mask = post.view(-1, *[1] * (new.dim() - 1))
    return torch.where(mask, torch.cat([carried, new[:, :1]], 1), new)


def _wait_out(job) -> None:
    """Wait for the drafter's job to end, a second Ctrl-C included (raised once it has ended):
    its thread writes the drafter's cache, which the next scheduler would otherwise share with it."""
    interrupted = None
    while not job.done():
        try:
            wait([job])
        except BaseException as error:  # KeyboardInterrupt arrives in the main thread only
            interrupted = interrupted or error
    if interrupted is not None:
        raise interrupted


@dataclass
class Carried:
    """What a PEARL row carries into the next round (DecodeState.carried)."""

    post: torch.Tensor  # [B] bool: the row starts it in post-verify, with γ - 1 drafts carried
    tokens: torch.Tensor  # [B, γ - 1] those drafts
    q: torch.Tensor | None  # [B, γ - 1, V] their distributions (None while every row is greedy)


class PearlDecoder(Decoder):
    step_graphs = False  # its drafter runs in a worker thread: the step is not one stream's device work

    def __init__(self, models, gamma: int, drafter_index: int, adaptive: bool):
        self.target = models.target
        self.drafter = models.drafters[drafter_index]
        self.drafter_index = drafter_index
        self.drafters_used = (drafter_index,)
        self.verifier = models.verifier
        self.gamma = gamma
        self.adaptive = adaptive
        # The drafter writes up to 2γ - 1 slots past the committed prefix (carry + extension).
        self.max_tokens_per_forward = 2 * gamma
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pearl-drafter")
        self.target_device, self.drafter_device = models.device, models.drafter_device
        on_cuda = self.drafter_device.type == "cuda"
        self.side_stream = torch.cuda.Stream(self.drafter_device) if on_cuda else None

    def start(self, state: DecodeState) -> None:
        b, dev = state.batch, state.pending.device
        state.carried = Carried(torch.zeros(b, dtype=torch.bool, device=dev),
                                torch.zeros(b, self.gamma - 1, dtype=torch.int64, device=dev), None)
        state.metrics.draft_lengths = torch.zeros(b, self.gamma + 1, dtype=torch.int64, device=dev)
        state.metrics.wait_time_s = {"drafter": 0.0, "target": 0.0}

    def admit(self, state: DecodeState, rows: torch.Tensor) -> None:
        """New requests in `rows` ([B] bool) start without carried drafts."""
        state.carried.post &= ~rows

    def plan(self, state: DecodeState) -> torch.Tensor:
        """[B, 1]: 1 where the row starts the next round in post-verify (drafts carried)."""
        return state.carried.post[:, None].to(torch.int64)

    def step(self, state: DecodeState, plan) -> StepOutput:
        g, carried = self.gamma, state.carried
        post = carried.post & state.active
        any_post = any(row[0] for row in plan)
        job = self._submit_drafter(state, post, any_post)
        try:
            target_ids = torch.cat([state.pending[:, None], carried.tokens], 1) if any_post else state.pending[:, None]
            logits = forward_tokens(self.target, state, target_ids, flag_all=False)
            new, new_q = self._join(job, state.metrics, time.perf_counter())
        finally:  # the drafter writes its cache: nothing may go on running after a failed (or interrupted) step
            _wait_out(job)

        drafts = submitted_chain(post, any_post, carried.tokens, new)
        carry_q = carried.q
        if new_q is not None and carry_q is None and any_post:  # carried from a round when every row was greedy
            carry_q = one_hot(carried.tokens, new_q.shape[-1]).to(new_q.dtype)
        q = None if new_q is None else submitted_chain(post, any_post, carry_q, new_q)
        # The last draft sits at the bonus position: a placeholder row stands for the target
        # output after it, and the bonus drawn from it is never emitted.
        logits = torch.cat([logits, logits[:, -1:]], 1)
        with_bonus = post & (not self.adaptive)  # post-verify off: verify the carry alone, then a bonus
        num_drafts = torch.where(post, drafts.shape[1] - with_bonus.to(torch.int64), 1)
        res = self.verifier.chain(logits, drafts, num_drafts, q, lenience=1.0, **state.sampling_args(TARGET_STREAM))
        n = res.num_accepted
        # the chain up to e_1 holds: e_2..e_γ stay valid (an idle row keeps nothing: its drafter cache must not grow)
        whole = (n == num_drafts) & ~with_bonus & state.active
        counts = torch.where(whole, n, n + 1)
        self.target.flag_used_logits(logits, counts=counts)  # the emitted tokens' (the placeholder copies the last)

        self.target.cache.advance(counts * state.active)
        dd = self.drafter_device
        self.drafter.cache.rollback(torch.where(whole.to(dd), self.drafter.cache.lengths, (state.committed + counts).to(dd)))
        state.carried = Carried(whole & (g > 1), new[:, 1:], None if new_q is None else new_q[:, 1:])
        state.offset += g + 1  # drafts drew offset..offset+γ-1, the verifier offset..offset+γ
        m = state.metrics
        m.target_forwards += 1
        m.count_drafter(self.drafter_index, g)
        m.record(0, n, num_drafts, state.active, drafts.shape[1])
        m.draft_lengths.scatter_add_(1, num_drafts[:, None], state.active.to(torch.int64)[:, None])
        emitted = emitted_block(drafts, n, res.next_token)
        out = StepOutput(emitted, counts, emitted_logprobs(state, logits, emitted))
        commit(state, out)
        return out

    def _submit_drafter(self, state: DecodeState, post: torch.Tensor, any_post: bool):
        if self.side_stream is not None:
            # the drafter's inputs come from the target's main stream, and the main thread rolled
            # back (or prefilled) the drafter's cache on the drafter device's own
            if self.target_device.type == "cuda":
                self.side_stream.wait_stream(torch.cuda.current_stream(self.target_device))
            self.side_stream.wait_stream(torch.cuda.current_stream(self.drafter_device))
        return self.pool.submit(self._draft, state, post, any_post)

    def _draft(self, state: DecodeState, post: torch.Tensor, any_post: bool):
        """The drafter side of a round (worker thread): gamma tokens drafted after the end of its
        cache, i.e. after `pending` (pre-verify) or after the carried drafts (post-verify).
        Returns (tokens [B, γ], distributions [B, γ, V] or None, the host time it finished)."""
        side = contextlib.nullcontext() if self.side_stream is None else torch.cuda.stream(self.side_stream)
        with on_device(self.drafter_device), side:  # this thread's current device is not the main one's
            first = torch.where(post, state.carried.tokens[:, -1], state.pending) if any_post else state.pending
            # Seen from draft_chain, the drafter's cache is the committed prefix and `first` the
            # pending token; a row may be gamma-1 ahead of `committed` (also a finished row).
            # Every tensor moves to the drafter's device (a no-op when it is the target's).
            dd = self.drafter_device
            drafter_view = replace(state, tokens=state.tokens.to(dd), pending=first.to(dd),
                                   committed=self.drafter.cache.lengths.clone(), active=state.active.to(dd),
                                   temperature=state.temperature.to(dd), top_k=state.top_k.to(dd),
                                   top_p=state.top_p.to(dd), seed=state.seed.to(dd), offset=state.offset.to(dd),
                                   max_committed=state.max_committed + self.gamma - 1)
            draft = draft_chain(self.drafter, drafter_view, self.gamma, self.verifier, DRAFT_STREAM, None)
        return draft.tokens, draft.q, time.perf_counter()

    def _join(self, job, metrics: StepMetrics, target_done: float):
        """Wait for the drafter; book which side waited for the other (host wall clock)."""
        tokens, probs, drafter_done = job.result()
        metrics.wait_time_s["target"] += max(0.0, drafter_done - target_done)
        metrics.wait_time_s["drafter"] += max(0.0, target_done - drafter_done)
        if self.side_stream is not None:
            main = torch.cuda.current_stream(self.drafter_device)
            main.wait_stream(self.side_stream)
            for t in (tokens, probs):  # made on the side stream, used on the main one from now on
                if t is not None:
                    t.record_stream(main)
        tokens = tokens.to(self.target_device)  # no-ops on one device
        return tokens, None if probs is None else probs.to(self.target_device)
