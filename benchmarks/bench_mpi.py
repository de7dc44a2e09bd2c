"""All-reduce against MPI: ours, MPI_Allreduce (mpi4py) and Gloo in the same processes.

    pip install ".[mpi]"                       # mpich + mpi4py
    mpiexec -n 2 python benchmarks/bench_mpi.py
    mpiexec -n 4 python benchmarks/bench_mpi.py -b 8 -e 64M -f 4 --buffers plain

Every rank runs the three on the same tensor (MPI gets its numpy view, in place:
MPI_IN_PLACE), fp32 SUM, sizes from -b to -e by -f. Correctness first (#wrong per
implementation against the exact sum), then timing: the implementations alternate in blocks
(ours, MPI, Gloo, ours, ...), each block a barrier then `iters` back-to-back calls; a block's
time is the slowest rank's mean per call, the reported time the median over blocks. Columns
follow nccl-tests (time in us, algbw / busbw in GB/s, busbw = algbw * 2(n-1)/n); the ratios are
MPI's and Gloo's time over ours (> 1: ours is faster). With --previous, a results JSON of
`python -m dist_kernels.bench` (same world size) adds its in-place `auto` time and the ratio.
The first lines print the Python call overhead: Communicator.all_reduce against the bare
extension call on the same 8-byte tensor.

With --timing each, the blocks still alternate, but each call is timed (a clock read between
calls, as `python -m dist_kernels.bench` does) and each implementation's calls of all blocks
are pooled: each rank's mean, p50 and p99, then the slowest rank's of each. --json prints one
JSON line per size instead of the table (benchmarks/bench_oneccl.py reads them and times
oneCCL the same way in benchmarks/oneccl/bench_oneccl.cc).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

IMPLS = ("ours", "mpi", "gloo")


def parse_size(text: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = value[-1:] if value[-1:] in units else ""
    number = int(value[: len(value) - len(unit)])
    if number <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return number * units[unit]


def sizes(min_bytes: int, max_bytes: int, factor: int, itemsize: int = 4) -> List[int]:
    """Byte sizes from min to max by factor, each a whole number of elements."""
    out, s = [], max(min_bytes, itemsize)
    while s <= max_bytes:
        out.append(s // itemsize * itemsize)
        s *= factor
    return out


def iterations(nbytes: int, iter_bytes: int, lo: int = 5, hi: int = 200) -> int:
    """Calls per block: enough bytes for a steady time, bounded for tiny and huge sizes."""
    return max(lo, min(hi, iter_bytes // max(nbytes, 1)))


def block_order(blocks: int) -> List[str]:
    """The schedule: implementations alternating, so slow drifts hit all of them alike."""
    return [impl for _ in range(blocks) for impl in IMPLS]


def busbw_factor(world_size: int) -> float:
    return 2.0 * (world_size - 1) / world_size if world_size > 1 else 1.0


def summarize(block_times: Dict[str, List[float]]) -> Dict[str, float]:
    """Median over blocks of each implementation's per-call time (seconds)."""
    return {impl: statistics.median(times) for impl, times in block_times.items() if times}


def row(nbytes: int, n: int, t: Dict[str, float], wrong: Dict[str, int], prev_us=None) -> str:
    """One table row: per implementation time / algbw / busbw / #wrong, then the ratios."""
    f = busbw_factor(n)
    cells = [f"{nbytes:>12d}", f"{nbytes // 4:>11d}", "  float", "   sum"]
    for impl in IMPLS:
        us = t[impl] * 1e6
        algbw = nbytes / t[impl] / 1e9
        cells += [f"{us:>9.2f}", f"{algbw:>7.3f}", f"{algbw * f:>7.3f}", f"{wrong[impl]:>6d}"]
    cells += [f"{t['mpi'] / t['ours']:>7.2f}", f"{t['gloo'] / t['ours']:>8.2f}"]
    if prev_us is not None:
        cells += [f"{prev_us:>9.2f}", f"{prev_us / (t['ours'] * 1e6):>8.2f}"]
    return " ".join(cells)


