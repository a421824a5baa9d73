"""Ops of the compiled extension `csd_engine._C`, each with a PyTorch reference it falls back to.

build_tree_mask(parents) -> (mask, depth, paths): tree attention metadata (docs/algorithms.md, Token trees).
dense_linear(x, weight, bias) -> F.linear, through the extension's bf16 kernel on x86 CPUs with
AVX2 (csrc/bf16_linear.cpp; bf16_kernel_pays, bf16_kernel_max_rows); int8_linear(x, q, scale, bias) -> the same for an
int8 weight with a scale per output row, where int8_kernel_runs (elsewhere the caller uses torch's op);
int4_linear(x, packed, scales_zeros, group, bias) -> the same for a grouped int4 weight on x86 CPUs
with AVX2 (csrc/int4_linear.cpp; AVX-512 BF16 tiles where the CPU has them), where int4_kernel_runs.
add_rmsnorm, rope_and_cache, decode_attention, silu_mul: the native runner's work between its
matmuls on the CPU (csrc/decode_cpu.cpp), where cpu_layer_ops_run(); their references are
kernels/rmsnorm.py's, kernels/rope.py's, attention under kernels/mask.py's attention_mask (chain or
tree) and F.silu(gate) * up.

The extension is optional: without it (or without a kernel for the input's device) every op runs
its reference, after one warning.
"""
import functools
import importlib.util
import os
import sys
import warnings

import torch
import torch.nn.functional as F

import csd_engine
from csd_engine import kernels
from csd_engine.kernels.tree_verify import PADDING

try:
    from csd_engine import _C  # noqa: F401  (loading it registers torch.ops.csd_engine.*)
    HAS_EXTENSION = True
    _MISSING_REASON = ""
except ImportError as error:
    HAS_EXTENSION = False
    _MISSING_REASON = "csd_engine._C did not import: " + (
        f"{error}" if importlib.util.find_spec("csd_engine._C") is not None else
        "it is not built (a CSD_NO_EXTENSION=1 install, or a source checkout: python setup.py build_ext --inplace, "
        "or pip install --no-build-isolation -e .)")

ROOT = -1     # parent of a child of the committed prefix

_TREE_RULE = "parent must be -1 (root), -2 (padding) or an index smaller than the node"
_PADDING_RULE = "padded nodes (parent -2) must come after all real nodes of the row"


def _devices_with_kernel(op_name: str) -> frozenset[str]:
    if not HAS_EXTENSION:
        return frozenset()
    try:
        return frozenset(device for device in ("cpu", "cuda")
                         if torch._C._dispatch_has_kernel_for_dispatch_key(op_name, device.upper()))
    except RuntimeError:  # an extension built from older sources: the op falls back
        return frozenset()


_TREE_MASK_DEVICES = _devices_with_kernel("csd_engine::build_tree_mask")
_BF16_LINEAR_DEVICES = _devices_with_kernel("csd_engine::bf16_linear")
_INT8_LINEAR_DEVICES = _devices_with_kernel("csd_engine::int8_linear")
_INT4_LINEAR_DEVICES = _devices_with_kernel("csd_engine::int4_linear")


def _has_argument(op_name: str, argument: str) -> bool:
    """Whether the registered op's schema names `argument` (an extension built from older
    sources registers older schemas)."""
    namespace, name = op_name.split("::")
    try:
        schema = getattr(getattr(torch.ops, namespace), name).default._schema
    except (AttributeError, RuntimeError):
        return False
    return any(a.name == argument for a in schema.arguments)


_CPU_LAYER_OPS = ("add_rmsnorm", "rope_and_cache", "decode_attention", "silu_mul")
_HAS_CPU_LAYER_OPS = all("cpu" in _devices_with_kernel(f"csd_engine::{name}") for name in _CPU_LAYER_OPS)
if _HAS_CPU_LAYER_OPS and not _has_argument("csd_engine::decode_attention", "tree_mask"):
    warnings.warn("csd_engine._C was built from older sources (its decode_attention takes no tree_mask): its CPU "
                  "layer ops stay off until it is rebuilt (python setup.py build_ext --inplace)", RuntimeWarning)
    _HAS_CPU_LAYER_OPS = False


@functools.cache
def _warn_fallback(reason: str) -> None:
    warnings.warn(f"{reason}; using the slower PyTorch reference", RuntimeWarning, stacklevel=caller_stacklevel())


