"""CUDA graphs for the native runner's fixed-shape forwards (decode, chain and tree verification).

A forward of `b` rows x `n` new tokens replays the graph of its key (bucket, n, tree), where
the bucket is the smallest batch bucket >= b. The batch is first copied into the key's static
input buffers (device to device, no host sync); rows b..bucket-1 are padding with cache length
PADDED_LENGTH (-1), which the Triton attention kernel treats as "read nothing, output zeros".
Their keys/values are written at slots -1 (the last slot) .. n-2 of their own cache rows, which
no request of the current batch uses, so a padded row never writes into a real row. The logits
come back as a fresh tensor, as from the eager runner. A full bucket runs exactly the eager
runner's kernels; a padded one runs larger matrix products, equal up to float rounding.

Graphs are captured lazily, the first time a key is used, after a warm-up run on a side
stream, into one memory pool per runner: a runner's graphs never run at the same time, but two
runners' may (PEARL's target and drafter), so they must not share temporaries. Forwards
without a graph run eagerly through the same runner and the same Triton attention: prefill (no
logits, once per request), more than `max_tokens` new tokens per row, more rows than the
largest bucket. Off CUDA the static-buffer path runs as a plain call, which is how the CPU
tests check padding and copy-in on real values.

Why the Triton attention: the SDPA path slices the cache to `kv_bound`, a host value that
changes every step and would be frozen into a graph; `cache_attention` reads the lengths from
the device and its launch grid depends on static shapes only.
"""
import threading
from dataclasses import dataclass

import torch

from csd_engine.checks import is_int
from csd_engine.models.cache import KVCache
from csd_engine.models.llama import LlamaRunner
from csd_engine.models.runner import ForwardBatch, Runner

PADDED_LENGTH = -1  # cache_attention's mark of a padded row
# One capture at a time in the process: PEARL forwards its drafter in a worker thread while the
# target runs, and two captures must not share torch's capture stream.
_CAPTURE_LOCK = threading.Lock()


@dataclass(frozen=True)
class GraphKey:
    bucket: int  # rows the graph runs (the batch padded up to a bucket)
    n: int  # new tokens per row
    tree: bool  # a tree mask among the new tokens (else causal)


def batch_buckets(max_batch: int) -> list[int]:
    """[1, 2, 4, ...] below max_batch, then max_batch: a batch fills more than half its bucket."""
    if not is_int(max_batch) or max_batch < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    return [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch] + [max_batch]


