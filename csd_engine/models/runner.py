"""What every model runner offers the strategies: one forward over new tokens on a static cache.

A step feeds each row `n` new tokens (1 to decode, k+1 to verify a chain, N tree nodes) with
explicit positions. Their keys/values go to slots `cache.lengths[b] .. + n - 1`; the
strategy then commits what it accepted with `cache.advance`. Rows never wait on each other:
ragged acceptance is just different `lengths`.
"""
import contextlib
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from csd_engine.kernels import use_kernels
from csd_engine.kernels.nonfinite import flag_nonfinite, flag_nonfinite_ref
from csd_engine.models.cache import KVCache


def on_device(device: torch.device):
    """Makes `device` the current CUDA device for what runs inside (a no-op off CUDA). Triton
    launches on the current device whatever its tensors' device: a model on cuda:1, or PEARL's
    drafter on a second GPU driven from another thread, needs this around its work."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@contextlib.contextmanager
def without_autocast(device: torch.device):
    """A caller's torch.autocast switched off inside (on `device`'s type and the CPU): the
    engine's forwards compute in its dtype, whose caches they write, not in the caller's."""
    with torch.autocast(device.type, enabled=False), torch.autocast("cpu", enabled=False):
        yield


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [B, n] int64
    positions: torch.Tensor  # [B, n] int64 absolute positions (prefix length + depth for trees)
    kv_bound: int  # host-side upper bound of lengths[b] + n over rows: attention reads slots [0, kv_bound)
    tree_mask: torch.Tensor | None = None  # [B, n, n] bool, None = causal among the new tokens
    need_logits: bool = True  # False for prefill, whose logits nobody reads
    # the runner flags rows with non-finite logits at any position (nonfinite_rows); False: the
    # caller flags the positions it uses (the target's verification, flag_used_logits)
    flag_all: bool = True
    # host-known: the rows from this one on hold no request (DecodeState.rows_in_use); a runner
    # that can (Runner.row_prefix) computes only the rows before it and gives the others zero logits
    rows: int | None = None

    @classmethod
    def chain(cls, tokens: torch.Tensor, lengths: torch.Tensor, kv_bound: int, need_logits: bool = True,
              flag_all: bool = True, rows: int | None = None):
        """Consecutive tokens appended after each row's committed prefix."""
        n = tokens.shape[1]
        positions = lengths[:, None] + torch.arange(n, device=tokens.device)[None, :]
        return cls(tokens, positions, kv_bound, None, need_logits, flag_all, rows)


