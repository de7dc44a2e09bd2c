"""What the flight recorder costs per call: on (the default) against off, in the same run.

    python benchmarks/bench_recorder.py                  # 2 ranks, 8 B and 4 KiB
    python benchmarks/bench_recorder.py --ranks 1        # no peer to wait for: least noise
    python benchmarks/bench_recorder.py --ranks 4 --sizes 8,4096,65536 --blocks 15

Three lines per size:

- end to end: ``Communicator.all_reduce`` (synchronous, and ``async_op=True`` + ``wait()``) on a
  communicator with the recorder (``DK_TRACE_BUFFER_SIZE`` 2000) and on one without
  (``DK_TRACE_BUFFER_SIZE=0``), the two alternating in blocks of back-to-back calls (a block's
  time is the slowest rank's mean per call; the median over blocks is reported), so load that
  drifts hits both alike; the difference printed is the median of the paired blocks' differences;
- the recorder alone: schedule + started + completed of one call in a C++ loop
  (``_C._flight_recorder_cost_ns``), the part of the difference that is the recorder's own;
- the profiler check every call makes (``torch.autograd.profiler._is_profiler_enabled``).

The target is < 0.2 us per call. Ranks are spawned here (``dist_kernels.launch``, gloo).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import timeit
from typing import Callable, Dict, List, Optional, Sequence


def _time_block(call: Callable[[], None], iters: int, gather) -> float:
    """Slowest rank's mean seconds per call over one block of back-to-back calls."""
    gather(0.0)  # a barrier
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return max(gather((time.perf_counter() - start) / iters))


def _alternate(calls: Dict[str, Callable[[], None]], iters: int, blocks: int, gather):
    """Median seconds per call of "on" and "off", and the median of the paired differences
    (block i of "on" minus block i of "off", timed back to back: drifts cancel)."""
    for call in calls.values():  # warm-up
        _time_block(call, iters, gather)
    times: Dict[str, List[float]] = {name: [] for name in calls}
    for _ in range(blocks):
        for name, call in calls.items():
            times[name].append(_time_block(call, iters, gather))
    out = {name: statistics.median(t) for name, t in times.items()}
    out["diff"] = statistics.median(a - b for a, b in zip(times["on"], times["off"]))
    return out


def _communicators():
    import dist_kernels as dk

    on = dk.Communicator()
    saved = os.environ.get("DK_TRACE_BUFFER_SIZE")
    os.environ["DK_TRACE_BUFFER_SIZE"] = "0"
    try:
        off = dk.Communicator()
    finally:
        if saved is None:
            os.environ.pop("DK_TRACE_BUFFER_SIZE")
        else:
            os.environ["DK_TRACE_BUFFER_SIZE"] = saved
    assert on._debug_source.recorder is not None and off._debug_source.recorder is None
    return on, off


def _measure(on, off, nbytes: int, args, gather):
    """(what, {"on": s, "off": s}) for the synchronous and the queued all-reduce."""
    a, b = on.empty(max(nbytes // 4, 1)), off.empty(max(nbytes // 4, 1))
    sync = {"on": lambda: on.all_reduce(a), "off": lambda: off.all_reduce(b)}
    queued = {
        "on": lambda: on.all_reduce(a, async_op=True).wait(),
        "off": lambda: off.all_reduce(b, async_op=True).wait(),
    }
    return [
        ("all_reduce", _alternate(sync, args.iters, args.blocks, gather)),
        (
            "all_reduce async + wait",
            _alternate(queued, max(args.iters // 4, 10), args.blocks, gather),
        ),
    ]


def _rank_main(args) -> None:
    """One rank of :func:`dist_kernels.launch.run` (a gloo default group is up)."""
    import torch
    import torch.distributed as dist

    from dist_kernels import _C

    rank, world_size = dist.get_rank(), dist.get_world_size()
    gather_comm = dist.new_group(backend="gloo")

    def gather(value: float) -> List[float]:
        out = [None] * world_size
        dist.all_gather_object(out, value, group=gather_comm)
        return out

    on, off = _communicators()
    out = print if rank == 0 else (lambda *a, **k: None)
    out(f"# bench_recorder: {world_size} ranks, fp32 sum, registered buffers")
    out(f"# torch {torch.__version__}, load average {os.getloadavg()}")
    for nbytes in args.sizes:
        for what, t in _measure(on, off, nbytes, args, gather):
            on_us, off_us = t["on"] * 1e6, t["off"] * 1e6
            out(
                f"{nbytes:>8} B  {what:<24} recorder on {on_us:7.2f} us, off {off_us:7.2f} us: "
                f"{t['diff'] * 1e6:+.3f} us per call (median of paired blocks)",
                flush=True,
            )
    alone = statistics.median(_C._flight_recorder_cost_ns(2000, 200_000) for _ in range(5))
    out(
        f"# the recorder alone (C++ loop, schedule + started + completed, thread CPU time): "
        f"{alone:.0f} ns per call"
    )
    check = timeit.timeit(
        "p._is_profiler_enabled", "from torch.autograd import profiler as p", number=1_000_000
    )
    out(f"# the profiler check per call (Python attribute read): {check * 1e3:.0f} ns")
    out(f"# load average at end {os.getloadavg()}")
    on.close()
    off.close()


def _sizes(text: str) -> List[int]:
    return [int(s) for s in text.split(",") if s]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--sizes", type=_sizes, default=[8, 4096], help="bytes, comma-separated")
    parser.add_argument("--iters", type=int, default=2000, help="calls per block")
    parser.add_argument("--blocks", type=int, default=11, help="timed blocks per variant")
    args = parser.parse_args(argv)

    from dist_kernels import launch

    launch.run(args.ranks, _rank_main, args, threads=1, group_timeout=300.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
