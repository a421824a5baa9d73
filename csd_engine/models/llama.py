"""Native Llama-family decoder (Llama, Mistral, Qwen2/2.5 with qkv bias, SmolLM2) on a static cache.

Weights are taken from a loaded `transformers` model (so folders, hub ids and GGUF files all
load the same way) and re-packed: q/k/v fused into one matmul, gate/up into another.
Numerics follow transformers: RMSNorm in fp32, RoPE tables computed in fp32 then cast.

Two paths with the same roundings: plain PyTorch ops, and `fused=True` (the default): the
residual add fused with each RMSNorm and RoPE with the KV-cache write, taking a layer from ~40
launches to ~12. On CUDA these are Triton kernels (kernels/rmsnorm.py, kernels/rope.py): on an
H100 (bench/gpu.py forward_profile, docs/measurements.md) a graphed Llama-2-7B decoding forward takes 6.0 ms
fused against 7.8 ms plain. On the CPU they are the extension's C++ ops (csrc/decode_cpu.cpp),
with the activation and the attention of decoding and verification forwards (chains and trees)
as well: a layer is its matmuls and five other ops. That attention computes each new token as if
it were decoded alone after the same keys, and the CPU matmul kernels compute each row alone, so
on the CPU a token's logits do not depend on the forward's width or its place in a tree: greedy
speculative decoding emits plain decoding's tokens exactly.
The fused path is tested against the PyTorch one on both.

`quantize="int8" | "int4" | "int4gG"` (models/quant.py) stores the qkv, o, gate_up and down
projections and the lm_head as weight-only quantized matrices on torch's packed-weight matmuls;
the embedding stays float (a lookup reads a few rows). The head is a quarter of the 0.5B Qwen's
weights: quantizing it too took its int4 one-token forward from 39 to 24 ms (CPU, one thread).
`dense_rows=R` also keeps each quantized matrix dequantized, for calls of more than R rows
(quant.py, "Wide calls"; the engine sets it for quantized drafters).
Both paths call every matrix through `linear`. `truncated(L)` is an
early-exit drafter: a view running the first L layers, then the model's own final norm and head,
sharing every weight tensor and owning a cache of its own.
"""
import copy
import dataclasses
import os
import warnings

import torch
import torch.nn.functional as F

from csd_engine import ops
from csd_engine.checks import is_int
from csd_engine.kernels.mask import attention_mask
from csd_engine.kernels.rmsnorm import add_rmsnorm, add_rmsnorm_ref
from csd_engine.kernels.rope import rope_and_cache, rope_tables, rotate
from csd_engine.models.cache import KVCache
from csd_engine.models.quant import (TORCH_CPU_PACKED_SLOWDOWN, QuantizedLinear, linear, on_torch_cpu_ops, parse_scheme,
                                      quantize_weight)
from csd_engine.models.runner import ForwardBatch, Runner, attention_window, position_limit

NATIVE_MODEL_TYPES = ("llama", "mistral", "qwen2")


def unsupported(cfg) -> str | None:
    """Why the native runner cannot run a model of a native type, or None: it computes a
    SiLU-gated MLP without biases from dense weights. Rotary frequencies are the model's at load:
    where transformers changes them past a length (dynamic NTK, LongRoPE), the engine keeps the
    sequence below it (runner.position_limit)."""
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (its MLP is SiLU-gated)"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases (mlp_bias=True)"
    if getattr(cfg, "quantization_config", None):
        return "a quantized checkpoint (quantization_config: its layers hold scales the native runner does not read)"
    return None


_PROJECTIONS = tuple(f"self_attn.{n}_proj" for n in "qkvo") + tuple(f"mlp.{n}_proj" for n in ("gate", "up", "down"))
_LAYER_WEIGHTS = {"input_layernorm.weight", "post_attention_layernorm.weight", *(f"{p}.weight" for p in _PROJECTIONS),
                  *(f"self_attn.{n}_proj.bias" for n in "qkvo")}


def _hook_module(hook) -> str:
    return getattr(hook, "__module__", None) or getattr(getattr(hook, "func", None), "__module__", None) or ""


