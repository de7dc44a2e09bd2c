#!/usr/bin/env bash
# Developer build: compiles dist_kernels/_C*.so in place (no pip), into build/dev-<cuda|cpu>.
#   DK_WITH_CUDA=0 tools/dev_build.sh        # CPU-only, fastest
#   DK_CUDA_ARCHS=90 tools/dev_build.sh      # CUDA for one arch
# Then run with PYTHONPATH=$PWD (or from the repository root).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
flavour=$([ "${DK_WITH_CUDA:-AUTO}" = "0" ] && echo cpu || echo cuda)
build=build/dev-$flavour
args=(-DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$PWD/dist_kernels"
      -DPython_EXECUTABLE="$(command -v "$PY")"
      -Dpybind11_DIR="$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')"
      -DCMAKE_BUILD_TYPE="${DK_BUILD_TYPE:-Release}")
[ -n "${DK_WITH_CUDA:-}" ] && args+=(-DDK_WITH_CUDA="$DK_WITH_CUDA")
[ -n "${DK_CUDA_ARCHS:-}" ] && args+=(-DDK_CUDA_ARCHS="$DK_CUDA_ARCHS")
cmake -S . -B "$build" -G Ninja "${args[@]}" >/dev/null
cmake --build "$build" -j "${DK_BUILD_JOBS:-2}"
