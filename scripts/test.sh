#!/usr/bin/env bash
# Runs the whole test suite on a machine without a GPU (CI calls this through .ci/run).
# Triton kernels run in Triton's interpreter; CUDA sources are compile-checked with nvcc.
set -euo pipefail
cd "$(dirname "$0")/.."
SKIP_MODEL=1 bash scripts/setup.sh
export TRITON_INTERPRET=1 CSD_DEBUG=1
# One pytest worker per core (at most 4; CSD_TEST_WORKERS overrides), each test file on one
# worker so its module fixtures are built once; workers run torch single-threaded (conftest).
cores=$(nproc)
workers=${CSD_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
# --no-loadscope-reorder: files in the order tests/conftest.py gives them, the compile check first.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