def nonstock(model) -> str | None:
    """Why the native runner, which reads the weights by name and computes the layers itself,
    would not compute what this model's modules do, or None: forward hooks it would not run,
    projections or embeddings of other classes than torch's (an adapter's wrapper), weights it
    would not read (LoRA's lora_A, a wrapper's base_layer)."""
    for name, module in model.named_modules():
        hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
        if any(not _hook_module(hook).startswith("transformers.") for hook in hooks):  # its own record outputs only
            return f"{name or 'the model'} has forward hooks, which it would not run"
    layers = model.model.layers
    modules = [(f"model.layers.{i}.{p}", layer.get_submodule(p), torch.nn.Linear)
               for i, layer in enumerate(layers) for p in _PROJECTIONS]
    modules += [("the input embeddings", model.get_input_embeddings(), torch.nn.Embedding),
                ("the output head", model.get_output_embeddings(), torch.nn.Linear)]
    for name, module, kind in modules:
        if type(module) is not kind:
            return f"{name} is a {type(module).__name__}, not a {kind.__module__}.{kind.__name__}"
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} | {
        f"model.layers.{i}.{w}" for i in range(len(layers)) for w in _LAYER_WEIGHTS}
    extra = sorted(set(model.state_dict()) - expected)
    if extra:
        return f"it has weights the native runner would not read ({', '.join(extra[:3])}{', ...' * (len(extra) > 3)})"
    return None


DEBUG_CHECKS = os.environ.get("CSD_DEBUG") == "1"
# Matmul rows per block in batch-invariant mode. On this CPU (Qwen 1.5B, bf16, batch 1) 16 rows
# cost 1.44x a 1-token forward and 1.17x a 9-token one; 4-row blocks are free up to 4 tokens but
# cost 2.4x the default runner at 9 (bench/forward_cost.py): 16 suits verification widths, and GPUs' GEMM tiles.
ROW_BLOCK = 16
# Widest forward whose attention runs on ops.decode_attention on the CPU: decoding and
# verification widths. Longer ones (prompt prefills, which every method runs alike) keep SDPA's
# tiled kernel: the op holds each token's scores whole (tokens x heads x keys floats) and fell
# behind from ~1500 tokens (Qwen 1.5B prefill of 1000 tokens 3.9 s against SDPA's 4.1, of 2000
# tokens 12.0 against 10.0; ad hoc, in-process, interleaved).
CPU_ATTENTION_MAX_TOKENS = 64
KV_ROUND = 64  # batch-invariant mode: SDPA's key range rounded up to a multiple of this
INVARIANT_SPLIT = 512  # KV slots per attention split in batch-invariant mode (fixed by the capacity only)
INVARIANT_BLOCK_ROWS = 16  # (query token, head) rows per attention tile in batch-invariant mode: any step width


