#!/usr/bin/env bash
# Installs Intel oneCCL (CPU) and Intel MPI into a venv of their own, for the oneCCL row of
# benchmarks/bench_oneccl.py. Not part of CI, and never into the project's venv: Intel MPI's
# libmpi.so and mpiexec would shadow MPICH's, which bench_mpi.py's mpi4py is built against.
#   tools/install_oneccl.sh                  # into /work/venv-ccl
#   tools/install_oneccl.sh ~/venv-ccl       # or any path
# Then: python benchmarks/bench_oneccl.py --ccl-venv <that path>  (or DK_ONECCL_VENV=<path>)
#
# What the wheels hold (2022.2.0 / 2021.19.0): oneccl-cpu lib/libccl.so* (no Python binding);
# oneccl-cpu-devel include/oneapi/ccl.hpp; impi-rt bin/mpiexec (hydra) and lib/libmpi.so*;
# impi-devel include/mpi.h and bin/mpicxx; intel-cmplr-lib-rt lib/libintlc.so.5, which holds
# _intel_fast_memcpy and the CPU-feature symbols libccl.so leaves undefined without naming it.
# --no-deps: oneccl-cpu and impi-rt require `libfabric>=2.6`, which is not on PyPI. It is only
# needed for CCL_ATL_TRANSPORT=ofi and Intel MPI's ofi fabric; the benchmark's setting
# (CCL_ATL_TRANSPORT=mpi, I_MPI_FABRICS=shm) runs without it.
set -euo pipefail
venv=${1:-${DK_ONECCL_VENV:-/work/venv-ccl}}
py=${PYTHON:-python3}
ccl_version=${DK_ONECCL_VERSION:-2022.2.0}
impi_version=${DK_IMPI_VERSION:-2021.19.0}
rt_version=${DK_INTEL_RT_VERSION:-2026.2.0}

[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --no-deps \
  "oneccl-cpu==$ccl_version" "oneccl-cpu-devel==$ccl_version" \
  "impi-rt==$impi_version" "impi-devel==$impi_version" "intel-cmplr-lib-rt==$rt_version"

# libccl.so.1 lists libccl.so.2 as NEEDED, a file the wheel does not ship: the soname the
# wheel's own library answers to. A link to it lets the loader (and the linker) resolve it.
[ -e "$venv/lib/libccl.so.2" ] || ln -s libccl.so.1 "$venv/lib/libccl.so.2"

# The files the benchmark needs; a wheel that moved one is reported here, not at run time.
missing=0
for pattern in include/oneapi/ccl.hpp include/mpi.h "lib/libccl.so*" "lib/libmpi.so*" \
  "lib/libintlc.so*" "bin/mpiexec*"; do
  if ! compgen -G "$venv/$pattern" >/dev/null; then
    echo "install_oneccl: $venv/$pattern not found after install" >&2
    missing=1
  fi
done
[ "$missing" = 0 ] || exit 1
echo "oneCCL $ccl_version and Intel MPI $impi_version in $venv"
