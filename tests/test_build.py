"""The extension's build report: dist_kernels.build_info() and ``python -m dist_kernels.info``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import dist_kernels

KEYS = (
    "version",
    "cuda_compiled",
    "cuda_runtime_version",
    "cuda_archs",
    "device_count",
    "nccl_library",
    "nccl_version",
)


def test_build_info_has_every_key_and_never_raises():
    info = dist_kernels.build_info()
    for key in KEYS:
        assert key in info, key
    assert info["version"] == dist_kernels.__version__
    assert isinstance(info["cuda_compiled"], bool)
    assert isinstance(info["device_count"], int) and info["device_count"] >= 0
    if info["cuda_compiled"]:
        assert info["cuda_runtime_version"] and info["cuda_archs"]
    else:
        assert info["cuda_runtime_version"] is None and info["cuda_archs"] is None
        assert info["device_count"] == 0


def test_cuda_compiled_matches_what_ci_expects():
    expected = os.environ.get("DK_EXPECT_CUDA")
    if expected is None:
        pytest.skip("DK_EXPECT_CUDA not set (CI sets it to say which build it made)")
    assert dist_kernels.build_info()["cuda_compiled"] == bool(int(expected))


def test_info_module_prints_build_info():
    result = subprocess.run(
        [sys.executable, "-m", "dist_kernels.info"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    printed = json.loads(result.stdout)
    assert printed == json.loads(json.dumps(dist_kernels.build_info()))


def _python_ping_pong_ns(rounds: int) -> float:
    """The same hand-off written in Python threads (a lock each way): microseconds, far above
    any cache line's trip, so an upper bound the C++ probe must stay under."""
    import threading
    import time

    ping, pong = threading.Semaphore(0), threading.Semaphore(0)

    def answer():
        for _ in range(rounds):
            ping.acquire()
            pong.release()

    peer = threading.Thread(target=answer)
    peer.start()
    start = time.perf_counter()
    for _ in range(rounds):
        ping.release()
        pong.acquire()
    took = time.perf_counter() - start
    peer.join()
    return took / rounds * 1e9


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="the cross-CPU probe needs two usable CPUs"
)
def test_cross_core_round_trip_is_a_cache_line_hand_off():
    from dist_kernels import _C, info

    ns = info.cross_core_round_trip_ns()
    assert ns is not None and ns > 0
    assert ns < _python_ping_pong_ns(2000), ns
    cpus = sorted(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="cannot run on CPU 4096"):
        _C.cross_core_round_trip_ns(cpus[0], 4096)
    with pytest.raises(ValueError, match="iterations and batches must be positive"):
        _C.cross_core_round_trip_ns(cpus[0], cpus[1], 0)