def one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of one new token per row on the CPU, in float32 like SDPA: q [B, 1, Hq, D], k and
    v [B, Hkv, S, D], mask [B, 1, 1, S] bool; returns [B, 1, Hq, D] in q's dtype. Each KV head's
    query group is one matrix product with the keys. SDPA's CPU flash kernel parallelises over
    query blocks, of which decoding has one: at 1100 keys it took 1.1 ms per Qwen 1.5B layer, this
    0.14 ms (2 cores, bf16; 0.2 against 0.07 ms at 200 keys)."""
    b, _, hq, d = q.shape
    hkv = k.shape[1]
    query = q.reshape(b, hkv, hq // hkv, d).float()  # [B, Hkv, group, D]
    scores = torch.matmul(query, k.float().transpose(-1, -2)) * d ** -0.5  # [B, Hkv, group, S]
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(weights, v.float()).view(b, 1, hq, d).to(q.dtype)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """The MLP's activation of the fused [gate | up] projection: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class LlamaRunner(Runner):
    row_prefix = True

    def __init__(self, hf_model, device, dtype: torch.dtype, attention_backend: str = "sdpa",
                 fused: bool | None = None, quantize: str | None = None, dense_rows: int = 0):
        cfg = hf_model.config
        if quantize is not None:
            bits, _ = parse_scheme(quantize)
            if on_torch_cpu_ops(device, dtype):
                warnings.warn(f"quantize={quantize!r} with {str(dtype).removeprefix('torch.')} activations on the CPU "
                              "runs torch's packed matmuls, slower than the unquantized model (a Qwen 0.5B forward "
                              f"took {TORCH_CPU_PACKED_SLOWDOWN[bits]:g}x its float32 one): quantized weights are "
                              "for dtype=torch.bfloat16 there", stacklevel=ops.caller_stacklevel())
            if quantize == "int8" and torch.device(device).type == "cuda":
                warnings.warn("quantize='int8' on CUDA runs torch's one-thread-per-output int8 kernel: a forward "
                              "took 8.7-85x the bf16 one on an H100 (docs/measurements.md, GPU); 'int4' took 0.5x",
                              stacklevel=ops.caller_stacklevel())
        reason = unsupported(cfg) or nonstock(hf_model)
        if reason:
            raise ValueError(f"the native runner cannot run this model: {reason} (the generic runner can: native=False)")
        self.attention_window = attention_window(cfg)
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.vocab_size = cfg.vocab_size
        self.attention_backend = attention_backend
        self.row_block = 0  # > 0: batch-invariant matmuls (make_batch_invariant)
        head_dim_ok = self.head_dim >= 2 and self.head_dim & (self.head_dim - 1) == 0
        # The fused path runs the extension's C++ ops on a CPU that has them, else Triton's kernels
        # (on a CPU only under TRITON_INTERPRET=1, as the kernel tests run them).
        cpu_ops = self.device.type == "cpu" and ops.cpu_layer_ops_run()
        # None: fused on CUDA (an H100 step 7.8 -> 6.0 ms, docs/measurements.md) and with the C++ ops on a CPU
        self.fused = ((self.device.type == "cuda" and head_dim_ok) or cpu_ops) if fused is None else bool(fused)
        self.cpu_layer_ops = self.fused and cpu_ops
        self.cpu_attention = cpu_ops  # the extension's attention op exists here (_cpu_attention_op)
        if self.fused and not (head_dim_ok or self.cpu_layer_ops):
            raise ValueError(f"fused=True needs a power-of-two head_dim, this model has {self.head_dim}")
        self.num_params = sum(p.numel() for p in hf_model.parameters())
        self.layer_params = [sum(p.numel() for p in layer.parameters()) for layer in hf_model.model.layers]
        self.quantize = quantize
        rotary = hf_model.model.rotary_emb
        # the frequencies at load (transformers swaps `inv_freq` while a forward runs past a length:
        # dynamic NTK's rescaled, LongRoPE's long factors); the sequence stays below it (position_limit)
        self.inv_freq = getattr(rotary, "original_inv_freq", rotary.inv_freq).detach().to(self.device, torch.float32)
        self.position_limit = position_limit(hf_model)
        self.trained_positions = getattr(hf_model.config, "max_position_embeddings", None)
        self.rope_scaling = float(rotary.attention_scaling)

        sd = {k: v.detach() for k, v in hf_model.state_dict().items()}

        def take(name):
            return sd[name].to(self.device, dtype)

        def maybe(name):
            return take(name) if name in sd else None

        def matrix(*names):
            """A projection or the head (the only weights `quantize` applies to): the rows of
            `names` fused into one matrix, quantized from the checkpoint's own precision."""
            if quantize is None:
                return torch.cat([take(n) for n in names]) if len(names) > 1 else take(names[0])
            try:
                return quantize_weight(torch.cat([sd[n].to(self.device) for n in names]), quantize, dtype, dense_rows)
            except ValueError as exc:
                raise ValueError(f"cannot quantize {' + '.join(names)}: {exc}") from None

        self.embed = take("model.embed_tokens.weight")
        # tied: transformers' state dict holds the head as the embedding itself (one cast, not two)
        head, embed = sd.get("lm_head.weight"), sd["model.embed_tokens.weight"]
        if head is not None and not (head.numel() and head.data_ptr() == embed.data_ptr() and head.shape == embed.shape
                                     and head.stride() == embed.stride()):
            self.lm_head = matrix("lm_head.weight")
        else:  # tied: a quantized head is a packed copy, the embedding stays float
            self.lm_head = self.embed if quantize is None else matrix("model.embed_tokens.weight")
        self.final_norm = take("model.norm.weight")
        self.layers = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            biases = [maybe(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            self.layers.append(dict(
                attn_norm=take(p + "input_layernorm.weight"),
                qkv=matrix(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")),
                qkv_bias=torch.cat(biases) if biases[0] is not None else None,
                o=matrix(p + "self_attn.o_proj.weight"),
                o_bias=maybe(p + "self_attn.o_proj.bias"),
                mlp_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=matrix(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=matrix(p + "mlp.down_proj.weight"),
            ))

    @property
    def weight_bytes(self) -> int:
        """Bytes a decoding forward streams: every layer's weights (packed where quantized), the
        final norm and the head; not the embedding table, of which it reads a row per token."""
        def streamed(w):
            return 0 if w is None else w.streamed_bytes if isinstance(w, QuantizedLinear) else w.nbytes
        return (sum(streamed(w) for layer in self.layers for w in layer.values()) + streamed(self.lm_head)
                + self.final_norm.nbytes)

    def allocate(self, batch: int, capacity: int) -> None:
        self.full_cache = KVCache.allocate(self.num_layers, batch, self.num_kv_heads, capacity,
                                           self.head_dim, self.dtype, self.device)
        self.cache = self.full_cache

    def use_rows(self, batch: int) -> None:
        self.cache = self.full_cache.rows(batch)

    def prefill(self, rows: slice, ids: torch.Tensor, start: int = 0) -> None:
        full = self.full_cache
        view = KVCache(full.k[:, rows], full.v[:, rows], full.lengths[rows])
        view.lengths.fill_(start)
        real, self.cache = self.cache, view
        try:
            if ids.shape[1]:
                self(ForwardBatch.chain(ids, view.lengths, start + ids.shape[1], need_logits=False))
        finally:
            self.cache = real

    def truncated(self, layers: int) -> "LlamaRunner":
        """An early-exit drafter: this model's first `layers` layers, then its final norm and
        lm_head. The same weight tensors (no copy), a cache of its own (call `allocate`)."""
        if not is_int(layers) or not 1 <= layers <= self.num_layers:
            raise ValueError(f"an early exit keeps 1 to {self.num_layers} layers of this model, got {layers!r}")
        view = copy.copy(self)
        for name in ("cache", "full_cache", "nonfinite_rows"):
            view.__dict__.pop(name, None)
        view.layers = self.layers[:layers]
        view.num_layers = layers
        view.layer_params = self.layer_params[:layers]
        view.num_params = self.num_params - sum(self.layer_params[layers:])
        return view

    def make_batch_invariant(self) -> None:
        """A row's logits stop depending on the other rows: fixed-size row blocks through every
        matmul, and a fixed KV split and tile height in the Triton attention (its defaults
        follow the batch and the step width); SDPA's key range is rounded up so it never takes
        its short-range path.
        Costs the padding of each matmul to a multiple of ROW_BLOCK rows (bench/forward_cost.py)."""
        self.row_block = ROW_BLOCK
        if self.device.type == "cuda":
            # Triton's KV split and tile height are fixed above; SDPA's CUDA kernels choose their own.
            self.attention_backend = "triton"

    def _linear(self, x, weight, bias=None):
        return linear(x, weight, bias, self.row_block)

    def _rmsnorm(self, x, weight):
        return add_rmsnorm_ref(x, weight, self.eps)[0]

    def _cpu_attention_op(self, batch: ForwardBatch) -> bool:
        """The extension's attention (ops.decode_attention) takes this forward on the CPU: up to
        CPU_ATTENTION_MAX_TOKENS new tokens (a chain or a tree) with the fused layer ops, and any
        width in batch-invariant mode whatever `fused` says (prefill chunks included, whose width
        can depend on other requests). It computes each token as one decoded alone after the same
        keys, so a token's logits do not depend on the forward's width or its place in a tree;
        SDPA's CPU kernel does not (bf16, AVX-512 EPYC: a 17-token forward moved a token by 0.03)."""
        if self.row_block and self.cpu_attention:  # batch-invariant: at every width, prefills included
            return True
        return bool(self.cpu_layer_ops) and batch.input_ids.shape[1] <= CPU_ATTENTION_MAX_TOKENS

    def _one_query_on_cpu(self, n: int) -> bool:
        """One new token per row on the CPU, outside batch-invariant mode, without the extension:
        attention without SDPA."""
        return n == 1 and self.device.type == "cpu" and not self.row_block

    def _attention(self, layer, q, lengths, batch: ForwardBatch, mask):
        k_all, v_all = self.cache.k[layer], self.cache.v[layer]
        if self.attention_backend == "triton":
            from csd_engine.kernels.attention import cache_attention
            splits = max(1, k_all.shape[2] // INVARIANT_SPLIT) if self.row_block else None
            block_rows = INVARIANT_BLOCK_ROWS if self.row_block else None
            return cache_attention(q, k_all, v_all, lengths, batch.tree_mask, num_splits=splits, block_rows=block_rows)
        if self._cpu_attention_op(batch):
            n, step = q.shape[1], CPU_ATTENTION_MAX_TOKENS
            if batch.tree_mask is not None or n <= step:
                return ops.decode_attention(q, k_all, v_all, lengths, batch.tree_mask)
            # a long chain (batch-invariant prefill): the op holds a call's scores whole, so it takes
            # the queries a block at a time, each block after the keys before it (the same values)
            return torch.cat([ops.decode_attention(q[:, c:c + step], k_all, v_all,
                                                   torch.where(lengths < 0, lengths, lengths + c), None)
                              for c in range(0, n, step)], dim=1)
        k = k_all[:, :, :batch.kv_bound]
        v = v_all[:, :, :batch.kv_bound]
        if self._one_query_on_cpu(q.shape[1]):
            return one_query_attention(q, k, v, mask)
        if self.row_block and self.device.type == "cpu" and q.shape[1] > 1:
            # batch-invariant without the extension's op: each token as one decoded alone (SDPA's
            # CPU kernel computes a query by how many share its call)
            return torch.cat([self._sdpa(q[:, t:t + 1], k, v, mask[:, :, t:t + 1]) for t in range(q.shape[1])], 1)
        return self._sdpa(q, k, v, mask)

    def _sdpa(self, q, k, v, mask):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(1, 2)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        cache = self.cache
        ids, positions = batch.input_ids, batch.positions
        b, n = ids.shape
        lengths = cache.lengths
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if DEBUG_CHECKS and not capturing:  # a host sync (not allowed in a CUDA graph), for tests
            assert int(lengths.max()) + n <= batch.kv_bound <= cache.capacity, "kv_bound does not cover every row"
        if self.row_block:  # SDPA takes another path for short key ranges: keep them >= KV_ROUND long
            batch = dataclasses.replace(batch, kv_bound=min(cache.capacity, -(-batch.kv_bound // KV_ROUND) * KV_ROUND))
        needs_mask = self.attention_backend == "sdpa" and not self._cpu_attention_op(batch)
        mask = attention_mask(lengths, n, batch.kv_bound, batch.tree_mask) if needs_mask else None
        h = F.embedding(ids, self.embed)
        layers = self._fused_layers if self.fused else self._layers
        h = layers(h, positions, lengths, batch, mask)
        if not batch.need_logits:
            return None
        return self._linear(h, self.lm_head).float()

    def _layers(self, h, positions, lengths, batch: ForwardBatch, mask):
        """PyTorch ops; returns the final-normed hidden states."""
        b, n = positions.shape
        slots = lengths[:, None] + torch.arange(n, device=positions.device)[None, :]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = rope_tables(positions, self.inv_freq, self.rope_scaling, self.dtype)
        for i, w in enumerate(self.layers):
            x = self._rmsnorm(h, w["attn_norm"])
            qkv = self._linear(x, w["qkv"], w["qkv_bias"])
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q = rotate(q.view(b, n, hq, d), cos, sin)
            self.cache.write(i, slots, rotate(k.view(b, n, hkv, d), cos, sin), v.view(b, n, hkv, d))
            attn = self._attention(i, q, lengths, batch, mask)
            h = h + self._linear(attn.reshape(b, n, hq * d), w["o"], w["o_bias"])
            x = self._rmsnorm(h, w["mlp_norm"])
            h = h + self._linear(silu_mul_ref(self._linear(x, w["gate_up"])), w["down"])
        return self._rmsnorm(h, self.final_norm)

    def _fused_layers(self, h, positions, lengths, batch: ForwardBatch, mask):
        """The same computation with each residual add fused into the next RMSNorm and RoPE fused
        with the cache write (C++ ops on the CPU, Triton kernels elsewhere); returns the
        final-normed hidden states."""
        b, n = positions.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        norm, rope, act = (ops.add_rmsnorm, ops.rope_and_cache, ops.silu_mul) if self.cpu_layer_ops else \
            (add_rmsnorm, rope_and_cache, silu_mul_ref)
        x, _ = norm(h, self.layers[0]["attn_norm"], self.eps)
        for i, w in enumerate(self.layers):
            qkv = self._linear(x, w["qkv"], w["qkv_bias"])
            q = rope(qkv, positions, self.inv_freq, self.rope_scaling, self.cache.k[i], self.cache.v[i],
                     lengths, hq, hkv, d)
            attn = self._attention(i, q, lengths, batch, mask)
            x, h = norm(h, w["mlp_norm"], self.eps, delta=self._linear(attn.reshape(b, n, hq * d), w["o"], w["o_bias"]))
            following = self.layers[i + 1]["attn_norm"] if i + 1 < self.num_layers else self.final_norm
            x, h = norm(h, following, self.eps, delta=self._linear(act(self._linear(x, w["gate_up"])), w["down"]))
        return x
