"""Collective benchmark in the style of nccl-tests: ``python -m dist_kernels.bench``.

Spawns ``--nproc`` local ranks itself (:mod:`dist_kernels.launch`: a TCPStore this process
holds open and a Gloo process group), or, under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set),
runs as one of its ranks. For every size it first checks each algorithm's result against the
exact answer (#wrong), then times it, and measures the baseline (torch.distributed Gloo on CPU,
NCCL through ``algorithm="nccl"`` on CUDA) in the same run on the same sizes. See
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import itertools
import math
import os
import shlex
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import launch
from . import calibrate as calibration
from . import ops, report
from .load import BusyLoad

ALGORITHMS = ("ring", "tree", "auto")
# --gloo: whether the ranks hold a Gloo process group (Gloo's threads in the process) or only
# "dk" groups; "both" runs the sweep twice, without then with, and compares them.
GLOO_CHOICES = ("with", "without", "both")
# The row of torch.distributed calls (dist.all_reduce, ...) on a "dk" group (CPU only).
TORCH_DK = "torchdk"
DEFAULT_MIN_BYTES = 8
DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_FACTOR = 2


def parse_size(text: str) -> int:
    """``'8'``, ``'64K'``, ``'64KiB'``, ``'16M'``, ``'1G'`` -> bytes (K = 1024)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = value[-1:] if value[-1:] in units else ""
    try:
        number = int(value[: len(value) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8, 64K, 16M)") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return number * units[unit]


def parse_algorithms(text: str) -> str:
    """``'all'``, one algorithm, or several joined by commas (``'ring,one_shot,auto'``): rows
    of one run, timed one after another at each size."""
    names = text.split(",")
    known = (*ALGORITHMS, "one_shot")
    bad = [a for a in names if a not in known]
    if text != "all" and (bad or len(set(names)) != len(names)):
        raise argparse.ArgumentTypeError(
            f"--algorithm {text!r}: 'all' or distinct names from {', '.join(known)}"
        )
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dist_kernels.bench",
        description=__doc__.split("\n\n")[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="The defaults sweep 8 B to 64 MiB by x2 (24 sizes; ring, tree, auto and Gloo, "
        "each out-of-place and in-place): estimated at under a minute for 2 ranks on a quiet "
        "2-core machine (it took 7 minutes at load average 20). -f 4 halves the sizes, a smaller "
        "-e or --iter-bytes shortens the large ones; --iters gives steadier small sizes.",
    )
    add = parser.add_argument
    add(
        "--nproc",
        type=int,
        default=2,
        help="local ranks to spawn (ignored under torchrun); with --device cuda at most one per "
        "GPU (--nproc 1: world size 1, one rank)",
    )
    add("--op", choices=ops.OPS, default="all_reduce")
    add(
        "--algorithm",
        type=parse_algorithms,
        default="all",
        help="ring, tree, auto, one_shot, several joined by commas (ring,one_shot,auto), or all "
        "= ring, tree, auto (one_shot: CPU all_reduce, all_gather and reduce_scatter of up to one "
        "slot per message)",
    )
    add("-b", "--minbytes", type=parse_size, default=DEFAULT_MIN_BYTES, help="smallest size")
    add("-e", "--maxbytes", type=parse_size, default=DEFAULT_MAX_BYTES, help="largest size")
    add("-f", "--stepfactor", type=int, default=DEFAULT_FACTOR, help="size multiplication factor")
    add("--dtype", choices=tuple(ops.DTYPES), default="float32")
    add(
        "--redop",
        choices=ops.REDOPS,
        default="sum",
        help="all_reduce / reduce_scatter only (the others ignore it)",
    )
    add("--root", type=int, default=0, help="broadcast root (the others ignore it)")
    add("--iters", type=int, default=100, help="timed iterations per size, at most")
    add("--warmup", type=int, default=10, help="untimed iterations per size, at most")
    add(
        "--iter-bytes",
        type=parse_size,
        default=512 << 20,
        help="size-aware iterations: a size S gets max(--min-iters, ceil(iter-bytes / S)) "
        "iterations, capped at --iters, and warmup scaled alike (at least 1)",
    )
    add("--min-iters", type=int, default=5, help="timed iterations at the largest sizes, at least")
    add(
        "--buffers",
        choices=("registered", "plain"),
        default="registered",
        help="our tensors from comm.empty (registered shared memory) or torch.empty; "
        "the baseline always uses torch.empty",
    )
    add("--device", choices=("cpu", "cuda"), default="cpu")
    add("--timeout", type=float, default=300.0, help="seconds before a stuck collective fails")
    add(
        "--gloo",
        choices=GLOO_CHOICES,
        default="with",
        help="CPU: 'with' = a Gloo default group (torchrun scripts have one) and the Gloo "
        "baseline row; 'without' = only \"dk\" groups (no Gloo threads in the process, no "
        "baseline); 'both' = the sweep without, then with, and a p50 / p99 comparison",
    )
    add(
        "--load",
        type=int,
        default=0,
        metavar="N",
        help="N busy processes beside the ranks while they run (started and stopped by the "
        "benchmark; under torchrun by each host's local rank 0)",
    )
    add("--load-nice", type=int, default=0, help="niceness of the --load processes, 0 to 19")
    add("--json", metavar="FILE", help="write meta data and every row as JSON")
    add("--plot", metavar="FILE.png", help="busbw against size, log-log (needs matplotlib)")
    calibration.add_arguments(parser)
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("nproc", "stepfactor", "iters", "min_iters"):
        if getattr(args, name) < 1 + (name == "stepfactor"):
            parser.error(f"--{name.replace('_', '-')} must be >= {1 + (name == 'stepfactor')}")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.load < 0 or not 0 <= args.load_nice <= 19:
        parser.error("--load must be >= 0 and --load-nice from 0 to 19")
    if args.gloo != "with" and (args.device != "cpu" or _under_torchrun()):
        parser.error(
            f"--gloo {args.gloo}: CPU and spawned ranks only (under torchrun the script's "
            "process group decides; on CUDA the baseline is NCCL)"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    if args.device == "cuda" and not _under_torchrun():
        gpus = torch.cuda.device_count()
        if args.nproc > gpus:  # spawned ranks share no GPU: NCCL refuses a duplicate GPU
            parser.error(
                f"--device cuda --nproc {args.nproc}: this machine has {gpus} CUDA device(s), "
                f"one rank each; use --nproc {gpus}, or run ranks that share a GPU under "
                "torchrun with NCCL's socket transport and one NCCL_HOSTID per rank (docs/gpu.md)"
            )
    if args.op == "sendrecv":
        if args.nproc < 2 and not _under_torchrun():
            parser.error("--op sendrecv needs --nproc >= 2 (every rank sends to the next)")
        if args.device == "cuda" and not dist.is_nccl_available():
            parser.error(f"--op sendrecv --device cuda: torch {torch.__version__} has no NCCL")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install matplotlib (or drop --plot)")
    if args.minbytes > args.maxbytes:
        parser.error(f"-b {args.minbytes} is larger than -e {args.maxbytes}")
    return args


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def sizes(args: argparse.Namespace) -> List[int]:
    result, size = [], args.minbytes
    while size <= args.maxbytes:
        result.append(size)
        size *= args.stepfactor
    return result


def iterations(size: int, args: argparse.Namespace) -> Tuple[int, int]:
    """(timed, warmup) iterations for ``size`` bytes: fewer for large sizes, see --iter-bytes."""
    iters = min(args.iters, max(args.min_iters, math.ceil(args.iter_bytes / size)))
    warmup = min(args.warmup, max(1, math.ceil(args.warmup * iters / args.iters)))
    return iters, warmup


# ---------------------------------------------------------------------------------------------
# One rank


class _Rank:
    """The benchmark as seen by one rank: its communicator, backends and buffers."""

    def __init__(self, args: argparse.Namespace, launcher: str, command: str) -> None:
        import dist_kernels as dk

        self.args = args
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if args.op == "broadcast" and not 0 <= args.root < self.world_size:
            raise ValueError(f"--root {args.root} is not a rank of {self.world_size}")
        if args.op == "sendrecv" and self.world_size < 2:
            raise ValueError(f"--op sendrecv needs 2 ranks or more, not {self.world_size}")
        self.device = torch.device(args.device)
        if args.device == "cuda":
            torch.cuda.set_device(
                int(os.environ.get("LOCAL_RANK", self.rank)) % max(1, torch.cuda.device_count())
            )
            self.device = torch.device("cuda", torch.cuda.current_device())
        timeout = datetime.timedelta(seconds=args.timeout)
        # On CPU the communicator is the one of a "dk" torch.distributed group, so the same
        # collectives through torch's API (TORCH_DK) run on the same communicator and buffers:
        # the difference is the ProcessGroup layer alone.
        self.dk_group = (
            dist.new_group(backend="dk", timeout=timeout) if args.device == "cpu" else None
        )
        if self.dk_group is not None:
            self.comm = self.dk_group.communicator("cpu")
        else:
            self.comm = dk.Communicator(group=None, device=args.device, timeout=timeout)
        self.dk = dk
        self.gloo = dist.get_backend() == "gloo"
        self.baseline = ("gloo" if self.gloo else None) if args.device == "cpu" else "nccl"
        requested = list(ALGORITHMS) if args.algorithm == "all" else args.algorithm.split(",")
        self.algorithms, algorithm_note = ops.algorithm_choices(self.comm, args.op, requested)
        self.notes = [algorithm_note] if algorithm_note else []
        self.backends = self._backends()
        self.meta = self._meta(launcher, command)
        self.max_count = ops.element_count(
            args.op, max(sizes(args)), self.meta["itemsize"], self.world_size
        )
        self._slots: List[torch.Tensor] = []  # registered buffers, see _alloc

    def _redop(self) -> str:
        return self.args.redop if self.args.op in ops.REDUCING_OPS else "none"

    def _root(self) -> int:
        return self.args.root if self.args.op == "broadcast" else -1

    def _backends(self) -> List[ops.Backend]:
        redop = self.args.redop
        ours = [
            ops.Backend(
                a, ops.ours_runner(self.comm, a, ops.ReduceOp[redop.upper()], self.args.root)
            )
            for a in self.algorithms
        ]
        if self.dk_group is not None:
            torch_api = ops.gloo_runner(redop, self.args.root, group=self.dk_group)
            ours.append(ops.Backend(TORCH_DK, torch_api))
        if self.baseline is None:  # --gloo without: nothing to compare with in the process
            return ours
        if self.args.device == "cpu":
            baseline = ops.gloo_runner(redop, self.args.root)
        elif self.args.op == "sendrecv":  # p2p has no algorithm="nccl": torch's NCCL instead
            shift = ops.torch_sendrecv(dist.new_group(backend="nccl"), batched=True)
            baseline = lambda _op, out, inp: shift(out, inp)  # noqa: E731
        else:
            baseline = ops.ours_runner(
                self.comm, "nccl", ops.ReduceOp[redop.upper()], self.args.root
            )
        return [ops.Backend(self.baseline, baseline, is_baseline=True)] + ours

    def _meta(self, launcher: str, command: str) -> Dict[str, Any]:
        args = self.args
        memcpy = self._memcpy_on_rank0()
        dtype = ops.DTYPES[args.dtype]
        baseline_label = {
            "gloo": "torch.distributed Gloo on the same process group, plain torch.empty tensors",
            "nccl": "NCCL through Communicator(algorithm='nccl'), plain tensors",
            None: 'none (--gloo without: only "dk" groups, no Gloo in the process)',
        }[self.baseline]
        placements = ops.placements(args.op)
        if args.op == "sendrecv":
            self.notes.append(_SENDRECV_NOTES[args.device])
            if args.device == "cuda":
                baseline_label = (
                    "torch.distributed NCCL (batch_isend_irecv on a new NCCL group), plain tensors"
                )
        if args.op in ("all_reduce", "broadcast"):
            self.notes.append(
                f"{args.op} is in place (as in torch.distributed): out-of-place = "
                "out.copy_(inp) then the in-place call, the copy included in the time"
            )
        return {
            "date": report.utc_now(),
            "command": command,
            "launcher": launcher,
            "machine": report.machine_info(),
            "env": {
                k: v
                for k, v in sorted(os.environ.items())
                if k in _ENV_SHOWN or k.startswith("DK_")
            },
            "build_info": self.dk.build_info(),
            "memcpy": memcpy,
            "op": args.op,
            "dtype": args.dtype,
            "itemsize": torch.empty((), dtype=dtype).element_size(),
            "redop": self._redop(),
            "root": self._root(),
            "world_size": self.world_size,
            "device": args.device,
            # CUDA: NCCL communicators / streams our ring and tree alternate over (DK_NCCL_LANES)
            "nccl_lanes": getattr(self.comm, "lanes", None) if args.device == "cuda" else None,
            "buffers": args.buffers,
            "buffers_label": "registered (comm.empty)"
            if args.buffers == "registered"
            else "plain (torch.empty)",
            "baseline": self.baseline,
            "baseline_label": baseline_label,
            "gloo_in_process": self.gloo,
            "load": getattr(args, "load_info", None),
            "algorithms": list(self.algorithms) + ([TORCH_DK] if self.dk_group else []),
            "busbw_factor": ops.bus_factor(args.op, self.world_size),
            "busbw_formula": _FACTOR_FORMULA[args.op],
            "placements": list(placements),
            # the placement the summary and the plot read: in-place where the op has it
            "summary_placement": placements[-1],
            "iteration_policy": (
                f"per size S: iters = min({args.iters}, max({args.min_iters}, "
                f"ceil({args.iter_bytes} B / S))), warmup = min({args.warmup}, "
                f"max(1, ceil({args.warmup} * iters / {args.iters}))); column iters: timed/warmup"
            ),
            "args": vars(args),
            "notes": self.notes,
        }

    def close(self) -> None:
        if self.dk_group is not None:
            dist.destroy_process_group(self.dk_group)  # closes its communicator
        else:
            self.comm.close()

    def _memcpy_on_rank0(self) -> Dict[str, float]:
        """The ceiling, measured by rank 0 alone while the others wait in a blocking barrier."""
        result = report.memcpy_bandwidth(self.device) if self.rank == 0 else {}
        objects = [result]
        dist.broadcast_object_list(objects, src=0)
        return objects[0]

    # -- buffers --------------------------------------------------------------------------

    def _alloc(self, ours: bool) -> ops.Alloc:
        """Our tensors: slices of registered slots (or plain); the baseline's: plain, per size.

        Registered memory stays registered until ``close()``, so the slots are allocated once,
        at the largest count, and every size uses their leading elements; the k-th tensor a
        placement asks for is the k-th slot (a placement needs at most two).
        """
        dtype = ops.DTYPES[self.args.dtype]
        if not (ours and self.args.buffers == "registered"):
            return lambda count: torch.empty(count, dtype=dtype, device=self.device)
        handed_out = itertools.count()

        def alloc(count: int) -> torch.Tensor:
            slot = next(handed_out)
            if slot == len(self._slots):
                self._slots.append(self.comm.empty((self.max_count,), dtype=dtype))
            return self._slots[slot][:count]

        return alloc

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # -- one size ---------------------------------------------------------------------------

    def run_size(self, size: int) -> List[report.Row]:
        args = self.args
        dtype = ops.DTYPES[args.dtype]
        itemsize = self.meta["itemsize"]
        count = ops.element_count(args.op, size, itemsize, self.world_size)
        case = ops.Case(args.op, dtype, args.redop, args.root, count, self.rank, self.world_size)
        iters, warmup = iterations(count * itemsize, args)
        results = {b.name: {} for b in self.backends}
        for placement in ops.PLACEMENTS:
            if (args.op, placement) in ops.NO_PLACEMENT:
                for backend in self.backends:
                    results[backend.name][placement] = {
                        "error": ops.NO_PLACEMENT[args.op, placement],
                        "wrong": None,
                    }
                continue
            ours = ops.make_buffers(case, placement, self._alloc(ours=True))
            baseline = ops.make_buffers(case, placement, self._alloc(ours=False))
            for backend in self.backends:
                buffers = baseline if backend.is_baseline else ours
                results[backend.name][placement] = self._measure(
                    case, buffers, backend, iters, warmup
                )
            del ours, baseline
        return [self._row(case, name, r, iters, warmup) for name, r in results.items()]

    def _measure(
        self, case: ops.Case, buffers: ops.Buffers, backend: ops.Backend, iters: int, warmup: int
    ) -> Dict[str, Any]:
        """Checks the result first (every rank agrees on the outcome), then times."""
        call = buffers.bind(backend.run)
        wrong, error = self._check(case, buffers, call)
        status = torch.tensor([wrong, 1 if error else 0], dtype=torch.int64)
        dist.all_reduce(status)
        if status[1] > 0:
            return {"error": error or "failed on another rank", "wrong": None}
        seconds, each = _time_call(call, iters, warmup, self.comm.barrier, self._sync)
        # Each rank's own percentiles, then the slowest rank's: a per-iteration maximum over
        # ranks would not do, the ranks' iterations end at different moments (one rank's
        # late end is the other's short wait) and the maximum of two jittered series sits
        # above both series' median.
        each = torch.tensor(each, dtype=torch.float64)
        mine = [seconds, percentile(each, 50), percentile(each, 99)]
        slowest = torch.tensor(mine, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return {
            "seconds": float(slowest[0]),
            "p50_seconds": float(slowest[1]),
            "p99_seconds": float(slowest[2]),
            "wrong": int(status[0]),
            "error": None,
        }

    def _check(
        self, case: ops.Case, buffers: ops.Buffers, call: Callable[[], None]
    ) -> Tuple[int, Optional[str]]:
        """(#wrong, None) after one call on the known input, or (0, why) if the call refused."""
        ops.prepare_check(case, buffers)
        try:
            call()
            self._sync()
        except Exception as exc:  # noqa: BLE001 - an unsupported combination is reported
            if isinstance(exc, self.dk.CommError):
                raise
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            return 0, f"{type(exc).__name__}: {first_line}"
        return case.wrong(buffers.result), None

    def _row(
        self, case: ops.Case, name: str, results: Dict[str, Dict], iters: int, warmup: int
    ) -> report.Row:
        size = case.count * self.meta["itemsize"]
        factor = self.meta["busbw_factor"]
        row: report.Row = {
            "algorithm": name,
            "size": size,
            "count": case.count,
            "type": self.args.dtype,
            "redop": self._redop(),
            "root": self._root(),
            "iters": iters,
            "warmup": warmup,
            "busbw_factor": factor,
        }
        for placement, result in results.items():
            row[placement] = _columns(size, factor, result)
        return row

    def add_ratios(self, rows: List[report.Row]) -> None:
        base = next((r for r in rows if r["algorithm"] == self.baseline), None)
        for row in rows:
            for placement in ops.PLACEMENTS:
                mine, theirs = row[placement], (base or row)[placement]
                ok = base is not None and not mine.get("error") and not theirs.get("error")
                ok = ok and mine["time_us"] > 0
                mine["vs_baseline"] = theirs["time_us"] / mine["time_us"] if ok else None


_ENV_SHOWN = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NCCL_ALGO", "NCCL_PROTO")
_FACTOR_FORMULA = {
    "all_reduce": "2(n-1)/n",
    "reduce_scatter": "(n-1)/n, S = whole array",
    "all_gather": "(n-1)/n, S = whole array",
    "broadcast": "1",
    "sendrecv": "1, S = bytes each rank sends",
}
_SENDRECV_NOTES = {
    "cpu": "sendrecv: each rank receives S bytes from rank-1 while sending S bytes to rank+1 "
    "(irecv posted, then isend, then both waited; Gloo likewise with torch.distributed)",
    "cuda": "sendrecv: each rank receives S bytes from rank-1 while sending S bytes to rank+1 "
    "(ours: Communicator.send_recv, one NCCL group per message; NCCL: batch_isend_irecv)",
}


def percentile(samples: torch.Tensor, q: float) -> float:
    """The ``q``-th percentile of ``samples`` (seconds), nearest rank: a time that was measured,
    as nccl-tests' successors and ``perf`` report it, never an interpolation between two."""
    ordered = torch.sort(samples).values
    index = max(0, math.ceil(q / 100 * ordered.numel()) - 1)
    return float(ordered[index])


def _columns(size: int, factor: float, result: Dict[str, Any]) -> Dict[str, Any]:
    if result.get("error"):
        return {
            "time_us": None,
            "p50_us": None,
            "p99_us": None,
            "algbw": None,
            "busbw": None,
            "wrong": None,
            "error": result["error"],
        }
    seconds = result["seconds"]
    algbw = size / seconds / 1e9 if seconds > 0 else 0.0
    return {
        "time_us": seconds * 1e6,
        "p50_us": result["p50_seconds"] * 1e6,
        "p99_us": result["p99_seconds"] * 1e6,
        "algbw": algbw,
        "busbw": algbw * factor,
        "wrong": result["wrong"],
        "error": None,
    }


def _time_call(
    call: Callable[[], None], iters: int, warmup: int, barrier: Callable[[], None], sync: Callable
) -> Tuple[float, List[float]]:
    """Average seconds per call over ``iters`` back-to-back calls, after ``warmup`` calls, and
    each call's seconds (a clock read between calls: ~50 ns, inside the average too; on CUDA
    an iteration's time is its launch, the average is the one to read there)."""
    for _ in range(warmup):
        call()
    sync()
    barrier()
    clock = time.perf_counter
    stamps = [clock()]
    for _ in range(iters):
        call()
        stamps.append(clock())
    sync()
    end = clock()
    return (end - stamps[0]) / iters, [b - a for a, b in zip(stamps, stamps[1:])]


def run_rank(
    args: argparse.Namespace, launcher: str, command: str
) -> Tuple[Dict[str, Any], List[report.Row]]:
    """Runs the whole benchmark on this rank (process group initialised); rank 0 prints.
    Returns the meta data and every row (the same on every rank)."""
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if args.calibrate:
        calibration.run_rank(args, command)
        return {}, []
    # all_gather_into_tensor's deprecation notice, once per rank, would split the table.
    warnings.filterwarnings("ignore", category=FutureWarning)
    bench = _Rank(args, launcher, command)
    printing = bench.rank == 0
    meta = bench.meta
    if printing:
        _print(*report.header_lines(meta), *report.table_header(bench.baseline))
    all_rows: List[report.Row] = []
    seen = set()
    try:
        for size in sizes(args):
            count = ops.element_count(args.op, size, meta["itemsize"], bench.world_size)
            if count in seen:
                continue  # rounding to whole elements per rank made this size a repeat
            seen.add(count)
            rows = bench.run_size(size)
            bench.add_ratios(rows)
            all_rows += rows
            if printing:
                _print(*(report.format_row(r, bench.baseline) for r in rows))
                if args.json:  # the rows so far: a run cut short keeps what it measured
                    report.write_json(args.json, meta, all_rows)
    finally:
        bench.close()
    if printing:
        meta["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        _print(
            *report.error_lines(all_rows),
            *report.summary_lines(all_rows, meta),
            *report.layer_overhead_lines(all_rows, meta, TORCH_DK, "auto"),
        )
        if args.json:
            report.write_json(args.json, meta, all_rows)
            _print(f"# wrote {args.json}")
        if args.plot:
            report.plot(args.plot, meta, all_rows)
            _print(f"# wrote {args.plot}")
    return meta, all_rows


def _print(*lines: str) -> None:
    print("\n".join(lines), flush=True)


# ---------------------------------------------------------------------------------------------
# Launch


def _spawned_rank(args: argparse.Namespace, command: str):
    kind = "a Gloo default group" if args.gloo == "with" else '"dk" groups only'
    return run_rank(args, f"spawn, {dist.get_world_size()} local ranks, {kind}", command)


def _spawn(args: argparse.Namespace, command: str) -> int:
    """Starts ``--nproc`` ranks and waits; if one fails, the rest get a grace period, then die.

    ``--gloo both``: two sweeps on fresh ranks, without Gloo then with it, under the same
    ``--load``; this process prints their comparison and writes the JSON of both.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank, as torchrun does
    passes = ("without", "with") if args.gloo == "both" else (args.gloo,)
    results = []
    try:
        with BusyLoad(args.load, args.load_nice) as load:
            args.load_info = load.info()
            for gloo in passes:
                one = {"gloo": gloo}
                if len(passes) > 1:  # the plot of the Gloo pass; the JSON of both, below
                    one.update(json=None, plot=args.plot if gloo == "with" else None)
                results.append(_spawn_pass(argparse.Namespace(**{**vars(args), **one}), command))
    except launch.RanksError as e:
        print(f"dist_kernels.bench: {e}", file=sys.stderr)
        return 1
    if len(passes) > 1:
        (meta_without, without), (meta, with_gloo) = results
        _print(*report.gloo_comparison_lines(without, with_gloo, meta))
        if args.json:
            rows = [{**r, "gloo_in_process": False} for r in without]
            rows += [{**r, "gloo_in_process": True} for r in with_gloo]
            report.write_json(args.json, {**meta, "passes": ["without gloo", "with gloo"]}, rows)
            _print(f"# wrote {args.json}")
    return 0


def _spawn_pass(args: argparse.Namespace, command: str):
    """One sweep on ``--nproc`` fresh ranks: rank 0's (meta, rows)."""
    return launch.run(
        args.nproc,
        _spawned_rank,
        args,
        command,
        grace=min(60.0, args.timeout),
        group_timeout=args.timeout,
        name="dk-bench-rank{rank}",
        backend="gloo" if args.gloo == "with" else "dk",
    )[0]


def _command(argv: Sequence[str]) -> str:
    return "python -m dist_kernels.bench " + shlex.join(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m dist_kernels.bench`` and ``dk-bench``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.project:
        return calibration.project()
    if _under_torchrun():
        local_leader = int(os.environ.get("LOCAL_RANK", "0")) == 0
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
        try:
            with BusyLoad(args.load if local_leader else 0, args.load_nice) as load:
                args.load_info = load.info()
                run_rank(args, f"torchrun, {dist.get_world_size()} ranks", _command(argv))
        finally:
            dist.destroy_process_group()
        return 0
    return _spawn(args, _command(argv))


if __name__ == "__main__":
    sys.exit(main())
