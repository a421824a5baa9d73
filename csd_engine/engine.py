"""The public engine: load models once, then `generate` with any strategy.

    engine = Engine(target="smollm2-135m", drafters=["mag"], max_batch_size=4, max_seq_len=1024)
    results = engine.generate(["Hello"], SamplingParams(max_new_tokens=32), strategy=Autoregressive())

`generate` (a batch to the end), `stream` (the same, yielding each step's increments) and
`scheduler` (continuous batching: requests join and leave between steps) all run on
csd_engine.scheduler.Scheduler: admit requests into rows of the static caches (a prefill of
those rows), then repeat the strategy's `step` and read its tokens once per step.

Host reads: one per step. The scheduler reads the step's emitted tokens, counts, non-finite
flags (and log-probabilities when asked) and the decoder's `plan` for the next step (what
each row asks of it: e.g. how many tokens its MaG match proposes, whether a PEARL row has
drafts carried) in one copy (`read_host`); a decoder turns the active rows' plans into the
host-known shapes of its next step. Nothing inside a step reads the device, so a step is a
fixed sequence of device work (tests/strategies/test_host_reads.py counts). `active` goes back
to the device only in a step where a row joined or left. Exceptions, by design: the generic
(transformers) runner crops each row's cache on the host; Pearl's worker thread joins on the
host; kernel input checks read values only when asked (tests).
"""
import os
import threading
import warnings
import weakref
from collections.abc import Mapping

import torch

from csd_engine import ops
from csd_engine.checks import is_int, is_integral
from csd_engine.drafters.mag import MaG
from csd_engine.models.graphs import GraphedRunner, maybe_graphed
from csd_engine.models.llama import LlamaRunner
from csd_engine.models.loader import check_spec, load_runner, split_spec
from csd_engine.models.quant import drafter_dense_rows
from csd_engine.params import SamplingParams
from csd_engine.scheduler import HEADROOM, GenerationResult, Scheduler
from csd_engine.strategies.base import Models
from csd_engine.verifier import Verifier, choose_backend

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTENTION_BACKENDS = ("sdpa", "triton")
DEFAULT_MAX_SEQ_LEN = 2048  # max_seq_len when not given, unless a model's window or position table is shorter


def _checked_dtype(dtype) -> torch.dtype:
    """A model dtype: one of DTYPES' values, or its name."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16 (or its name: "
                         f"{', '.join(DTYPES)}), got {dtype!r}")
    return dtype


def _checked_device(device, name: str = "device") -> torch.device:
    """A CPU or an available CUDA device."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name} must be 'cpu', 'cuda' or 'cuda:N' (or a torch.device), got {device!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} must be 'cpu', 'cuda' or 'cuda:N' (or a torch.device), got {str(device)!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}={str(device)!r}, but torch sees no CUDA device here (torch.cuda.is_available() "
                         "is False): use 'cpu'")
    if device.type == "cuda":  # "cuda": the current device now, fixed (the threads that run it have their own)
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"{name}={str(device)!r}, but torch sees {torch.cuda.device_count()} CUDA device(s): "
                             f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
        device = torch.device("cuda", index)
    return device


def _indexed(device) -> torch.device:
    """`device` with the current CUDA device's index where it names none ("cuda": where tensors made
    on it land), so that it compares equal to the engine's own (`_checked_device`)."""
    device = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None \
        else device


def _kv_bytes(runner, batch: int, capacity: int) -> int:
    """Bytes of a native runner's static KV cache (keys and values) of `batch` rows of `capacity`
    slots; 0 for a runner whose caches grow as they fill (the generic one)."""
    native = getattr(runner, "runner", runner)  # a GraphedRunner's
    if not isinstance(native, LlamaRunner):
        return 0
    return 2 * native.num_layers * batch * native.num_kv_heads * capacity * native.head_dim * native.dtype.itemsize


def _held_bytes(runner) -> int:
    """Bytes of the static KV cache a native runner holds now (a runner passed in again)."""
    full = getattr(getattr(runner, "runner", runner), "full_cache", None)
    return 0 if full is None else full.k.nbytes + full.v.nbytes


