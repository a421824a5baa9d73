"""Every Triton kernel compiles for the GPUs the engine supports (sm_80: A100; sm_90: H100 and H200,
where it is measured), here without one.

The interpreter that runs the kernels in the other tests accepts code Triton's compiler refuses
(a `break` in a loop, a helper returning two types from two branches). One subprocess reruns the kernel tests and the generations on the GPU path's kernels
with tests/gpu_compile.py installed: each launch is compiled for both, through ptxas, before it
is interpreted. The run passes only if everything they launch compiles and fits each GPU's shared
memory; and every kernel in kernels/ must have been compiled at least once. In a run that
holds this test those tests run in the subprocess only (tests/conftest.py skips them in the run
itself, naming this test): their failures are this test's, listed in its message.
"""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu_compile import COMPILED_TESTS

ROOT = Path(__file__).resolve().parents[2]
ARCHS = {80, 90}

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel tests compile them for real"),
    pytest.mark.skipif(bool(os.environ.get("CSD_COMPILE_FOR")), reason="the run this test starts (it is in tests/kernels)"),
]


def kernels_in_the_package() -> set[str]:
    """The @triton.jit functions of kernels/ named *_kernel (the launched ones; helpers are
    compiled into them)."""
    names = set()
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and \
                    any(ast.unparse(d.func if isinstance(d, ast.Call) else d) == "triton.jit"
                        for d in node.decorator_list):
                names.add(node.name)
    return names


def test_every_kernel_compiles_for_sm80_and_sm90(tmp_path):
    import triton.backends.nvidia  # noqa: F401  (Triton's CUDA backend, with its ptxas)
    log = tmp_path / "compiled.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CSD_COMPILE_FOR=",".join(map(str, sorted(ARCHS))), CSD_COMPILE_LOG=str(log))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "--maxfail=10", "-p", "no:cacheprovider",
                          "-p", "no:warnings", "-p", "no:xdist", *COMPILED_TESTS], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, f"the kernel tests compiled for {sorted(ARCHS)} failed:\n{run.stdout[-8000:]}\n" \
                                f"{run.stderr[-2000:]}"
    compiled = [json.loads(line) for line in log.read_text().splitlines()]
    assert all(c["cubin_bytes"] > 0 for c in compiled)
    for arch in ARCHS:
        missing = kernels_in_the_package() - {c["kernel"] for c in compiled if c["arch"] == arch}
        assert not missing, f"kernels never compiled for sm_{arch} (no test launched them): {sorted(missing)}"


def test_the_kernel_list_is_the_package():
    """The list the test above checks against is not empty by a parsing slip."""
    names = kernels_in_the_package()
    assert {"_commit_kernel", "_attention_split_kernel", "_emit_kernel", "_mag_kernel"} <= names  # the last: @triton.jit(...)
    assert not any(name.startswith("_dot") for name in names)
