#!/usr/bin/env bash
# Compile-checks every csrc/*.cu with nvcc against the installed torch headers, so CUDA sources
# are checked on machines (and CI runners) that have nvcc but no GPU or no CUDA build of torch.
# It compiles only (-c); nothing is linked or run. Exits non-zero on the first compile error,
# 0 with a message when nvcc is absent.
#
#   scripts/nvcc_check.sh            # uses .venv/bin/python if present, else python3
#   PYTHON=/path/to/python NVCC=/path/to/nvcc scripts/nvcc_check.sh
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

nvcc="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$nvcc" ]]; then
    for candidate in /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc; do
        if [[ -x "$candidate" ]]; then nvcc="$candidate"; break; fi
    done
fi
if [[ -z "$nvcc" ]]; then
    echo "nvcc_check: nvcc not found, nothing checked"
    exit 0
fi

python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi
# The include paths and the nvcc flags torch's CUDAExtension builds with, one per line.
mapfile -t torch_flags < <("$python" -c 'from torch.utils import cpp_extension
print("\n".join(["-I" + path for path in cpp_extension.include_paths()] + cpp_extension.COMMON_NVCC_FLAGS))')
if (( ${#torch_flags[@]} == 0 )); then
    echo "nvcc_check: $python could not import torch.utils.cpp_extension" >&2
    exit 1
fi

shopt -s nullglob
sources=(csrc/*.cu)
if (( ${#sources[@]} == 0 )); then
    echo "nvcc_check: no csrc/*.cu sources, nothing checked"
    exit 0
fi

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

# A CPU build of torch ships the c10/cuda headers but not the file CMake generates for them
# (c10/cuda/impl/cuda_cmake_macros.h); C10_CUDA_NO_CMAKE_CONFIGURE_FILE skips that include,
# which only matters when building torch itself. The standard and CSD_WITH_CUDA are setup.py's.
flags=(-std=c++20 -O3 -DCSD_WITH_CUDA -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE "${torch_flags[@]}")

echo "nvcc_check: $("$nvcc" --version | tail -n 1)"
for source in "${sources[@]}"; do
    echo "nvcc_check: compiling $source"
    if ! "$nvcc" "${flags[@]}" -c -o "$scratch/$(basename "$source").o" "$source"; then
        echo "nvcc_check: $source failed to compile" >&2
        exit 1
    fi
done
echo "nvcc_check: ${#sources[@]} CUDA source(s) compiled cleanly"