def _cpu_memory_available() -> int | None:
    """MemAvailable + SwapFree from /proc/meminfo in bytes (None off Linux)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return sum(int(fields[name].split()[0]) * 1024 for name in ("MemAvailable", "SwapFree"))
    except (OSError, KeyError, ValueError):
        return None


def _unpadded_rows(encoding) -> list[list[int]]:
    """A tokenizer's output (a BatchEncoding: input_ids and attention_mask, lists or tensors, one
    row or several) as token-id lists without the positions its mask zeroes: the padding."""
    def rows(x):
        x = x.tolist() if hasattr(x, "tolist") else list(x)
        return [x] if x and is_integral(x[0]) else [list(r) for r in x]
    ids, mask = rows(encoding["input_ids"]), encoding.get("attention_mask")
    if mask is None:
        return ids
    mask = rows(mask)
    if [len(r) for r in mask] != [len(r) for r in ids]:
        raise ValueError("the tokenizer output's attention_mask does not have its input_ids' shape")
    return [[t for t, keep in zip(r, m) if keep] for r, m in zip(ids, mask)]


def _check_one_role_each(models: list) -> None:
    """A runner holds one KV cache and MaG one set of statistics per row: the same object as the
    target and a drafter, or as two drafters, would have each overwrite the other's."""
    roles = {}
    for name, model in zip(["the target"] + [f"drafter {i}" for i in range(len(models) - 1)], models):
        inner = model.runner if isinstance(model, GraphedRunner) else model
        if id(inner) in roles:
            raise ValueError(f"{name} is the same {type(inner).__name__} object as {roles[id(inner)]}: it holds one "
                             "cache, so it can fill one role in an engine; pass the model (or its path) again, "
                             "which gets a runner of its own")
        roles[id(inner)] = name