def caller_stacklevel() -> int:
    """warnings.warn's stacklevel for the first frame outside csd_engine (its kernels included) and
    torch (whose decorators wrap the engine's methods): the caller's line the warning is about."""
    inside = tuple(os.path.dirname(os.path.abspath(module.__file__)) + os.sep for module in (csd_engine, kernels, torch))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


@functools.cache
def warn_without_extension() -> None:
    """Once, when an engine is built on the CPU without csd_engine._C: its matmuls and layer ops
    run as PyTorch ops, slower, and (in bfloat16) wide forwards no longer compute each token as
    a one-token forward does, so greedy speculation equals plain decoding only with
    batch_invariant=True."""
    if not HAS_EXTENSION:
        warnings.warn(f"{_MISSING_REASON}; the CPU engine runs PyTorch's ops instead of its kernels: slower, and in "
                      "bfloat16 greedy speculation equals plain decoding only with Engine(batch_invariant=True)",
                      RuntimeWarning, stacklevel=caller_stacklevel())


def _check_parents_layout(parents: torch.Tensor) -> None:
    if not isinstance(parents, torch.Tensor):
        raise TypeError(f"build_tree_mask: parents must be a torch.Tensor, got {type(parents).__name__}")
    if parents.dim() != 2:
        raise ValueError(
            f"build_tree_mask: parents must be a 2-D [batch, nodes] tensor, got {parents.dim()} dimensions")
    if parents.dtype != torch.int64:
        raise TypeError(f"build_tree_mask: parents must be int64, got {parents.dtype}")


def _check_tree(parents: torch.Tensor) -> None:
    """Raises ValueError for the first offending node in row-major order (the C++ op names the same one).
    parent < node also rules out cycles: walking up strictly decreases the index."""
    _check_parents_layout(parents)
    index = torch.arange(parents.shape[1], device=parents.device)
    padded = parents == PADDING
    out_of_range = (parents < PADDING) | (parents >= index)
    after_padding = ~padded & (padded.cumsum(1) > 0)
    offending = (out_of_range | after_padding).nonzero()
    if len(offending) == 0:
        return
    row, node = offending[0].tolist()
    parent = int(parents[row, node])
    where = f"build_tree_mask: row {row}, node {node} has parent {parent}"
    if out_of_range[row, node]:
        raise ValueError(f"{where}; {_TREE_RULE}")
    raise ValueError(f"{where} but follows a padded node; {_PADDING_RULE}")


