"""The public engine: load models once, then `generate` with any strategy.

    engine = Engine(target="smollm2-135m", drafters=["mag"], max_batch_size=4, max_seq_len=1024)
    results = engine.generate(["Hello"], SamplingParams(max_new_tokens=32), strategy=Autoregressive())

Each `generate` call: validate, prefill every model's static cache, then repeat the
strategy's `step` until every row is done. A step returns the tokens it emitted per row on
the device; the host reads them once per step (to stream tokens, apply stop tokens and
`max_new_tokens`).

Host synchronisation on CUDA, where and why (everything else stays on the device: accept
counts, cache lengths, next positions, per-row metrics):
* the engine's read of the emitted tokens, once per step; `active` goes back to the device
  only in a step where a row finished;
* Autoregressive, Speculative with a model drafter, Staged without MaG, greedy or sampling
  (with top-k / top-p the drafter's distribution needs its cut-off search, which reads the
  device once per drafter call): nothing else. Host-known bounds (k, tree depth,
  `state.max_committed`) size every tensor;
* MaG (Speculative, Staged's second stage, Cascade) proposes on the host from the tokens
  the engine already read, except that inside a step Staged and Cascade read the draft they
  are extending (one small read per MaG call);
* Pearl reads whether any row is in post-verify at the start of a step, when the device is
  idle anyway (the engine's read just drained it);
* Cascade's intermediate levels are data-dependent: each review reads which rows still need
  tokens and, in one read, how wide its draft and its forward are; each MaG call reads the
  draft it extends, in one read; the step reads the final draft width. Attention bounds are
  host-known. On an H100 this host work was most of the 9.2 ms "other" per cascade step
  (README, GPU measurements; measured before two of the reads per review were removed).
Kernel input checks read tensor values on the CPU only (verify, tree_verify).
"""
import time
from dataclasses import dataclass, field

import torch

from csd_engine.drafters.mag import MaG
from csd_engine.models.graphs import maybe_graphed
from csd_engine.models.loader import load_runner
from csd_engine.models.runner import ForwardBatch
from csd_engine.params import SamplingParams
from csd_engine.strategies.base import DecodeState, StepMetrics
from csd_engine.verifier import Verifier, choose_backend

# Room past max_seq_len for the blocks a strategy feeds (draft + bonus, or tree nodes): writes
# beyond a row's committed length must stay inside the buffer.
HEADROOM = 256


@dataclass
class Metrics:
    new_tokens: int
    target_forwards: int
    drafter_forwards: list[int]
    wall_time_s: float
    tokens_per_s: float
    mean_accepted_tokens: float  # tokens emitted per target forward, bonus included (AR = 1.0)
    accepted: int = 0  # draft tokens the target accepted
    drafted: int = 0  # draft tokens offered to the target
    acceptance_by_position: list[float] = field(default_factory=list)
    acceptance_by_level: dict[int, float] = field(default_factory=dict)  # level 0 = reviews by the target
    swi: float = 1.0  # standardized walltime improvement (model-size cost model)
    draft_lengths: dict[int, int] = field(default_factory=dict)  # draft length offered to the target -> rounds
    wait_time_s: dict[str, float] = field(default_factory=dict)  # "drafter" / "target": waiting on the other


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" (a stop token), "length" (max_new_tokens or max_seq_len)
    metrics: Metrics