def bucket_for(rows: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds `rows` rows; None when even the largest is too small."""
    return next((b for b in buckets if b >= rows), None)


def graph_key(batch: ForwardBatch, buckets: list[int], max_tokens: int) -> GraphKey | None:
    """The graph this forward replays, or None when it runs eagerly (module docstring)."""
    rows, n = batch.input_ids.shape
    bucket = bucket_for(rows, buckets)
    if not batch.need_logits or n > max_tokens or bucket is None:
        return None
    return GraphKey(bucket, n, batch.tree_mask is not None)


class StaticInputs:
    """What one graph reads, at fixed addresses: a batch padded to `key.bucket` rows."""

    def __init__(self, key: GraphKey, device):
        self.input_ids = torch.zeros(key.bucket, key.n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(key.bucket, key.n, dtype=torch.int64, device=device)
        self.lengths = torch.full((key.bucket,), PADDED_LENGTH, dtype=torch.int64, device=device)
        self.tree_mask = torch.zeros(key.bucket, key.n, key.n, dtype=torch.bool, device=device) if key.tree else None

    @property
    def bucket(self) -> int:
        return self.lengths.shape[0]

    def load(self, batch: ForwardBatch, lengths: torch.Tensor) -> None:
        """Copy in a batch and its rows' cache lengths. Padded rows keep the ids and positions
        they last held (valid values, outputs dropped); only their length must be reset."""
        rows = lengths.shape[0]
        self.input_ids[:rows].copy_(batch.input_ids)
        self.positions[:rows].copy_(batch.positions)
        self.lengths[:rows].copy_(lengths)
        self.lengths[rows:].fill_(PADDED_LENGTH)
        if self.tree_mask is not None:
            self.tree_mask[:rows].copy_(batch.tree_mask)

    def forward_batch(self, capacity: int) -> ForwardBatch:
        # cache_attention ignores kv_bound; the full capacity keeps CSD_DEBUG's bound check true.
        return ForwardBatch(self.input_ids, self.positions, capacity, self.tree_mask)



def _wrapped(name: str) -> property:
    return property(lambda self: getattr(self.runner, name), lambda self, value: setattr(self.runner, name, value))


class GraphedRunner(Runner):
    """A LlamaRunner whose fixed-shape forwards replay CUDA graphs: same interface (call,
    cache, allocate, use_rows), same results. It switches the runner to the Triton attention,
    and owns the runner's cache: allocate through the wrapper (graphs hold the cache's addresses).

    max_tokens: the largest n (new tokens per row) that gets a graph.
    max_batch:  the largest bucket (default: the batch the cache was allocated for).
    """

    def __init__(self, runner: LlamaRunner, max_tokens: int = 32, max_batch: int | None = None):
        if not isinstance(runner, LlamaRunner):
            raise TypeError(f"GraphedRunner wraps the native LlamaRunner, got {type(runner).__name__}")
        if not is_int(max_tokens) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if max_batch is not None:
            batch_buckets(max_batch)  # validates it
        runner.attention_backend = "triton"
        self.runner = runner
        # the outermost runner pads (Runner.vocab_pad): its non-finite check reads the model's own rows
        self.vocab_pad, runner.vocab_pad = runner.vocab_pad, 0
        self.max_tokens = max_tokens
        self.max_batch = max_batch
        self.use_graphs = self.device.type == "cuda"
        self.pool = None
        self._forget_graphs()

    # What describes the model (vocabulary, end tokens, length limits...) is the wrapped runner's,
    # read through, so that a field set on either after wrapping is the one the engine sees.
    vocab_size = _wrapped("vocab_size")
    num_params = _wrapped("num_params")
    device = _wrapped("device")
    weight_bytes = _wrapped("weight_bytes")
    eos_token_ids = _wrapped("eos_token_ids")
    attention_window = _wrapped("attention_window")
    cache_owner = _wrapped("cache_owner")
    busy = _wrapped("busy")
    position_limit = _wrapped("position_limit")
    trained_positions = _wrapped("trained_positions")
    tree_limit = _wrapped("tree_limit")

    @property
    def cache(self) -> KVCache:
        return self.runner.cache

    def allocate(self, batch: int, capacity: int) -> None:
        self.runner.allocate(batch, capacity)
        self._forget_graphs()

    def use_rows(self, batch: int) -> None:
        self.runner.use_rows(batch)

    def prefill(self, rows: slice, ids: torch.Tensor, start: int = 0) -> None:
        self.runner.prefill(rows, ids, start)  # eager: a graph runs over the leading rows only

    def _forget_graphs(self) -> None:
        """Graphs hold the addresses of the cache they were captured on: a new cache (a second
        Engine over this runner) drops them and their memory pool, and later forwards capture
        anew into a fresh pool (capturing into the old one, whose blocks the dropped graphs
        still held, failed an allocator assert on an H100)."""
        for graph, _ in getattr(self, "graphs", {}).values():
            graph.reset()
        if self.use_graphs:
            self.pool = torch.cuda.graph_pool_handle()
        self.inputs: dict[GraphKey, StaticInputs] = {}
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        full = getattr(self.runner, "full_cache", None)
        self.buckets = [] if full is None else batch_buckets(min(full.batch, self.max_batch or full.batch))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        key = graph_key(batch, self.buckets, self.max_tokens)
        if key is None:
            return self.runner(batch)
        lengths = self.runner.cache.lengths
        rows = lengths.shape[0]
        if batch.input_ids.shape[0] != rows:
            raise ValueError(f"the batch has {batch.input_ids.shape[0]} rows, the cache {rows} (see use_rows)")
        if key not in self.inputs:
            self.inputs[key] = StaticInputs(key, self.device)
        inputs = self.inputs[key]
        inputs.load(batch, lengths)
        if not self.use_graphs:
            return self._forward_static(inputs)[:rows]
        if key not in self.graphs:
            self.graphs[key] = self._capture(inputs)
        graph, logits = self.graphs[key]
        graph.replay()
        return logits[:rows].clone()  # the next replay overwrites the graph's output

    def _forward_static(self, inputs: StaticInputs) -> torch.Tensor:
        """The runner's forward on the static buffers, over the first `bucket` cache rows."""
        full = self.runner.full_cache
        padded = KVCache(full.k[:, :inputs.bucket], full.v[:, :inputs.bucket], inputs.lengths)
        real, self.runner.cache = self.runner.cache, padded
        try:
            return self.runner(inputs.forward_batch(full.capacity))
        finally:
            self.runner.cache = real

    def _capture(self, inputs: StaticInputs) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream (Triton compiles, cuBLAS picks kernels) as PyTorch's CUDA
        # graph notes ask. The run writes the same cache entries the replay writes again.
        with _CAPTURE_LOCK:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward_static(inputs)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's ordinary CUDA work (PEARL) must not void the capture.
            # On the side stream: torch's default capture stream is one per process, made on
            # whichever device was current first (a drafter on another GPU would capture nothing).
            with torch.cuda.graph(graph, pool=self.pool, stream=side, capture_error_mode="thread_local"):
                logits = self._forward_static(inputs)
        return graph, logits


def maybe_graphed(runner, enabled: bool | str):
    """What the engine should run: a GraphedRunner when graphed forwards are asked for and
    possible (a native runner on CUDA), else the runner itself (generic runner, CPU, MaG, or
    disabled). With "step" (whole steps graphed, csd_engine.step_graphs) a native CUDA runner
    switches to the Triton attention, whose launch does not depend on the host's kv_bound."""
    if not (isinstance(enabled, bool) or enabled == "step"):
        raise TypeError(f"cuda_graphs must be False, True (graphed forwards) or 'step' (one graph per "
                        f"decoding step), got {enabled!r}")
    if enabled and isinstance(runner, LlamaRunner) and runner.device.type == "cuda":
        if enabled == "step":
            runner.attention_backend = "triton"
            return runner
        return GraphedRunner(runner)
    return runner