def build_tree_mask_ref(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of build_tree_mask (same outputs; tree errors are ValueError).
    Vectorised over the batch: one step per tree level walks every node one ancestor up."""
    _check_tree(parents)
    batch, nodes = parents.shape
    parent_or_none = parents.clamp(min=ROOT)  # a padded node's chain also ends at itself
    ancestor = torch.arange(nodes, device=parents.device).expand(batch, nodes)
    chain = [ancestor]  # chain[k][b, i]: the k-th ancestor of node i (0th = i itself), or -1
    while True:
        ancestor = torch.where(ancestor >= 0, parent_or_none.gather(1, ancestor.clamp(min=0)), ROOT)
        if not (ancestor >= 0).any():
            break
        chain.append(ancestor)
    ancestors = torch.stack(chain, dim=2)  # [batch, nodes, max depth + 1]
    depth = (ancestors >= 0).sum(dim=2) - 1

    # Column `nodes` catches the scatter of missing ancestors and is dropped.
    mask = torch.zeros(batch, nodes, nodes + 1, dtype=torch.bool, device=parents.device)
    mask.scatter_(2, torch.where(ancestors >= 0, ancestors, nodes), True)
    mask = mask[:, :, :nodes]

    # paths[b, i, d] is the ancestor (depth - d) levels above i: the root at d = 0, i at d = depth.
    level = depth.unsqueeze(2) - torch.arange(ancestors.shape[2], device=parents.device)
    on_path = (level >= 0) & (parents != PADDING).unsqueeze(2)
    paths = torch.full((batch, nodes, nodes), -1, dtype=torch.int64, device=parents.device)
    paths[:, :, :ancestors.shape[2]] = torch.where(on_path, ancestors.gather(2, level.clamp(min=0)), -1)
    return mask, depth, paths


def build_tree_mask(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tree attention metadata from a parent array.

    parents: [B, N] int64. parents[b, i] is the index of node i's parent in row b (smaller than i),
        -1 for a root (a child of the committed prefix) or -2 for padding, which must follow all
        real nodes of its row.
    Returns
        mask:  [B, N, N] bool, mask[b, i, j] is True iff j is i or an ancestor of i (a padded node
               sees only itself);
        depth: [B, N] int64, the number of ancestors (roots and padding: 0), so positions are
               prefix_len + depth;
        paths: [B, N, N] int64, paths[b, i, :depth+1] the nodes from the root down to i, then -1
               (all -1 for padding).
    Raises ValueError for a parent array that is not such a forest, TypeError for a non-int64 input.
    On CUDA the op synchronises once, to read the kernel's invalid-tree flag.
    """
    _check_parents_layout(parents)
    if parents.device.type in _TREE_MASK_DEVICES:
        return torch.ops.csd_engine.build_tree_mask(parents)
    _warn_fallback(_MISSING_REASON or f"csd_engine._C has no build_tree_mask kernel for {parents.device.type}")
    return build_tree_mask_ref(parents)


if HAS_EXTENSION:
    @torch.library.register_fake("csd_engine::build_tree_mask")
    def _build_tree_mask_fake(parents):
        _check_parents_layout(parents)
        batch, nodes = parents.shape
        return (parents.new_empty(batch, nodes, nodes, dtype=torch.bool),
                parents.new_empty(batch, nodes),
                parents.new_empty(batch, nodes, nodes))


@functools.cache
def bf16_kernel_pays() -> bool:
    """Whether dense_linear takes the extension's bf16 kernel on the CPU: on x86 CPUs with AVX2.
    Without native bf16 arithmetic torch's bf16 matmul reads the weight once per row of x (a
    5-row call cost 4.8x a 1-row call on a 2-core AVX2 EPYC; the kernel: 1.7x); with avx512_bf16
    its oneDNN path streams the weights at ~30 GB/s where the kernel's AVX-512 tiles reached
    35-56 for 1 to 5 rows (2-core AVX-512 EPYC, 1.5B MLP weights); with AMX (a 2-core Sapphire
    Rapids Xeon) a Qwen 1.5B one-token forward took 126 ms on the kernel against torch's 237, and
    the kernel's AMX tiles (bf16_kernel_on_amx) keep its 9-token forward at 1.28x that
    (docs/measurements.md). CSD_BF16_LINEAR=1 / 0 forces it on / off."""
    forced = os.environ.get("CSD_BF16_LINEAR")
    if forced not in (None, "", "0", "1"):
        raise ValueError(f"CSD_BF16_LINEAR must be 1 (use csd_engine's bf16 CPU kernel) or 0 (torch's), got {forced!r}")
    if "cpu" not in _BF16_LINEAR_DEVICES:
        return False
    if forced:
        return forced == "1"
    return torch.cpu._is_avx2_supported()


@functools.cache
def cpu_kernel_isa() -> str | None:
    """The instruction set csd_engine's CPU kernels run (csrc/cpu_isa.h: "baseline", "avx2",
    "avx512", "avx512_bf16" or "amx", the best this CPU and Linux allow unless CSD_CPU_ISA names a
    lower one); None without the extension's bf16 kernel."""
    if "cpu" not in _BF16_LINEAR_DEVICES or not hasattr(torch.ops.csd_engine, "cpu_isa"):
        return None
    return torch.ops.csd_engine.cpu_isa()


def bf16_kernel_on_amx() -> bool:
    """dense_linear's bf16 kernel runs AMX's bf16 tiles (for weights whose K is a multiple of 32,
    every Qwen and Llama matrix): a call of up to 16 rows costs about what a one-row call does, so
    a wide forward costs little more than a one-token one (budget.AMX_TILE_WIDTH_COSTS)."""
    return bf16_kernel_pays() and cpu_kernel_isa() == "amx"


def kernel_without_native_bf16() -> bool:
    """The kernel runs on a CPU without native bf16 arithmetic (AVX2, no avx512_bf16): where the
    settings tuned on such a machine apply (the width curve, int8 drafters on the kernel, dense
    copies from 2 rows), as opposed to a machine whose own bf16 matmul was only slower."""
    return bf16_kernel_pays() and not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias). bf16 on the CPU where bf16_kernel_pays(): csd_engine's kernel,
    fp32 accumulation like torch's, whose every output row is computed the same way whatever
    the number of rows in the call (a token's logits do not depend on the draft's width);
    elsewhere on the CPU a bf16 call of one row is made a call of two."""
    if bf16_kernel_takes(x, weight, bias):
        return torch.ops.csd_engine.bf16_linear(x, weight, bias)
    if x.numel() == x.shape[-1] and x.dtype == torch.bfloat16 and x.device.type == "cpu":
        # One row (a decoding step at batch 1): torch's bf16 matmul takes a slower path for one
        # row than for two, so the row goes with a zero row. On a 2-core AVX-512 EPYC a Qwen 1.5B
        # one-token forward took 0.85-1.02x the time (median 0.965, twelve interleaved pairs; the
        # gain is largest when the machine's memory is busy).
        rows = torch.cat([x.reshape(1, -1), x.new_zeros(1, x.shape[-1])])
        return F.linear(rows, weight, bias)[:1].view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


# Rows above which a CPU with native bf16 keeps torch's matmul: the kernel's fp32 FMAs become
# compute-bound with the rows while oneDNN's bf16 products do not (2-core AVX-512 EPYC: the Qwen
# 1.5B's 17-token forward 2.68x its one-token one on the kernel; with the kernel at every width,
# summarization and RAG prompts, whose prefills are hundreds of rows, generated 0.75x and 0.80x as
# fast in an interleaved check; docs/measurements.md). 17: a batch-1 step's widest forward (the pending token and
# a 16-token direct draft) stays on the kernel, whose rows do not depend on the call's, so greedy
# speculative decoding at batch 1 emits plain decoding's tokens exactly (its 17-row forward 173 ms
# against torch's 159; 24 rows 238 against 186, 33 rows 319 against 218; ad hoc, in-process, interleaved).
# With AMX (2-core Sapphire Rapids Xeon) the kernel runs AMX's tiles, whose cost per call is flat to 16
# rows (the 1.5B's 9-token forward 151 ms against 118 for one token; its FMA tiles took 198 on that
# machine, docs/measurements.md); the same bound keeps a batch-1 step exact.
NATIVE_BF16_KERNEL_MAX_ROWS = 17


def bf16_kernel_max_rows() -> int | None:
    """The most rows of x a call sends to the kernel: None (any) on CPUs without native bf16."""
    return None if kernel_without_native_bf16() else NATIVE_BF16_KERNEL_MAX_ROWS


def bf16_kernel_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether dense_linear(x, weight, bias) runs csd_engine's kernel (its rows computed alike
    whatever their number; where bf16_kernel_max_rows() bounds them, a wider call takes torch's)."""
    if not (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and (bias is None or bias.dtype == torch.bfloat16) and bf16_kernel_pays()):
        return False
    limit = bf16_kernel_max_rows()
    return limit is None or x.numel() // max(x.shape[-1], 1) <= limit


