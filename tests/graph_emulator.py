"""CUDA-graph semantics on the CPU, for testing what csd_engine.step_graphs captures.

A capture records every ATen op the captured function dispatches, with the very tensors it
read and wrote; a replay runs those ops again on those tensors and writes each result into
the tensor the capture produced, as a graph's kernels write to fixed addresses. Python does
not run on a replay: a step that rebinds a tensor, keeps state in a Python value, or reads
anything the host decided after the capture gives other results on a replay than eagerly,
which is what the tests compare. Only ATen ops are recorded, so everything captured must run
PyTorch code (the references, not interpreted Triton kernels).
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _writes(func) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def _is_view(func, args, kwargs, out) -> bool:
    """The op returned views of its inputs (ops like `to` or `reshape` may alias or copy)."""
    if not any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
        return False
    storages = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    return all(t.untyped_storage().data_ptr() in storages for t in tree_leaves(out) if isinstance(t, torch.Tensor))


class _Recording(TorchDispatchMode):
    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("a host read inside a captured step")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out, _is_view(func, args, kwargs, out)))
        return out


class EmulatedGraph:
    def __init__(self, capture: "EmulatedCapture"):
        self.capture = capture
        self.ops = []
        self.captured_run = True  # the capture ran the work eagerly: its first replay is that run

    def replay(self) -> None:
        if self.captured_run:
            self.captured_run = False
            return
        self.capture.replays += 1
        with torch.inference_mode():
            for func, args, kwargs, out, view in self.ops:
                if view:
                    continue  # the recorded view still aliases its (replayed) base
                result = func(*args, **kwargs)
                # what it wrote into its recorded arguments is written again; fresh results
                # (every return of an op that writes nothing, the rest of one that does, such
                # as csd_engine::rope_and_cache's q) go where the capture's results went
                fresh_returns = [r.alias_info is None for r in func._schema.returns] if _writes(func) else None
                outs, results = (out, result) if isinstance(out, (tuple, list)) else ((out,), (result,))
                for i, (recorded, fresh) in enumerate(zip(outs, results)):
                    if fresh_returns is not None and not fresh_returns[i]:
                        continue
                    for r, f in zip(tree_leaves(recorded), tree_leaves(fresh)):
                        if isinstance(r, torch.Tensor):
                            r.copy_(f)


class EmulatedCapture:
    """Stands in for step_graphs.CudaCapture on the CPU."""

    def __init__(self):
        self.warm_ups = 0
        self.captures = 0
        self.replays = 0  # replays that ran the recorded ops (not the capture's own run)

    def warm_up(self, fn):
        self.warm_ups += 1
        return fn()

    def capture(self, fn):
        graph = EmulatedGraph(self)
        with _Recording(graph.ops):
            out = fn()
        self.captures += 1
        return graph, out