def attention_window(config) -> int | None:
    """The sliding window a model's attention keeps (Mistral's `sliding_window`, Qwen2's with
    `use_sliding_window`, any layer of `layer_types` "sliding_attention"), or None: full attention.
    csd_engine's runners attend to the whole sequence, which equals the window's result while the
    sequence fits in it (the engine bounds max_seq_len by it)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window or not getattr(config, "use_sliding_window", True):
        return None
    return window if layer_types is None or "sliding_attention" in layer_types else None


def position_limit(model) -> tuple[int, str] | None:
    """How many positions a model computes as plain decoding does at any length, and why no
    more; None where positions go on past the config's maximum (plain RoPE, ALiBi). A learned
    position table (GPT-2's `wpe`, OPT's `embed_positions` less its offset): past it a forward
    fails. RoPE whose frequencies transformers switches with a forward's largest position
    (dynamic NTK past max_position_embeddings, LongRoPE past original_max_position_embeddings):
    past it a wide forward (verification) rotates its tokens otherwise than one-token decoding."""
    inputs = model.get_input_embeddings()
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Embedding) and module is not inputs and (leaf == "wpe" or "position" in leaf):
            positions = module.num_embeddings - getattr(module, "offset", 0)
            return positions, f"has learned embeddings for {positions} positions"
    config = model.config
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    limits = []
    for params in (rope.values() if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]):
        kind = params.get("rope_type", params.get("type")) or ""
        if "dynamic" in kind:
            limits.append((config.max_position_embeddings, f"rescales its rotary frequencies (rope_type {kind!r}) "
                                                           f"past {config.max_position_embeddings} positions"))
        elif kind == "longrope":
            original = params.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None) or config.max_position_embeddings
            limits.append((original, f"switches to its long rotary factors (rope_type 'longrope') past {original} "
                                     "positions"))
    return min(limits) if limits else None


class Runner:
    """Base of the native and the generic runner: owns the static cache and the bookkeeping."""

    vocab_size: int
    num_params: int
    device: torch.device
    # Bytes a decoding forward streams (the native runner's weights, packed where quantized); None
    # where unknown. At decode sizes a forward's cost follows it (budget.cost_ratio).
    weight_bytes: int | None = None
    cache: KVCache | None = None
    # Every token id that ends a generation (tokenizer and generation config; see loader.eos_token_ids).
    eos_token_ids: tuple[int, ...] = ()
    # The model's sliding attention window (attention_window), None for full attention.
    attention_window: int | None = None
    # (positions, why): how many positions it computes as plain decoding does (position_limit), or None.
    position_limit: tuple[int, str] | None = None
    # The positions it was trained on (config.max_position_embeddings), or None: past them its output
    # is plain decoding's still, but untrained (the engine warns).
    trained_positions: int | None = None
    # Why it cannot verify token trees exactly (the generic runner's HFRunner._tree_limit), or None.
    tree_limit: str | None = None
    # [B] bool on the device, set by the engine for a generate call: rows whose logits were ever
    # NaN or infinite. Accumulated without a host read; the engine reads it with each step's tokens.
    nonfinite_rows: torch.Tensor | None = None
    # A drafter of a target whose vocabulary has padding rows past this model's (Qwen2.5 7B's 152064
    # against 0.5B's 151936, one tokenizer): its logits get that many rows of -inf (it never
    # proposes them) and the target's ids past its own are fed as its last row (own_ids).
    vocab_pad: int = 0
    # Engines built over one runner take turns: `busy` (a threading.Lock) is held by the one
    # generating, `cache_owner` (a weakref) names the engine the cache was last sized and set for.
    busy = None
    cache_owner = None
    # forwards only the rows before ForwardBatch.rows, on views of its cache (a KVCache of its own)
    row_prefix = False

    def own_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids` as this model can embed them: a padding id of the target's vocabulary (which no
        tokenizer makes, but sampling may emit) becomes this model's last row (vocab_pad)."""
        return ids.clamp(max=self.vocab_size - 1) if self.vocab_pad else ids

    def allocate(self, batch: int, capacity: int) -> None:
        raise NotImplementedError

    def use_rows(self, batch: int) -> None:
        """Run on the first `batch` rows of the allocated cache from now on (a scheduler of
        fewer rows than the engine's max_batch_size); the caller then resets their lengths."""
        raise NotImplementedError

    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits [B, n, V] float32 (None when batch.need_logits is False)."""
        raise NotImplementedError

    def prefill(self, rows: slice, ids: torch.Tensor, start: int = 0) -> None:
        """Keep the first `start` slots of rows `rows` and write `ids` [len(rows), n] after them
        (right-padded; the caller then sets each row's committed length). The other rows are not
        touched, so a request can join a batch whose other rows are mid-generation, and a long
        prompt can be prefilled in chunks (start > 0: the next chunk)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement prefill(rows, ids), which the engine "
                                  "needs to start requests (see LlamaRunner.prefill)")

    def __call__(self, batch: ForwardBatch) -> torch.Tensor | None:
        if self.row_prefix and batch.rows is not None and batch.rows < batch.input_ids.shape[0]:
            return self._row_prefix_forward(batch)
        with on_device(self.device):  # prefill goes through here too
            logits = self.forward(replace(batch, input_ids=self.own_ids(batch.input_ids)) if self.vocab_pad else batch)
            if logits is not None and batch.flag_all:
                self.flag_used_logits(logits)
            if logits is not None and self.vocab_pad:
                logits = F.pad(logits, (0, self.vocab_pad), value=float("-inf"))
        return logits

    def _row_prefix_forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        """The forward of rows [0, batch.rows), on views of their cache rows and flags: a step of
        a scheduler whose later rows hold no request costs what its occupied rows do (on a CPU a
        forward's matmuls grow with every row). The idle rows' logits are zeros."""
        n, full, flags = batch.rows, self.cache, self.nonfinite_rows
        self.cache, self.nonfinite_rows = full.rows(n), None if flags is None else flags[:n]
        try:
            logits = self(replace(batch, input_ids=batch.input_ids[:n], positions=batch.positions[:n], rows=None,
                                  tree_mask=None if batch.tree_mask is None else batch.tree_mask[:n]))
        finally:
            self.cache, self.nonfinite_rows = full, flags
        if logits is None:
            return None
        return torch.cat([logits, logits.new_zeros(batch.input_ids.shape[0] - n, *logits.shape[1:])])

    def flag_used_logits(self, logits: torch.Tensor, positions: torch.Tensor | None = None,
                         counts: torch.Tensor | None = None) -> None:
        """nonfinite_rows |= rows of this model's logits [B, n, V] non-finite where used (kernels/nonfinite.py:
        positions[b, j] for j < counts[b], default all); nothing when the engine keeps no flags."""
        if self.nonfinite_rows is not None:
            (flag_nonfinite if use_kernels(logits) else flag_nonfinite_ref)(logits, self.nonfinite_rows, positions,
                                                                            counts)
