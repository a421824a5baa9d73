"""csd_engine's CPU kernels are compiled once per instruction set and pick the best this CPU
runs (csrc/cpu_isa.h); CSD_CPU_ISA forces a lower one. This reruns their tests with each
variant this machine can run, so that one machine checks what other CPUs execute."""
import os
import subprocess
import sys

import pytest

from csd_engine import ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_TESTS = ("tests/test_bf16_linear.py", "tests/test_int4_linear.py", "tests/test_decode_ops.py")


def runnable_isas() -> list[str]:
    flags = set(open("/proc/cpuinfo").read().split()) if os.path.exists("/proc/cpuinfo") else set()
    isas = ["baseline"]
    if {"avx2", "fma"} <= flags:
        isas.append("avx2")
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
            isas.append("avx512")
            if "avx512_bf16" in flags:
                isas.append("avx512_bf16")
                # AMX also needs Linux to grant the process the tile state: the extension says whether it did
                if {"amx_tile", "amx_bf16"} <= flags and ops.cpu_kernel_isa() == "amx":
                    isas.append("amx")
    return isas


@pytest.mark.skipif(not ops.HAS_EXTENSION, reason="csd_engine._C did not import")
@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512", "avx512_bf16", "amx"])
def test_kernels_pass_their_tests_with_every_instruction_set(isa):
    if isa not in runnable_isas():
        pytest.skip(f"this CPU does not run {isa}")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, "CSD_CPU_ISA": isa}, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_an_unknown_or_unsupported_instruction_set_is_refused_clearly():
    if not ops.cpu_layer_ops_run():
        pytest.skip("csd_engine._C has no CPU layer ops")
    code = "import torch, csd_engine.ops as o; o.silu_mul(torch.randn(2, 4))"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "CSD_CPU_ISA": "sse9"}, timeout=300)
    assert run.returncode != 0 and "CSD_CPU_ISA must name an instruction set this CPU runs (baseline" in run.stderr
