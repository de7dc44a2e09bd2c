"""``dist_kernels.build_info()`` and ``python -m dist_kernels.info``."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, Optional, Sequence

from . import _C
from ._version import __version__


def build_info() -> Dict[str, Any]:
    """What the extension was compiled with and what it finds on this machine.

    Keys: ``version``, ``cuda_compiled``, ``cuda_runtime_version``, ``cuda_archs``,
    ``device_count`` (0 without a GPU or driver; never raises), ``nccl_library`` (the path
    that would be loaded, or None) and ``nccl_version`` (or None).
    """
    info: Dict[str, Any] = {"version": __version__}
    info.update(_C.build_info())
    info["nccl_library"] = None
    info["nccl_version"] = None
    try:
        from .comm import nccl
    except ImportError:
        return info
    info.update(nccl.describe())
    return info


def cross_core_round_trip_ns(iterations: int = 2000, batches: int = 5) -> Optional[float]:
    """The round trip of one cache line between threads pinned to the first two CPUs this
    process may use, in ns (median of ``batches``); None with fewer than two CPUs, or when one
    is too busy to answer within a second.

    Tens of ns: the two CPUs share a core or a cache; hundreds: they are farther apart. A VM
    may move between the two from run to run, and every two-rank time moves with it, so the
    benchmarks print this beside their tables, as they print the load average.
    """
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        return None
    try:
        return _C.cross_core_round_trip_ns(cpus[0], cpus[1], iterations, batches)
    except RuntimeError:
        return None


def main(argv: Optional[Sequence[str]] = None) -> None:
    argparse.ArgumentParser(
        prog="python -m dist_kernels.info",
        description="Print, as JSON, what dist_kernels was compiled with and what it finds here "
        "(CUDA runtime and devices, the NCCL library that would be loaded).",
    ).parse_args(argv)
    print(json.dumps(build_info(), indent=2, sort_keys=False))


if __name__ == "__main__":
    main()
