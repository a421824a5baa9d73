"""One CUDA graph per decoding step (`Engine(cuda_graphs="step")`): the whole step (drafter
forwards, MaG, reviews, verification, commit, and the next step's plan: Decoder.step_and_plan)
replays as one graph instead of hundreds of launches from Python.

A step is a fixed sequence of device work given host-known values only (strategies/base.py):
the decoder's configuration, the column maxima of the plan it reads (the widths and rounds
of its drafts; a decoder may coarsen them, `graph_columns`), the state's sampling hints and `max_committed`, which only ever bounds work
(attention spans, MaG's search). A graph is keyed by those values with max_committed rounded
up to a multiple of COMMITTED_BUCKET: a larger bound leaves every result unchanged, and the
keys stay few. The first step of a key runs eagerly on the capture stream (warm-up: Triton
compiles, cuBLAS picks its kernels), the second is captured and replayed, later ones replay.

The state, caches and metrics are updated in place (their addresses are what a graph holds);
a step's StepOutput and plan are the graph's static outputs, valid until the next step. Host counters
(forwards per model) are what the captured step counted, added per replay. Graphs of one
scheduler share a memory pool: they never run at the same time. A key whose capture fails
(an op CUDA cannot capture) runs eagerly from then on, with a warning: slower, same tokens.
"""
import logging

import torch

log = logging.getLogger("csd_engine")

COMMITTED_BUCKET = 256  # max_committed is rounded up to a multiple of this in a graph's key


class CudaCapture:
    """Captures a callable into a CUDA graph on one side stream and one memory pool."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.device = device

    def warm_up(self, fn):
        """Run `fn` eagerly on the capture stream (the run the capture follows)."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            out = fn()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return out

    def capture(self, fn):
        """(graph, fn's outputs): records fn's device work without running it."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            out = fn()
        return graph, out


class StepGraphs:
    """`step_and_plan(state, plan)` with the decoder's replayed from one graph per key (module
    docstring). drafters: how many the engine has (host counters per drafter);
    max_committed_limit: the largest max_committed a step can see (the rounded
    value never exceeds it, so every bound stays within the caches)."""

    def __init__(self, decoder, drafters: int, max_committed_limit: int, capture):
        self.decoder, self.drafters = decoder, drafters
        self.limit = max_committed_limit
        self.capture = capture
        self.warm: set = set()
        self.graphs: dict = {}
        self.eager: set = set()  # keys whose capture failed

    def key(self, state, plan) -> tuple:
        columns = None if plan is None else tuple(max(column) for column in zip(*plan))
        if columns is not None:
            columns = self.decoder.graph_columns(columns)
        bound = min(-(-max(state.max_committed, 1) // COMMITTED_BUCKET) * COMMITTED_BUCKET,
                    max(self.limit, state.max_committed))
        return columns, bound, state.all_greedy, state.any_filtered, state.max_top_k, state.want_logprobs

    def step_and_plan(self, state, plan):
        key = self.key(state, plan)
        columns, bound = key[0], key[1]
        plan = None if columns is None else [list(columns)]  # the step reads only the column maxima
        exact, state.max_committed = state.max_committed, bound
        try:
            if key in self.eager:
                return self.decoder.step_and_plan(state, plan)
            if key not in self.warm:
                self.warm.add(key)
                return self.capture.warm_up(lambda: self.decoder.step_and_plan(state, plan))
            metrics, n = state.metrics, self.drafters
            if key not in self.graphs:
                before = _host_counts(metrics, n)
                try:
                    graph, out = self.capture.capture(lambda: self.decoder.step_and_plan(state, plan))
                except Exception as exc:  # noqa: BLE001  a capture runs nothing: the step can still run eagerly
                    _set_host_counts(metrics, before)
                    self.eager.add(key)
                    log.warning("cuda_graphs='step': capturing a step of %s failed (%s: %s); steps of this "
                                "shape run eagerly", type(self.decoder).__name__, type(exc).__name__, exc)
                    return self.decoder.step_and_plan(state, plan)
                self.graphs[key] = graph, out, [a - b for a, b in zip(_host_counts(metrics, n), before)]
                _set_host_counts(metrics, before)  # counted below, as for every replay
            graph, out, counted = self.graphs[key]
            graph.replay()
            _set_host_counts(metrics, [a + b for a, b in zip(_host_counts(metrics, n), counted)])
            return out
        finally:
            state.max_committed = exact


def _host_counts(metrics, drafters: int) -> list[int]:
    return [metrics.target_forwards] + metrics.drafter_counts(drafters)


def _set_host_counts(metrics, counts: list[int]) -> None:
    metrics.target_forwards = counts[0]
    metrics.drafter_forwards = list(counts[1:])