def header(with_previous: bool) -> str:
    top = f"{'size(B)':>12} {'count':>11} {'type':>6} {'redop':>5}"
    for impl in IMPLS:
        top += f" {impl + ':us':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
    top += f" {'mpi/us':>7} {'gloo/us':>8}"
    if with_previous:
        top += f" {'prev:us':>9} {'prev/us':>8}"
    return top


def previous_times(path: Optional[str], world_size: int) -> Dict[int, float]:
    """size -> in-place `auto` time (us) from a dist_kernels.bench results JSON."""
    if not path:
        return {}
    with open(path) as f:
        data = json.load(f)
    if data["meta"].get("world_size") != world_size:
        return {}
    return {
        r["size"]: r["in_place"]["time_us"]
        for r in data["rows"]
        if r["algorithm"] == "auto" and r["in_place"].get("time_us")
    }


# -- what runs under mpiexec -------------------------------------------------------------------


def _setup(mpi_comm):
    """torch.distributed (gloo) over a TCPStore whose port rank 0 picks and MPI broadcasts."""
    import datetime

    import torch.distributed as dist

    rank, n = mpi_comm.Get_rank(), mpi_comm.Get_size()
    store = None
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, n, is_master=True, wait_for_workers=False)
    port = mpi_comm.bcast(store.port if store else None, root=0)
    if rank != 0:
        store = dist.TCPStore("127.0.0.1", port, n, is_master=False)
    timeout = datetime.timedelta(seconds=300)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=timeout)
    return store


def _time_block(mpi_comm, call: Callable[[], None], iters: int) -> float:
    """Slowest rank's mean seconds per call over one block of back-to-back calls."""
    from mpi4py import MPI

    mpi_comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    per_call = (time.perf_counter() - start) / iters
    return mpi_comm.allreduce(per_call, op=MPI.MAX)


def _alternate(mpi_comm, calls: Dict[str, Callable[[], None]], iters: int, blocks: int):
    """Median seconds per call of each of `calls`, timed in alternating blocks after a warm-up."""
    for call in calls.values():
        _time_block(mpi_comm, call, iters)
    times: Dict[str, List[float]] = {name: [] for name in calls}
    for _ in range(blocks):
        for name, call in calls.items():
            times[name].append(_time_block(mpi_comm, call, iters))
    return summarize(times)


def _time_each(mpi_comm, call: Callable[[], None], iters: int) -> List[float]:
    """One block, each call's seconds: a barrier, then `iters` back-to-back calls."""
    mpi_comm.Barrier()
    clock = time.perf_counter
    stamps = [clock()]
    for _ in range(iters):
        call()
        stamps.append(clock())
    return [b - a for a, b in zip(stamps, stamps[1:])]


def _slowest_stats(mpi_comm, each: List[float]) -> Dict[str, float]:
    """This rank's mean, p50 and p99 (seconds, nearest rank), then the slowest rank's of each."""
    import numpy as np
    import torch
    from mpi4py import MPI

    from dist_kernels.bench.cli import percentile

    samples = torch.tensor(each, dtype=torch.float64)
    mine = np.array([sum(each) / len(each), percentile(samples, 50), percentile(samples, 99)])
    mpi_comm.Allreduce(MPI.IN_PLACE, mine, op=MPI.MAX)
    return dict(zip(("mean", "p50", "p99"), mine.tolist()))


def _python_overhead(comm, mpi_comm, iters: int = 2000, blocks: int = 7) -> str:
    """Communicator.all_reduce against the bare extension call it makes (8 bytes)."""
    import torch

    t = comm.empty(2) if hasattr(comm, "empty") else torch.zeros(2)
    impl = comm._backend.impl
    ptr, numel = t.data_ptr(), t.numel()
    t_ = _alternate(
        mpi_comm,
        {
            "wrapped": lambda: comm.all_reduce(t),
            "bare": lambda: impl.all_reduce(ptr, numel, 0, 0, 0, False),
        },
        iters,
        blocks,
    )
    wrapped, bare = t_["wrapped"], t_["bare"]
    return (
        f"# python call path at 8 B: Communicator.all_reduce {wrapped * 1e6:.2f} us, "
        f"bare _C call {bare * 1e6:.2f} us: overhead {(wrapped - bare) * 1e6:.2f} us per call"
    )


