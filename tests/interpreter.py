"""Triton's interpreter with the language patched once per launch, not at every helper call.

The interpreter runs a kernel as Python after patching triton.language for it (its builtins
swapped for numpy-backed ones, a sweep of the modules with inspect.getmembers, about 0.8 ms),
once per launch and restored when the launch ends; but only the modules the kernel's own module
names (kernels/ name `tl`). Triton 3.6 patches again at every call of a @triton.jit helper
(InterpretedFunction.__call__), for the modules the helper's module names, and never restores
that: Triton's own tl.sum, tl.max and tl.zeros name triton.language.core too, which the launch
left unpatched, so each of their calls swept the language again. The generations on the kernel
path spent about a quarter of their time there (py-spy of tests/strategies/test_kernel_path.py).
`install()` has every launch patch both modules (as for a kernel whose module names both) and
helpers patch only what is not patched (outside a launch), restoring it after the call.
"""
from types import SimpleNamespace

import triton.language as tl
from triton.runtime import interpreter as triton_interpreter
from triton.runtime.errors import InterpreterError
from triton.runtime.interpreter import InterpretedFunction, _patch_lang

_BOTH = SimpleNamespace(__globals__={"tl": tl, "core": tl.core})  # what _patch_lang reads of a function
_languages: dict = {}  # a helper -> the triton.language modules its module names


def _unpatched(fn) -> bool:
    if fn not in _languages:
        _languages[fn] = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
    return any(tl.core.is_builtin(language.load) for language in _languages[fn])


def call(interpreted: InterpretedFunction, args, kwargs):
    """`interpreted`'s helper called with (args, kwargs), as the interpreter calls it."""
    scope = _patch_lang(interpreted.fn) if _unpatched(interpreted.fn) else None
    try:
        return interpreted.rewrite()(*args, **kwargs)
    except Exception as exc:
        raise InterpreterError(repr(exc)) from exc
    finally:
        if scope is not None:
            scope.restore()


def install() -> None:
    triton_interpreter._patch_lang = lambda fn: _patch_lang(_BOTH)  # GridExecutor's, at a launch
    InterpretedFunction.__call__ = lambda self, *args, **kwargs: call(self, args, kwargs)