def int8_kernel_runs(device, dtype: torch.dtype) -> bool:
    """Whether int8 weights for `dtype` activations on `device` take csd_engine's int8 kernel: bf16
    on a CPU where the bf16 kernel runs (same tiles, half the weight bytes). torch's
    _weight_int8pack_mm grows with the rows: without native bf16 it cost about the bf16 kernel's
    time for one row; with AVX-512 BF16 the int8 Qwen 0.5B's forward of 1 / 5 tokens took 28 / 37 ms
    on the kernel against 39 / 107 on torch's op (2-core EPYC, docs/measurements.md). Its rows are
    batch-invariant too."""
    return (dtype == torch.bfloat16 and torch.device(device).type == "cpu" and "cpu" in _INT8_LINEAR_DEVICES
            and bf16_kernel_pays())


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x q^T * scale (+ bias) for bf16 x, int8 q [N, K] and scale [N] on csd_engine's CPU kernel
    (where int8_kernel_runs; elsewhere torch's _weight_int8pack_mm is the op)."""
    return torch.ops.csd_engine.int8_linear(x, q, scale, bias)


def int4_kernel_runs(device, dtype: torch.dtype) -> bool:
    """Whether int4 weights for `dtype` activations on `device` take csd_engine's int4 kernel:
    bf16 on an x86 CPU with AVX2 and FMA (and CSD_CPU_ISA not baseline; the extension decides).
    Against torch's _weight_int4pack_mm_for_cpu, the int4 Qwen 0.5B's forward of 1 / 5 / 9 tokens:
    9 / 20 / 35 ms instead of 11 / 28 / 43 on a 2-core AVX-512 EPYC with AVX-512 BF16; one token
    23 ms instead of 38 on a 2-core AVX2 EPYC (docs/measurements.md). Its rows are batch-invariant.
    CSD_INT4_LINEAR=0 keeps torch's op."""
    forced = os.environ.get("CSD_INT4_LINEAR")
    if forced not in (None, "", "0", "1"):
        raise ValueError(f"CSD_INT4_LINEAR must be 1 (use csd_engine's int4 CPU kernel where the CPU runs it) "
                         f"or 0 (torch's op), got {forced!r}")
    return (forced != "0" and dtype == torch.bfloat16 and torch.device(device).type == "cpu"
            and "cpu" in _INT4_LINEAR_DEVICES and torch.ops.csd_engine.int4_linear_runs())


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) for bf16 x and W[n, k] = (q - 8) s + z per output row and group of `group`
    inputs, packed by models/quant.py's pack_int4_for_kernel (where int4_kernel_runs)."""
    return torch.ops.csd_engine.int4_linear(x, packed, scales_zeros, group, bias)