def _descriptor_check_cost(comm, mpi_comm, sizes_b=(8, 4096, 65536), blocks: int = 7) -> str:
    """Our all-reduce with the disagreement check (the default) and without it
    (DK_CHECK_DESCRIPTORS=0: no announcement, no descriptor comparison), alternating blocks.
    Without it the small-message boxes are off too (their reuse rests on the announcements),
    so up to 8 KiB this compares the boxes with the FIFO one-shot as well."""
    import dist_kernels as dk

    saved = os.environ.get("DK_CHECK_DESCRIPTORS")
    os.environ["DK_CHECK_DESCRIPTORS"] = "0"
    try:
        unchecked = dk.Communicator()
    finally:
        if saved is None:
            os.environ.pop("DK_CHECK_DESCRIPTORS")
        else:
            os.environ["DK_CHECK_DESCRIPTORS"] = saved
    parts = []
    try:
        for nbytes in sizes_b:
            a, b = comm.empty(nbytes // 4), unchecked.empty(nbytes // 4)
            t_ = _alternate(
                mpi_comm,
                {
                    "checked": lambda a=a: comm.all_reduce(a),
                    "unchecked": lambda b=b: unchecked.all_reduce(b),
                },
                iterations(nbytes, 64 << 20, lo=200, hi=2000),
                blocks,
            )
            on, off = t_["checked"] * 1e6, t_["unchecked"] * 1e6
            parts.append(f"{nbytes} B {on:.2f} vs {off:.2f} us ({on - off:+.2f})")
    finally:
        unchecked.close()
    return "# disagreement check (checked vs DK_CHECK_DESCRIPTORS=0): " + "; ".join(parts)


def _measure(comm, mpi_comm, nbytes: int, args):
    """Checks, then times ours, MPI and Gloo on one tensor of `nbytes`; (medians, #wrong)."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    rank, n = mpi_comm.Get_rank(), mpi_comm.Get_size()
    count = nbytes // 4
    t = comm.empty(count) if args.buffers == "registered" else torch.empty(count)
    view = t.numpy()
    calls = {
        "ours": lambda: comm.all_reduce(t, algorithm=args.algorithm),
        "mpi": lambda: mpi_comm.Allreduce(MPI.IN_PLACE, view, op=MPI.SUM),
        "gloo": (lambda: None) if args.no_gloo else (lambda: dist.all_reduce(t)),
    }
    # Correctness: small integers, exact in fp32; every rank checks the exact sum.
    base = torch.arange(count, dtype=torch.float32) % 13
    expect = base * n + sum(range(n))
    wrong = {}
    for impl, call in calls.items():
        t.copy_(base + rank)
        call()
        bad = 0 if impl == "gloo" and args.no_gloo else int((t != expect).sum())
        wrong[impl] = mpi_comm.allreduce(bad, op=MPI.SUM)
    iters = iterations(nbytes, args.iter_bytes)
    for impl in IMPLS:  # warm-up
        _time_block(mpi_comm, calls[impl], max(1, iters // 10))
    if args.timing == "each":
        stats = _time_each_pooled(mpi_comm, calls, iters, args.blocks)
    else:
        stats = _time_blocks(mpi_comm, calls, iters, args.blocks)
    if args.no_gloo:
        stats["gloo"] = {key: float("nan") for key in stats["gloo"]}
    return stats, wrong


def _time_blocks(mpi_comm, calls, iters: int, blocks: int) -> Dict[str, Dict[str, float]]:
    """impl -> {"mean": median over blocks of the slowest rank's mean per call}."""
    times: Dict[str, List[float]] = {impl: [] for impl in IMPLS}
    for impl in block_order(blocks):
        times[impl].append(_time_block(mpi_comm, calls[impl], iters))
    return {impl: {"mean": t} for impl, t in summarize(times).items()}


def _time_each_pooled(mpi_comm, calls, iters: int, blocks: int) -> Dict[str, Dict[str, float]]:
    """impl -> the slowest rank's mean, p50, p99 over every call of its alternating blocks."""
    each: Dict[str, List[float]] = {impl: [] for impl in IMPLS}
    for impl in block_order(blocks):
        each[impl] += _time_each(mpi_comm, calls[impl], iters)
    return {impl: _slowest_stats(mpi_comm, samples) for impl, samples in each.items()}


def json_line(nbytes: int, iters: int, blocks: int, stats, wrong: Dict[str, int]) -> str:
    """One size as JSON: per implementation its times in us (null where not measured)."""
    line: Dict[str, object] = {"size": nbytes, "iters": iters, "blocks": blocks}
    for impl, s in stats.items():
        times = {f"{k}_us": (round(v * 1e6, 3) if v == v else None) for k, v in s.items()}
        line[impl] = {**times, "wrong": wrong[impl]}
    return json.dumps(line)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-b", "--minbytes", type=parse_size, default=8)
    parser.add_argument("-e", "--maxbytes", type=parse_size, default=64 << 20)
    parser.add_argument("-f", "--stepfactor", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=5, help="timed blocks per implementation")
    parser.add_argument("--iter-bytes", type=parse_size, default=256 << 20)
    parser.add_argument("--buffers", choices=("registered", "plain"), default="registered")
    parser.add_argument(
        "--algorithm",
        choices=("auto", "ring", "tree", "one_shot"),
        default="auto",
        help="our all-reduce algorithm (one_shot: up to one FIFO slot)",
    )
    parser.add_argument("--previous", help="dist_kernels.bench JSON to compare ours with")
    parser.add_argument("--no-gloo", action="store_true", help="skip Gloo (slow at 64 MiB)")
    parser.add_argument(
        "--timing",
        choices=("blocks", "each"),
        default="blocks",
        help="blocks: median of block means; each: every call timed, mean/p50/p99",
    )
    parser.add_argument("--json", action="store_true", help="JSON lines instead of the table")
    args = parser.parse_args(argv)

    from mpi4py import MPI

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    import dist_kernels as dk

    torch.set_num_threads(1)
    mpi_comm = MPI.COMM_WORLD
    rank, n = mpi_comm.Get_rank(), mpi_comm.Get_size()
    store = _setup(mpi_comm)
    comm = dk.Communicator()
    previous = previous_times(args.previous, n)
    out = print if rank == 0 else (lambda *a, **k: None)
    import mpi4py

    mpi_name = " ".join(MPI.Get_library_version().split()[:3])  # "MPICH Version: 5.0.2"
    if args.json:
        head = {"impl": "bench_mpi", "mpi": mpi_name, "torch": torch.__version__}
        out(json.dumps({**head, "world_size": n, "timing": args.timing}), flush=True)
    else:
        out(
            f"# bench_mpi: {n} ranks; {mpi_name}, mpi4py {mpi4py.__version__}, "
            f"torch {torch.__version__}"
        )
        out(f"# buffers {args.buffers}; fp32 sum, in place; our algorithm {args.algorithm}")
        out(f"# load average {os.getloadavg()}, usable cores {len(os.sched_getaffinity(0))}")
        out(_python_overhead(comm, mpi_comm))
        out(_descriptor_check_cost(comm, mpi_comm))
        out(header(bool(previous)))
    for nbytes in sizes(args.minbytes, args.maxbytes, args.stepfactor):
        stats, wrong = _measure(comm, mpi_comm, nbytes, args)
        if args.json:
            iters = iterations(nbytes, args.iter_bytes)
            out(json_line(nbytes, iters, args.blocks, stats, wrong), flush=True)
            continue
        means = {impl: s["mean"] for impl, s in stats.items()}
        out(row(nbytes, n, means, wrong, previous.get(nbytes)), flush=True)
    if not args.json:
        out(f"# load average at end {os.getloadavg()}")
    comm.close()
    dist.destroy_process_group()
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
