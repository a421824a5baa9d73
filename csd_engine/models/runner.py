"""What every model runner offers the strategies: one forward over new tokens on a static cache.

A step feeds each row `n` new tokens (1 to decode, k+1 to verify a chain, N tree nodes) with
explicit positions. Their keys/values go to slots `cache.lengths[b] .. + n - 1`; the
strategy then commits what it accepted with `cache.advance`. Rows never wait on each other:
ragged acceptance is just different `lengths`.
"""
from dataclasses import dataclass

import torch

from csd_engine.kernels import use_kernels
from csd_engine.kernels.mask import attention_mask  # noqa: F401  (re-exported: bench/gpu.py imports it from here)
from csd_engine.kernels.nonfinite import flag_nonfinite, flag_nonfinite_ref
from csd_engine.models.cache import KVCache


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [B, n] int64
    positions: torch.Tensor  # [B, n] int64 absolute positions (prefix length + depth for trees)
    kv_bound: int  # host-side upper bound of lengths[b] + n over rows: attention reads slots [0, kv_bound)
    tree_mask: torch.Tensor | None = None  # [B, n, n] bool, None = causal among the new tokens
    need_logits: bool = True  # False for prefill, whose logits nobody reads

    @classmethod
    def chain(cls, tokens: torch.Tensor, lengths: torch.Tensor, kv_bound: int, need_logits: bool = True):
        """Consecutive tokens appended after each row's committed prefix."""
        n = tokens.shape[1]
        positions = lengths[:, None] + torch.arange(n, device=tokens.device)[None, :]
        return cls(tokens, positions, kv_bound, None, need_logits)


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


def position_limit(model) -> int | None:
    """How many positions a model's learned position table holds (GPT-2's `wpe`, OPT's
    `embed_positions` less its offset), or None: positions without a table (RoPE, ALiBi), which
    go on past the config's maximum. Past the table a forward fails (an index error)."""
    inputs = model.get_input_embeddings()
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Embedding) and module is not inputs and (leaf == "wpe" or "position" in leaf):
            return module.num_embeddings - getattr(module, "offset", 0)
    return None


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
    # The positions its learned position table holds (position_limit), None without a table.
    max_positions: int | None = None
    # [B] bool on the device, set by the engine for a generate call: rows whose logits were ever
    # NaN or infinite. Accumulated without a host read; the engine reads it with each step's tokens.
    nonfinite_rows: torch.Tensor | None = None

    def allocate(self, batch: int, capacity: int) -> None:
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
        logits = self.forward(batch)
        if logits is not None and self.nonfinite_rows is not None:
            (flag_nonfinite if use_kernels(logits) else flag_nonfinite_ref)(logits, self.nonfinite_rows)
        return logits