if "cpu" in _INT4_LINEAR_DEVICES:
    @torch.library.register_fake("csd_engine::int4_linear")
    def _int4_linear_fake(x, packed, scales_zeros, group, bias=None):
        return x.new_empty(*x.shape[:-1], packed.shape[0])


if "cpu" in _INT8_LINEAR_DEVICES:
    @torch.library.register_fake("csd_engine::int8_linear")
    def _int8_linear_fake(x, weight, scale, bias=None):
        return x.new_empty(*x.shape[:-1], weight.shape[0])


if "cpu" in _BF16_LINEAR_DEVICES:
    @torch.library.register_fake("csd_engine::bf16_linear")
    def _bf16_linear_fake(x, weight, bias=None):
        return x.new_empty(*x.shape[:-1], weight.shape[0])


def cpu_layer_ops_run() -> bool:
    """Whether the extension has the CPU layer ops below (the native runner's CPU default)."""
    return _HAS_CPU_LAYER_OPS


def add_rmsnorm(h: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None):
    """kernels/rmsnorm.py's add_rmsnorm on the CPU: (weight * norm(h + delta), h + delta), h itself
    as the second output without delta. One op instead of about nine."""
    out, summed = torch.ops.csd_engine.add_rmsnorm(h, weight, eps, delta)
    return out, h if delta is None else summed


def rope_and_cache(qkv, positions, inv_freq, scaling: float, k_cache, v_cache, lengths,
                   q_heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """kernels/rope.py's rope_and_cache on the CPU (any even head_dim): writes the rotated k and
    v at slots lengths[b] + j and returns the rotated q [B, n, Hq, D]."""
    return torch.ops.csd_engine.rope_and_cache(qkv, positions, inv_freq, scaling, k_cache, v_cache, lengths,
                                               q_heads, kv_heads, head_dim)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of n new tokens per row, q [B, n, Hq, D], written at cache slots lengths[b]..:
    token t of row b sees slots 0..lengths[b] - 1 (its committed prefix) and the new tokens
    0..t, or those its row of tree_mask [B, n, n] bool marks (a tree node: its ancestors and
    itself), of k_cache / v_cache [B, Hkv, S, D], in fp32; returns q's shape and dtype (zeros for
    a padded row, length -1). No mask over the cache to build. Each token is computed exactly as a
    lone token whose keys sit at consecutive slots, so its output depends on neither n nor, for
    a tree node, where its ancestors sit."""
    return torch.ops.csd_engine.decode_attention(q, k_cache, v_cache, lengths, tree_mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for gate_up = [gate | up] along the last dimension, with its roundings."""
    return torch.ops.csd_engine.silu_mul(gate_up)


if _HAS_CPU_LAYER_OPS:
    @torch.library.register_fake("csd_engine::add_rmsnorm")
    def _add_rmsnorm_fake(h, weight, eps, delta=None):
        return h.new_empty(h.shape), h.new_empty(h.shape if delta is not None else (0,))  # contiguous, as the op

    @torch.library.register_fake("csd_engine::rope_and_cache")
    def _rope_and_cache_fake(qkv, positions, inv_freq, scaling, k_cache, v_cache, lengths, q_heads, kv_heads,
                             head_dim):
        return qkv.new_empty(qkv.shape[0], qkv.shape[1], q_heads, head_dim)

    @torch.library.register_fake("csd_engine::decode_attention")
    def _decode_attention_fake(q, k_cache, v_cache, lengths, tree_mask=None):
        return q.new_empty(q.shape)  # contiguous, as the op returns it

    @torch.library.register_fake("csd_engine::silu_mul")
    def _silu_mul_fake(gate_up):
        return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