class Engine:
    def __init__(self, target, drafters=(), device=None, dtype=torch.float32, max_batch_size: int = 8,
                 max_seq_len: int = 2048, verify_backend: str | None = None, native: bool | None = None,
                 tokenizer=None, attention_backend: str = "sdpa", cuda_graphs: bool = False,
                 fused_kernels: bool = False, drafter_device=None):
        if isinstance(drafters, (str, torch.nn.Module)):
            drafters = [drafters]
        if max_batch_size < 1 or max_seq_len < 2:
            raise ValueError(f"max_batch_size must be >= 1 and max_seq_len >= 2, got {max_batch_size}, {max_seq_len}")
        if not isinstance(fused_kernels, bool):
            raise TypeError(f"fused_kernels must be True or False, got {fused_kernels!r}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # Neural drafters may live on a device of their own (PEARL's two-device layout); the
        # other strategies refuse such an engine (strategies.base.require_one_device).
        self.drafter_device = self.device if drafter_device is None else torch.device(drafter_device)
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.verifier = Verifier(choose_backend(verify_backend, self.device))
        self.fused_kernels = fused_kernels
        self.target, own_tokenizer = load_runner(target, self.device, dtype, native, attention_backend, fused_kernels)
        self.target = maybe_graphed(self.target, cuda_graphs)  # CUDA graphs: native runner on a GPU only
        self.tokenizer = tokenizer or own_tokenizer
        self.drafters = [maybe_graphed(self._load_drafter(d, native, attention_backend), cuda_graphs)
                         for d in drafters]
        for i, d in enumerate(self.drafters):
            if not isinstance(d, MaG) and d.device != self.drafter_device:
                raise ValueError(f"drafter {i} is a runner on {d.device}, but the engine puts drafters on "
                                 f"{self.drafter_device} (drafter_device): build it there or pass a model")
        self.capacity = max_seq_len + HEADROOM
        for runner in self.models():
            runner.allocate(max_batch_size, self.capacity)

    def _load_drafter(self, spec, native, attention_backend):
        if isinstance(spec, MaG) or (isinstance(spec, str) and spec.lower() == "mag"):
            return spec if isinstance(spec, MaG) else MaG()
        runner, _ = load_runner(spec, self.drafter_device, self.dtype, native, attention_backend, self.fused_kernels)
        if runner.vocab_size != self.target.vocab_size:
            raise ValueError(f"drafter vocabulary ({runner.vocab_size} tokens) differs from the target's "
                             f"({self.target.vocab_size}): drafter and target must share a tokenizer")
        return runner

    def models(self):
        """The neural runners (target first); MaG has no cache."""
        return [self.target] + [d for d in self.drafters if not isinstance(d, MaG)]

    # ----------------------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 strategy=None) -> list[GenerationResult]:
        from csd_engine.strategies import Autoregressive
        strategy = Autoregressive() if strategy is None else strategy
        if not hasattr(strategy, "decoder"):
            raise TypeError(f"unknown strategy {strategy!r}: pass one of csd_engine.Autoregressive, "
                            "Speculative, Cascade, Staged, Pearl")
        prompt_ids = self._encode(prompts)
        params = self._params(params, len(prompt_ids))
        decoder = strategy.decoder(self)  # validates the strategy against the engine's drafters
        if 2 * decoder.max_tokens_per_forward > HEADROOM:
            # A row can commit up to one forward past its limit in its last step, and finished
            # rows are still fed (masked) until the batch ends: two forwards must fit.
            raise ValueError(f"the strategy feeds up to {decoder.max_tokens_per_forward} tokens per forward; "
                             f"at most {HEADROOM // 2} fit the cache headroom")
        state = self._start(prompt_ids, params)
        if hasattr(decoder, "start"):
            decoder.start(state, prompt_ids)
        return self._decode(decoder, state, prompt_ids, params)

    def _encode(self, prompts) -> list[list[int]]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
        if len(prompts) > self.max_batch_size:
            raise ValueError(f"{len(prompts)} prompts exceed max_batch_size={self.max_batch_size}")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer; this model has none: pass token-id lists")
                p = self.tokenizer(p, add_special_tokens=True)["input_ids"]
            p = [int(t) for t in p]
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if len(p) >= self.max_seq_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens; max_seq_len={self.max_seq_len} leaves no room "
                                 f"to generate (prompt must be shorter than max_seq_len)")
            if min(p) < 0 or max(p) >= self.target.vocab_size:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.target.vocab_size})")
            out.append(p)
        return out

    def _params(self, params, n) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"params must be one SamplingParams or a list of {n} (one per prompt)")
        return params

    def _start(self, prompt_ids, params) -> DecodeState:
        b, dev = len(prompt_ids), self.device
        lens = [len(p) for p in prompt_ids]
        tokens = torch.zeros(b, self.capacity, dtype=torch.int64, device=dev)
        for i, p in enumerate(prompt_ids):
            tokens[i, :len(p)] = torch.tensor(p)
        committed = torch.tensor(lens, device=dev) - 1  # the last prompt token is `pending`
        state = DecodeState(
            tokens=tokens, committed=committed,
            pending=tokens[torch.arange(b, device=dev), committed].clone(),
            active=torch.ones(b, dtype=torch.bool, device=dev),
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int32, device=dev),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
            seed=torch.tensor([p._resolved_seed for p in params], dtype=torch.int64, device=dev),
            offset=torch.zeros(b, dtype=torch.int64, device=dev),
            max_committed=max(lens) - 1, all_greedy=all(p.greedy for p in params),
            any_filtered=any(not p.greedy and (p.top_k > 0 or p.top_p < 1) for p in params))
        width = max(lens) - 1
        for runner in self.models():
            runner.use_rows(b) if hasattr(runner, "use_rows") else runner.allocate(b, self.capacity)
            runner.nonfinite_rows = torch.zeros(b, dtype=torch.bool, device=runner.device)
            runner.cache.reset()
            if width > 0:  # prefill: every prompt but its last token, right-padded
                prefix = tokens[:, :width].to(runner.device)
                runner(ForwardBatch.chain(prefix, runner.cache.lengths, width, need_logits=False))
            runner.cache.reset(committed)
        return state

    def _decode(self, decoder, state: DecodeState, prompt_ids, params) -> list[GenerationResult]:
        b = state.batch
        outputs = [[] for _ in range(b)]
        finish = [None] * b
        stops = [set(p.stop_token_ids) if p.stop_token_ids is not None else self._eos(p) for p in params]
        limits = [min(p.max_new_tokens, self.max_seq_len - len(ids)) for p, ids in zip(params, prompt_ids)]
        forwards = [[0] * (1 + len(self.drafters)) for _ in range(b)]  # per row: target, then each drafter
        committed = [len(ids) - 1 for ids in prompt_ids]
        start = time.perf_counter()
        while any(f is None for f in finish):
            before = [state.metrics.target_forwards] + state.metrics.drafter_counts(len(self.drafters))
            out = decoder.step(state)
            after = [state.metrics.target_forwards] + state.metrics.drafter_counts(len(self.drafters))
            for row in range(b):
                if finish[row] is None:
                    forwards[row] = [f + a - c for f, a, c in zip(forwards[row], after, before)]
            self._commit(state, out)
            models = self.models()
            nonfinite = torch.stack([m.nonfinite_rows.to(self.device) for m in models], 1)  # [B, models]
            host = torch.cat([out.counts[:, None], out.tokens, nonfinite.long()], dim=1).tolist()  # the one read
            self._check_finite([h[-len(models):] for h in host])
            if hasattr(decoder, "observe"):  # host-side drafters (MaG) learn the emitted tokens
                decoder.observe([h[1:1 + h[0]] for h in host])
            finished_before = sum(f is not None for f in finish)
            for row in range(b):
                if finish[row] is not None:
                    continue
                committed[row] += host[row][0]  # mirrors state.committed without reading it
                for tok in host[row][1:1 + host[row][0]]:
                    outputs[row].append(tok)
                    if tok in stops[row]:
                        finish[row] = "stop"
                    elif len(outputs[row]) >= limits[row]:
                        finish[row] = "length"
                    if finish[row]:
                        break
            state.max_committed = max(committed)
            if sum(f is not None for f in finish) != finished_before:  # a host-to-device copy only when a row ends
                state.active = torch.tensor([f is None for f in finish], device=self.device)
        wall = time.perf_counter() - start
        return [GenerationResult(outputs[r], self._decode_text(outputs[r]), finish[r],
                                 self._metrics(state.metrics, r, len(outputs[r]), forwards[r], wall))
                for r in range(b)]

    def _check_finite(self, flags: list[list[int]]) -> None:
        """Raise, naming the model and the prompts, if any model produced NaN / inf logits (the
        next generate starts from fresh caches, so the engine stays usable)."""
        bad = [(row, m) for row, row_flags in enumerate(flags) for m, flag in enumerate(row_flags) if flag]
        if not bad:
            return
        names = ["the target"] + [f"drafter {i}" for i, d in enumerate(self.drafters) if not isinstance(d, MaG)]
        which = sorted({names[m] for _, m in bad})
        rows = sorted({row for row, _ in bad})
        raise ValueError(f"non-finite logits (NaN or inf) from {', '.join(which)} for prompt(s) {rows}: the model's "
                         f"weights or activations overflow or are corrupt in {self.dtype}; use float32 or bfloat16 "
                         "(float16 overflows easily) or check the model's weights")

    @staticmethod
    def _commit(state: DecodeState, out) -> None:
        """Append [pending, emitted[:-1]] to the committed sequence; the last emitted is pending."""
        counts = out.counts * state.active
        block = torch.cat([state.pending[:, None], out.tokens], dim=1)
        cols = state.committed[:, None] + torch.arange(block.shape[1], device=block.device)[None, :]
        keep = torch.arange(block.shape[1], device=block.device)[None, :] < counts[:, None]
        cols = torch.where(keep, cols, state.tokens.shape[1] - 1).clamp(max=state.tokens.shape[1] - 1)
        state.tokens.scatter_(1, cols, torch.where(keep, block, state.tokens.gather(1, cols)))
        last = out.tokens.gather(1, (out.counts - 1).clamp(min=0)[:, None])[:, 0]
        state.pending = torch.where(state.active, last, state.pending)
        state.committed = state.committed + counts

    def _eos(self, p: SamplingParams) -> set:
        if p.ignore_eos or self.tokenizer is None or self.tokenizer.eos_token_id is None:
            return set()
        eos = self.tokenizer.eos_token_id
        return set(eos) if isinstance(eos, (list, tuple)) else {eos}

    def _decode_text(self, ids):
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def _metrics(self, m: StepMetrics, row: int, n_new: int, forwards: list[int], wall: float) -> Metrics:
        def at(x):
            return int(x[row]) if isinstance(x, torch.Tensor) else int(x)

        accepted = at(m.level_accepted.get(0, 0))
        drafted = at(m.level_drafted.get(0, 0))
        by_pos = []
        if m.accepted_by_position is not None:
            a, d = m.accepted_by_position[row].tolist(), m.drafted_by_position[row].tolist()
            by_pos = [x / y for x, y in zip(a, d) if y > 0]
        by_level = {lvl: at(m.level_accepted[lvl]) / max(at(m.level_drafted[lvl]), 1) for lvl in m.level_accepted}
        draft_lengths = {} if m.draft_lengths is None else {
            length: rounds for length, rounds in enumerate(m.draft_lengths[row].tolist()) if rounds}
        sizes = [self.target.num_params] + [0 if isinstance(d, MaG) else d.num_params for d in self.drafters]
        cost = sum(f * s for f, s in zip(forwards, sizes))
        ar_cost = n_new * self.target.num_params
        return Metrics(new_tokens=n_new, target_forwards=forwards[0], drafter_forwards=forwards[1:],
                       wall_time_s=wall, tokens_per_s=n_new / wall if wall > 0 else 0.0,
                       mean_accepted_tokens=n_new / max(forwards[0], 1), accepted=accepted, drafted=drafted,
                       acceptance_by_position=by_pos, acceptance_by_level=by_level,
                       swi=ar_cost / cost if cost else 1.0, draft_lengths=draft_lengths,
                       wait_time_s=dict(m.wait_time_s))