class Engine:
    @torch.inference_mode(False)  # caches made under an application's inference_mode could not be reset outside it
    def __init__(self, target, drafters=(), device=None, dtype=torch.float32, max_batch_size: int = 8,
                 max_seq_len: int | None = None, verify_backend: str | None = None, native: bool | None = None,
                 tokenizer=None, attention_backend: str = "sdpa", cuda_graphs: bool | str = False,
                 fused_kernels: bool | None = None, drafter_device=None, batch_invariant: bool = False):
        if isinstance(drafters, (str, os.PathLike, torch.nn.Module, MaG)):
            drafters = [drafters]
        if drafters is None or not isinstance(drafters, (list, tuple)):
            raise TypeError(f"drafters must be a list (of zoo names, folders, models or 'mag'; [] for none), "
                            f"got {drafters!r}")
        for name, value, low in (("max_batch_size", max_batch_size, 1), ("max_seq_len", max_seq_len, 2)):
            if name == "max_seq_len" and value is None:
                continue
            if not is_int(value) or value < low:
                raise ValueError(f"{name} must be an int >= {low}" + (" (or None: the default)" * (low == 2))
                                 + f", got {value!r}")
        if native is not None and not isinstance(native, bool):
            raise TypeError(f"native must be None (the native runner where it supports the model), True or False, "
                            f"got {native!r}")
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"tokenizer must be None (the model's own) or a tokenizer object with a decode method "
                            f"(e.g. transformers.AutoTokenizer.from_pretrained(...)), got {tokenizer!r}")
        if fused_kernels is not None and not isinstance(fused_kernels, bool):
            raise TypeError(f"fused_kernels must be None (fused wherever the fused ops run: CUDA, or a CPU with "
                            f"the extension), True or False, got {fused_kernels!r}")
        if not isinstance(batch_invariant, bool):
            raise TypeError(f"batch_invariant must be True or False, got {batch_invariant!r}")
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")
        for spec in (target, *drafters):  # a typo or a missing path is refused before anything loads
            check_spec(spec)
        dtype = _checked_dtype(dtype)
        self.device = _checked_device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cpu":
            ops.warn_without_extension()
        # Neural drafters may live on a device of their own (PEARL's two-device layout); the
        # other strategies refuse such an engine (strategies.base.require_one_device).
        self.drafter_device = self.device if drafter_device is None else _checked_device(drafter_device,
                                                                                        "drafter_device")
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.verifier = Verifier(choose_backend(verify_backend, self.device))
        self.fused_kernels = fused_kernels
        self.target, own_tokenizer = load_runner(target, self.device, dtype, native, attention_backend, fused_kernels)
        self.cuda_graphs = cuda_graphs
        self.target = maybe_graphed(self.target, cuda_graphs)  # CUDA graphs: native runner on a GPU only
        self.tokenizer = tokenizer or own_tokenizer
        self.drafters = [maybe_graphed(self._load_drafter(d, native, attention_backend), cuda_graphs)
                         for d in drafters]
        _check_one_role_each([self.target, *self.drafters])
        if _indexed(self.target.device) != self.device:
            raise ValueError(f"the target is a runner on {self.target.device}, but the engine runs on {self.device} "
                             "(device): build it there or pass a model")
        for i, d in enumerate(self.drafters):
            # a runner built on "cuda" (no index) holds its tensors on the device current then: the
            # engine's "cuda" resolves to the same index (_checked_device), torch.device equality does not
            if not isinstance(d, MaG) and _indexed(d.device) != self.drafter_device:
                raise ValueError(f"drafter {i} is a runner on {d.device}, but the engine puts drafters on "
                                 f"{self.drafter_device} (drafter_device): build it there or pass a model")
        self.batch_invariant = batch_invariant
        if batch_invariant:
            self._make_batch_invariant()
        self.max_seq_len = self._sequence_limit(max_seq_len)
        self.capacity = self.max_seq_len + HEADROOM
        self._busy = threading.Lock()  # held by the one scheduler (or generate) using the caches
        for runner in self.models():  # one lock per runner, shared by every engine built over it
            runner.busy = runner.busy or threading.Lock()
        if not self._acquire():
            raise RuntimeError("a runner passed to this engine is in use by another Engine's generate or scheduler: "
                               "build this one once that has ended")
        try:
            self._claim_runners()
        finally:
            self._release()
        # On the CPU the target verifies only up to the longest real draft: one host read per
        # step more, which costs nothing there, against a forward whose cost grows with its width.
        self.trim_drafts = self.device.type == "cpu"
        self._kept_steps = None  # the last scheduler's step graphs (scheduler.KeptSteps), cuda_graphs="step"

    def _sequence_limit(self, requested: int | None) -> int:
        """max_seq_len as asked, or by default DEFAULT_MAX_SEQ_LEN or less where a model's limit or
        trained positions come first (asked past those, a warning). A sliding window: full attention
        (csd_engine's) equals the window's while the sequence and its drafts' HEADROOM fit in it. A learned position table, or rotary frequencies
        that change past a length (runner.position_limit): no position past it."""
        limits, trained = [], []
        for name, runner in zip(["the target"] + [f"drafter {i}" for i in range(len(self.drafters))],
                                [self.target, *self.drafters]):
            window, positions = getattr(runner, "attention_window", None), getattr(runner, "position_limit", None)
            if getattr(runner, "trained_positions", None) is not None:
                trained.append((runner.trained_positions, name))
            if window is not None:
                limits.append((window - HEADROOM, f"{name} attends over a sliding window of {window} tokens; "
                                                  f"csd_engine attends to the whole sequence, the same while it fits "
                                                  f"the window with {HEADROOM} slots for drafts"))
            if positions is not None:
                limits.append((positions[0] - HEADROOM, f"{name} {positions[1]}, which must hold the sequence "
                                                        f"and {HEADROOM} slots for drafts"))
        for limit, reason in limits:
            if limit < 2:
                raise ValueError(f"{reason}: no max_seq_len (>= 2) fits")
            if requested is not None and requested > limit:
                raise ValueError(f"{reason}: max_seq_len must be at most {limit}, got {requested}")
        if requested is None:
            return min([DEFAULT_MAX_SEQ_LEN] + [limit for limit, _ in limits] + [positions for positions, _ in trained])
        for positions, name in trained:
            if requested > positions:
                warnings.warn(f"max_seq_len={requested} lets sequences run past the {positions} positions {name} was "
                              f"trained on (config.max_position_embeddings): there its output, csd_engine's and plain "
                              f"decoding's alike, is untrained", stacklevel=ops.caller_stacklevel())
        return requested

    def _load_drafter(self, spec, native, attention_backend):
        if isinstance(spec, MaG) or (isinstance(spec, str) and spec.lower() == "mag"):
            return (spec if isinstance(spec, MaG) else MaG()).to(self.device)
        # a quantized drafter keeps dense copies for wide calls (prefill, catch-up): faster, same losslessness
        runner, _ = load_runner(spec, self.drafter_device, self.dtype, native, attention_backend, self.fused_kernels,
                                dense_rows=drafter_dense_rows(self.drafter_device, self.dtype,
                                                              split_spec(spec)[1] if isinstance(spec, str) else None),
                                with_tokenizer=False)
        if runner.vocab_size != self.target.vocab_size:
            # a smaller drafter is the same tokenizer's when the target's rows past it are padding
            tokens = len(self.tokenizer) if hasattr(self.tokenizer, "__len__") else None
            if runner.vocab_size > self.target.vocab_size or tokens is None or tokens > runner.vocab_size:
                known = "no tokenizer tells" if tokens is None else f"the tokenizer has {tokens} tokens"
                raise ValueError(f"drafter vocabulary ({runner.vocab_size} tokens) differs from the target's "
                                 f"({self.target.vocab_size}): drafter and target must share a tokenizer (a "
                                 f"smaller drafter vocabulary is taken where the target's rows past it are padding, "
                                 f"its tokenizer's tokens all below {runner.vocab_size}; {known})")
        return runner

    def _allocate_caches(self) -> None:
        """Every runner's static KV cache for max_batch_size rows of `capacity` slots. Caches that
        do not fit are refused naming their size and the two settings that set it: on the CPU
        before allocating (zeroing more than the memory available gets the process killed, past
        any error), elsewhere when the allocator fails."""
        caches = [("the target" if i == 0 else f"drafter {self.drafters.index(r)}", r,
                   _kv_bytes(r, self.max_batch_size, self.capacity)) for i, r in enumerate(self.models())]
        on_cpu = [(which, r, size) for which, r, size in caches if r.device.type == "cpu"]
        available = _cpu_memory_available() if on_cpu else None
        if available is not None:  # caches these runners hold already are given back as the new ones come
            available += sum(_held_bytes(r) for r in {id(r): r for _, r, _ in on_cpu}.values())
            if sum(size for _, _, size in on_cpu) > available:
                raise MemoryError(self._too_big(on_cpu, f"more than the {available / 2 ** 30:.1f} GiB of memory "
                                                        "available"))
        for which, runner, size in caches:
            try:
                runner.allocate(self.max_batch_size, self.capacity)
            except RuntimeError as exc:  # torch.OutOfMemoryError on CUDA, the allocator's error on the CPU
                if not (isinstance(exc, torch.OutOfMemoryError) or "allocate" in str(exc)):
                    raise
                raise MemoryError(self._too_big([(which, runner, size)], f"too much for {runner.device}")) from None
            runner.cache_owner = weakref.ref(self)
        self._kept_steps = None  # captured over the caches just replaced

    def _too_big(self, caches: list, why: str) -> str:
        total = sum(size for _, _, size in caches) / 2 ** 30
        each = ", ".join(f"{which} {size / 2 ** 30:.1f}" for which, _, size in caches if size)
        return (f"the KV caches for max_batch_size={self.max_batch_size} rows of {self.capacity} slots (max_seq_len "
                f"{self.max_seq_len} + {HEADROOM} for drafts) take {total:.1f} GiB ({each}), {why}: lower "
                "max_batch_size or max_seq_len")

    def _make_batch_invariant(self) -> None:
        """Every model's logits for a row stop depending on the other rows (LlamaRunner.make_batch_invariant),
        so a seeded request gives the same tokens whatever shares its batch on any device."""
        for i, runner in enumerate(self.models()):
            native = getattr(runner, "runner", runner)  # a GraphedRunner wraps the native runner
            if not isinstance(native, LlamaRunner):
                which = "the target" if i == 0 else f"drafter {i - 1}"
                raise ValueError(f"batch_invariant=True needs the native runner, but {which} runs on the generic "
                                 "transformers runner (its forwards take another shape per step): load it with "
                                 "native=True (Llama / Qwen2 / Mistral architectures)")
            native.make_batch_invariant()

    def _locks(self) -> list:
        """The engine's lock and its runners' (one per runner, shared with every engine built over it)."""
        return [self._busy] + list({id(r.busy): r.busy for r in self.models()}.values())

    def _acquire(self) -> bool:
        """Take `_locks()`, so that one engine over these runners generates at a time; False,
        holding none, where one is taken."""
        held = []
        for lock in self._locks():
            if not lock.acquire(blocking=False):
                for taken in held:
                    taken.release()
                return False
            held.append(lock)
        return True

    def _release(self) -> None:
        for lock in self._locks():
            lock.release()

    def _claim_runners(self) -> None:
        """Set the runners up for this engine (the caller holds their locks), where it is new or
        another Engine built over one of them ran since: fresh caches of this engine's shape (a
        graphed runner's graphs and this engine's kept step graphs go with the old ones), and
        every time, its vocabulary padding (the outermost runner pads, see GraphedRunner)."""
        if any(r.cache_owner is None or r.cache_owner() is not self for r in self.models()):
            self._allocate_caches()
        for runner in self.models():
            runner.vocab_pad = self.target.vocab_size - runner.vocab_size
            if getattr(runner, "runner", None) is not None:  # a GraphedRunner's wrapped runner
                runner.runner.vocab_pad = 0

    def __reduce__(self):
        raise TypeError("an Engine holds loaded models and their caches and cannot be pickled or copied: build one "
                        "in each process (multiprocessing's spawn or forkserver start methods) from the same "
                        "target, drafters and options")

    def models(self):
        """The neural runners (target first); MaG has no cache."""
        return [self.target] + [d for d in self.drafters if not isinstance(d, MaG)]

    def _decoder_models(self) -> Models:
        return Models(self.target, self.drafters, self.verifier, self.capacity, self.device, self.drafter_device,
                      trim_drafts=self.trim_drafts, batch_invariant=self.batch_invariant)

    # ----------------------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 strategy=None) -> list[GenerationResult]:
        """Generate for prompts (text or token ids) to the end, results in order. Any number of
        prompts: at most max_batch_size decode at once, the others join as rows free up.
        Raises ValueError if a model produced non-finite logits for a prompt (the others ran to
        their end; the engine stays usable)."""
        prompt_ids = self._encode(prompts)
        params = self._params(params, len(prompt_ids))
        done = {}
        with self.scheduler(strategy, rows=min(len(prompt_ids), self.max_batch_size)) as scheduler:
            ids = [scheduler.add(p, q) for p, q in zip(prompt_ids, params)]
            while scheduler.has_unfinished():
                done.update((out.request_id, out.result) for out in scheduler.step() if out.finished)
        results = [done[i] for i in ids]
        failed = [(i, r) for i, r in enumerate(results) if r.finish_reason == "error"]
        if failed:
            models = sorted({m for _, r in failed for m in r.failed_models})
            raise ValueError(self._nonfinite_message(models, [i for i, _ in failed]))
        return results

    def stream(self, prompts, params: SamplingParams | list[SamplingParams] | None = None, strategy=None):
        """Like `generate`, but yields each step's increments (RequestOutput, request_id = the
        prompt's index as a string) as the step commits them: token ids, text deltas (their
        concatenation is the result's text) and, last for each prompt, its GenerationResult.
        Prompts past max_batch_size wait for free rows, as in `generate`."""
        prompt_ids = self._encode(prompts)
        params = self._params(params, len(prompt_ids))
        with self.scheduler(strategy, rows=min(len(prompt_ids), self.max_batch_size)) as scheduler:
            for p, q in zip(prompt_ids, params):
                scheduler.add(p, q)
            while scheduler.has_unfinished():
                yield from scheduler.step()

    def scheduler(self, strategy=None, rows: int | None = None, max_waiting: int | None = None,
                  prefill_chunk: int | None = None) -> Scheduler:
        """A continuous-batching scheduler over this engine's caches (csd_engine.scheduler):
        add / abort requests at any time, `step` returns increments. One at a time per engine.
        prefill_chunk: prompt tokens prefilled per step (None: a whole prompt when it joins)."""
        from csd_engine.strategies import Autoregressive
        return Scheduler(self, Autoregressive() if strategy is None else strategy, rows, max_waiting, prefill_chunk)

    def _encode(self, prompts) -> list[list[int]]:
        if isinstance(prompts, Mapping) and "input_ids" in prompts:  # a tokenizer's output
            prompts = _unpadded_rows(prompts)
        if getattr(prompts, "ndim", None) in (1, 2):  # a NumPy array or torch tensor: one prompt, or one per row
            prompts = prompts.tolist()
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and is_integral(prompts[0])):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
        return [self.encode_prompt(p, i) for i, p in enumerate(prompts)]

    def encode_prompt(self, p, i: int | None = None) -> list[int]:
        """The token ids a prompt (text, or token ids as `generate` takes them) runs as, checked
        against the vocabulary and max_seq_len; a ValueError names prompt `i` otherwise."""
        name = "prompt" if i is None else f"prompt {i}"
        if isinstance(p, Mapping) and "input_ids" in p:  # a tokenizer's output (apply_chat_template's)
            rows = _unpadded_rows(p)
            if len(rows) != 1:
                raise ValueError(f"{name} is a tokenizer output of {len(rows)} rows; one prompt is one row")
            p = rows[0]
        if isinstance(p, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this engine has none (a model passed in brings "
                                 "none): pass Engine(..., tokenizer=...) or token-id lists")
            try:
                p.encode()
            except UnicodeEncodeError as exc:
                raise ValueError(f"{name} is not valid Unicode text: {exc.reason} at character {exc.start}") from None
            p = self.tokenizer(p, add_special_tokens=True)["input_ids"]
        if getattr(p, "ndim", None) == 1:  # a NumPy array or torch tensor of token ids
            p = p.tolist()
        if not isinstance(p, (list, tuple)) or not all(is_integral(t) for t in p):
            raise ValueError(f"{name} must be a string or a list of token ids (ints, also NumPy's; or a 1-D integer "
                             "array or tensor)")
        p = [int(t) for t in p]
        if not p:
            raise ValueError(f"{name} is empty")
        if len(p) >= self.max_seq_len:
            raise ValueError(f"{name} has {len(p)} tokens; max_seq_len={self.max_seq_len} leaves no room "
                             f"to generate (prompt must be shorter than max_seq_len)")
        if min(p) < 0 or max(p) >= self.target.vocab_size:
            raise ValueError(f"{name} has token ids outside [0, {self.target.vocab_size})")
        return p

    def _params(self, params, n) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return [params] * n
        if not isinstance(params, (list, tuple)):
            raise TypeError(f"params must be one SamplingParams or a list of {n} (one per prompt), got "
                            f"{type(params).__name__} (a GenerationConfig's settings are not read: give "
                            "SamplingParams(max_new_tokens=..., temperature=..., ...))")
        params = list(params)
        if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"params must be one SamplingParams or a list of {n} (one per prompt)")
        return params

    def _nonfinite_message(self, models: list[int], prompts: list) -> str:
        """Why a request failed: which models (indexes into `models()`) produced NaN / inf logits."""
        names = ["the target"] + [f"drafter {i}" for i, d in enumerate(self.drafters) if not isinstance(d, MaG)]
        which = sorted({names[m] for m in models})
        return (f"non-finite logits (NaN or inf) from {', '.join(which)} for prompt(s) {prompts}: the model's "
                f"weights or activations overflow or are corrupt in {self.dtype}; use float32 or bfloat16 "
                "(float16 overflows easily) or check the model's weights")

    def eos_token_ids(self, p: SamplingParams) -> set:
        """The ids that end a request with params `p`: the model's end-of-sequence ids, the
        runner's (tokenizer and generation config, set by the loader) and the tokenizer's; none
        with ignore_eos (its stop_token_ids are the caller's to add)."""
        if p.ignore_eos:
            return set()
        eos = set(getattr(self.target, "eos_token_ids", ()) or ())
        tokenizer_eos = None if self.tokenizer is None else self.tokenizer.eos_token_id
        if tokenizer_eos is not None:
            eos |= set(tokenizer_eos) if isinstance(tokenizer_eos, (list, tuple)) else {tokenizer_eos}
        return eos
