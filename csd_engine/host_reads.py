"""Finding host reads: the ops that move device values to Python (a sync on CUDA), for the
test that a decoding step has none (tests/strategies/test_host_reads.py) and the bench that
counts them (bench/host_work.py). Not used while decoding.

Under a TorchDispatchMode, `is_host_read(func, args)` names a read: `_local_scalar_dense`
(behind `.item()`, `bool(t)`, `int(t)`), ops whose output shape depends on the data
(`nonzero`, `masked_select`, `unique`, boolean-mask indexing). `.tolist()` and `.numpy()`
bypass dispatch: `reading_python_values(on_read)` patches them for its duration.
"""
import contextlib

import torch

aten = torch.ops.aten
DATA_DEPENDENT = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten._unique2, aten.unique_dim,
                  aten.unique_consecutive, aten.repeat_interleave}


def is_host_read(func, args) -> str | None:
    """What kind of host read the dispatched `func(*args)` is, or None."""
    if func.overloadpacket in DATA_DEPENDENT:
        return str(func)
    if func.overloadpacket is aten.index and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
        return "boolean-mask index"
    return None


@contextlib.contextmanager
def reading_python_values(on_read):
    """Calls `on_read(name)` for every `Tensor.tolist` / `Tensor.numpy` call inside the block."""
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def patched(name, original):
        def read(self, *a, **kw):
            on_read(name)
            return original(self, *a, **kw)
        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, patched(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
