"""Every Triton kernel a test launches, compiled for GPUs that are not here, then interpreted.

Triton's interpreter (how the tests run kernels on the CPU) runs kernels as Python and accepts
code its compiler rejects: a `break` in a loop, a helper returning two types from two branches.
With `install()` a test process compiles each launch's specialization (its argument
dtypes and constexprs, as a GPU launch would) to a cubin for each target architecture through
Triton's own pipeline and ptxas, with no device, checks that it fits the architecture's shared
memory, and then runs the launch in the interpreter, so the test still checks its results. It
is installed before any kernel module is imported (the kernels must be JITFunctions):
tests/conftest.py does so when CSD_COMPILE_FOR is set (e.g. CSD_COMPILE_FOR=80,90), and each
compiled kernel's name, architecture and sizes are appended to the file CSD_COMPILE_LOG names.
"""
import json
import os

import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from tests import interpreter


# The tests that tests/kernels/test_compiles.py reruns with every launch compiled (paths from the
# repository root). In a run that holds that test they run there only (conftest skips them here):
# the rerun interprets and checks them as this run would.
COMPILED_TESTS = ("tests/kernels", "tests/strategies/test_kernel_path.py")
# shared memory per block (opt-in maximum): A100 (sm_80), H100 / H200 (sm_90)
MAX_SHARED = {80: 163 * 1024, 90: 227 * 1024}
# constexprs a launcher sets otherwise on the CPU than on a GPU: compiled with the GPU's value
GPU_CONSTEXPRS = {"UPCAST_DOTS": False}  # kernels.attention: fp32 dot operands only for the interpreter


class _Targets:
    """A driver for devices that are not here: device i is the architecture `arch` set last
    (JITFunction keeps its compiled kernels per device, so each architecture gets its own)."""

    def __init__(self):
        self.arch = None

    def get_current_target(self):
        return GPUTarget("cuda", self.arch, 32)

    def get_current_device(self):
        return self.arch

    def get_current_stream(self, device=None):
        return 0

    def get_device_interface(self):
        return torch.cuda


_interpreted: dict = {}
_compiled: set = set()


def _as_interpreted(fn: JITFunction) -> InterpretedFunction:
    if fn.fn not in _interpreted:
        _interpreted[fn.fn] = InterpretedFunction(fn.fn)
    return _interpreted[fn.fn]


def install(archs: list[int], log: str | None = None) -> None:
    if knobs.runtime.interpret:
        raise RuntimeError("tests/gpu_compile.py needs TRITON_INTERPRET unset: the kernels must be compilable")
    if set(archs) - set(MAX_SHARED):
        raise ValueError(f"CSD_COMPILE_FOR: architectures out of {sorted(MAX_SHARED)}, got {archs}")
    targets = _Targets()
    driver.set_active(targets)
    knobs.runtime.interpret = False  # kernels decorated from here on are JITFunctions too
    os.environ["TRITON_INTERPRET"] = "1"  # what the engine reads as "kernels run on this CPU" (csd_engine.verifier)

    def compile_for(fn: JITFunction, arch: int, args, grid, kwargs) -> None:
        targets.arch = arch
        kernel = JITFunction._compile_only(fn, *args, grid=grid, warmup=True, **kwargs)
        shared = kernel.metadata.shared
        if shared > MAX_SHARED[arch]:
            raise RuntimeError(f"{fn.fn.__name__} needs {shared} bytes of shared memory, more than sm_{arch} has")
        if log:
            with open(log, "a") as f:
                f.write(json.dumps({"kernel": fn.fn.__name__, "module": fn.fn.__module__, "arch": arch,
                                    "cubin_bytes": len(kernel.asm["cubin"]), "shared_bytes": shared,
                                    "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]}) + "\n")

    def run(self, *args, grid, warmup, **kwargs):
        on_gpu = {**kwargs, **{name: value for name, value in GPU_CONSTEXPRS.items() if name in kwargs}}
        key = _signature(self, args, on_gpu)
        if key not in _compiled:
            for arch in archs:
                compile_for(self, arch, args, grid, on_gpu)
            _compiled.add(key)
        if warmup:
            return None
        return _as_interpreted(self).run(*args, grid=grid, warmup=False, **kwargs)

    def device_call(self, *args, **kwargs):
        """A @triton.jit helper called from an interpreted kernel, run as the interpreter runs it
        (tests/interpreter.py: the language left as it was; Triton's own call leaves it patched
        for the interpreter, which breaks the next compile)."""
        return interpreter.call(_as_interpreted(self), args, kwargs)

    interpreter.install()
    JITFunction._compile_only = JITFunction.run
    JITFunction.run = run
    JITFunction.__call__ = device_call


def _signature(fn: JITFunction, args, kwargs) -> tuple:
    """What a compile depends on, less Triton's integer specializations (a value of 1, a
    multiple of 16) and pointer alignment: the argument types, the constexprs, the options."""
    parts = []
    for param, arg in zip(fn.params, args):
        if param.is_constexpr:
            parts.append(repr(arg))
        elif isinstance(arg, torch.Tensor):
            parts.append(str(arg.dtype))
        elif isinstance(arg, bool):
            parts.append("i1")
        elif isinstance(arg, int):
            parts.append("i32" if -2**31 <= arg < 2**31 else "i64")
        elif isinstance(arg, float):
            parts.append("fp32")
        else:
            parts.append(repr(arg))
    return fn.fn, tuple(parts), tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
