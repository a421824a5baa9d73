"""The public engine: load models once, then `generate` with any strategy.

    engine = Engine(target="smollm2-135m", drafters=["mag"], max_batch_size=4, max_seq_len=1024)
    results = engine.generate(["Hello"], SamplingParams(max_new_tokens=32), strategy=Autoregressive())

Each `generate` call: validate, prefill every model's static cache, then repeat the
strategy's `step` until every row is done. A step returns the tokens it emitted per row on
the device; the host reads them once per step (to stream tokens, apply stop tokens and
`max_new_tokens`).

Host reads: one per step. The engine reads the step's emitted tokens, counts, non-finite
flags and the decoder's `plan` for the next step (what each row asks of it: e.g. how many
tokens its MaG match proposes, whether a PEARL row has drafts carried) in one copy
(`read_host`); a decoder turns the active rows' plans into the host-known shapes of its next
step. Nothing inside a step reads the device, so a step is a fixed sequence of device work
(tests/strategies/test_host_reads.py counts). `active` goes back to the device only in a
step where a row finished. Exceptions, by design: the generic (transformers) runner crops
each row's cache on the host; Pearl's worker thread joins on the host; kernel input checks
read values only when asked (tests).
"""
import os
import time
from dataclasses import dataclass, field

import torch

from csd_engine.drafters.mag import MaG
from csd_engine.models.graphs import maybe_graphed
from csd_engine.models.loader import load_runner
from csd_engine.models.runner import ForwardBatch
from csd_engine.params import SamplingParams
from csd_engine.strategies.base import DecodeState, Models, StepMetrics
from csd_engine.verifier import Verifier, choose_backend

def _max_top_k(params: list[SamplingParams]) -> int | None:
    """The largest top_k when every filtered row has one (a top-k sort that wide then holds every
    cut-off), else None."""
    filtered = [p for p in params if not p.greedy and (p.top_k > 0 or p.top_p < 1)]
    return max(p.top_k for p in filtered) if filtered and all(p.top_k > 0 for p in filtered) else None


def read_host(tensor: torch.Tensor) -> list:
    """The engine's one device-to-host read per step (tests count the calls)."""
    return tensor.tolist()


# Room past max_seq_len for the blocks a strategy feeds (draft + bonus, or tree nodes): writes
# beyond a row's committed length must stay inside the buffer.
HEADROOM = 256


@dataclass
class Metrics:
    new_tokens: int
    target_forwards: int
    drafter_forwards: list[int]
    wall_time_s: float  # this request's own: from the start of its generate call (prefill included) to its last token
    tokens_per_s: float
    mean_accepted_tokens: float  # tokens emitted per target forward, bonus included (AR = 1.0)
    accepted: int = 0  # draft tokens the target accepted
    drafted: int = 0  # draft tokens offered to the target
    acceptance_by_position: list[float] = field(default_factory=list)
    acceptance_by_level: dict[int, float] = field(default_factory=dict)  # level 0 = reviews by the target
    swi: float = 1.0  # standardized walltime improvement (model-size cost model)
    draft_lengths: dict[int, int] = field(default_factory=dict)  # draft length offered to the target -> rounds
    wait_time_s: dict[str, float] = field(default_factory=dict)  # "drafter" / "target": waiting on the other
    time_to_first_token_s: float = 0.0  # from the start of its generate call (prefill included) to its first token


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
            return (spec if isinstance(spec, MaG) else MaG()).to(self.device)
        runner, _ = load_runner(spec, self.drafter_device, self.dtype, native, attention_backend, self.fused_kernels)
        if runner.vocab_size != self.target.vocab_size:
            raise ValueError(f"drafter vocabulary ({runner.vocab_size} tokens) differs from the target's "
                             f"({self.target.vocab_size}): drafter and target must share a tokenizer")
        return runner

    def models(self):
        """The neural runners (target first); MaG has no cache."""
        return [self.target] + [d for d in self.drafters if not isinstance(d, MaG)]

    def _decoder_models(self) -> Models:
        return Models(self.target, self.drafters, self.verifier, self.capacity, self.device, self.drafter_device)

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
        decoder = strategy.decoder(self._decoder_models())  # validates the strategy against the drafters
        if 2 * decoder.max_tokens_per_forward > HEADROOM:
            # A row can commit up to one forward past its limit in its last step, and finished
            # rows are still fed (masked) until the batch ends: two forwards must fit.
            raise ValueError(f"the strategy feeds up to {decoder.max_tokens_per_forward} tokens per forward; "
                             f"at most {HEADROOM // 2} fit the cache headroom")
        started = time.perf_counter()
        state = self._start(prompt_ids, params)
        if hasattr(decoder, "start"):
            decoder.start(state, prompt_ids)
        return self._decode(decoder, state, prompt_ids, params, started)

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
            seed=torch.tensor([p.seed if p.seed is not None else int.from_bytes(os.urandom(4), "little")
                               for p in params], dtype=torch.int64, device=dev),  # seed=None: fresh per request
            offset=torch.zeros(b, dtype=torch.int64, device=dev),
            max_committed=max(lens) - 1, all_greedy=all(p.greedy for p in params),
            any_filtered=any(not p.greedy and (p.top_k > 0 or p.top_p < 1) for p in params),
            max_top_k=_max_top_k(params))
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

    def _decode(self, decoder, state: DecodeState, prompt_ids, params, start: float) -> list[GenerationResult]:
        b = state.batch
        outputs = [[] for _ in range(b)]
        finish = [None] * b
        stops = [set(p.stop_token_ids or ()) | self._eos(p) for p in params]
        limits = [min(p.max_new_tokens, self.max_seq_len - len(ids)) for p, ids in zip(params, prompt_ids)]
        forwards = [[0] * (1 + len(self.drafters)) for _ in range(b)]  # per row: target, then each drafter
        committed = [len(ids) - 1 for ids in prompt_ids]
        first_token_s, done_s = [0.0] * b, [0.0] * b  # seconds since `start` (before the prefill)
        plan = self._plan(decoder, state, [True] * b)
        while any(f is None for f in finish):
            before = [state.metrics.target_forwards] + state.metrics.drafter_counts(len(self.drafters))
            out = decoder.step(state, plan)
            after = [state.metrics.target_forwards] + state.metrics.drafter_counts(len(self.drafters))
            for row in range(b):
                if finish[row] is None:
                    forwards[row] = [f + a - c for f, a, c in zip(forwards[row], after, before)]
            models = self.models()
            nonfinite = torch.stack([m.nonfinite_rows.to(self.device) for m in models], 1)  # [B, models]
            parts = [out.counts[:, None], out.tokens, nonfinite.long()]
            next_plan = decoder.plan(state) if hasattr(decoder, "plan") else None
            host = read_host(torch.cat(parts + ([] if next_plan is None else [next_plan]), dim=1))  # the one read
            width = 1 + out.tokens.shape[1] + len(models)
            self._check_finite([h[width - len(models):width] for h in host])
            finished_before = sum(f is not None for f in finish)
            now = time.perf_counter() - start
            for row in range(b):
                if finish[row] is not None:
                    continue
                first_token_s[row] = first_token_s[row] or now
                done_s[row] = now
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
                state.active.copy_(torch.tensor([f is None for f in finish], device=self.device))
            plan = None if next_plan is None else [h[width:] for h, f in zip(host, finish) if f is None]
        return [GenerationResult(outputs[r], self._decode_text(outputs[r]), finish[r],
                                 self._metrics(state.metrics, r, len(outputs[r]), forwards[r], done_s[r],
                                               first_token_s[r]))
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

    def _plan(self, decoder, state: DecodeState, active: list[bool]):
        """The decoder's plan for its first step (read once, before the steps)."""
        rows = decoder.plan(state) if hasattr(decoder, "plan") else None
        return None if rows is None else [row for row, alive in zip(read_host(rows), active) if alive]

    def _eos(self, p: SamplingParams) -> set:
        """The model's end-of-sequence ids: the runner's (tokenizer and generation config, set by
        the loader) and the tokenizer's."""
        if p.ignore_eos:
            return set()
        eos = set(getattr(self.target, "eos_token_ids", ()) or ())
        tokenizer_eos = None if self.tokenizer is None else self.tokenizer.eos_token_id
        if tokenizer_eos is not None:
            eos |= set(tokenizer_eos) if isinstance(tokenizer_eos, (list, tuple)) else {tokenizer_eos}
        return eos

    def _decode_text(self, ids):
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def _metrics(self, m: StepMetrics, row: int, n_new: int, forwards: list[int], wall: float,
                 first_token: float) -> Metrics:
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
                       wait_time_s=dict(m.wait_time_s), time_to_first_token_s=first_token)
