"""All-reduce against Intel oneCCL: ours, MPICH and oneCCL in one run, alternating.

    tools/install_oneccl.sh /work/venv-ccl          # once; not part of CI
    PYTHONPATH=$PWD python benchmarks/bench_oneccl.py --ccl-venv /work/venv-ccl
    PYTHONPATH=$PWD python benchmarks/bench_oneccl.py --load 2 -b 8 -e 64M -f 2

oneCCL's wheel has no Python binding, so its side is benchmarks/oneccl/bench_oneccl.cc, built
with g++ against the venv's headers on first use (into a cache folder, keyed by the source and
the venv) and run under Intel MPI's mpiexec with CCL_ATL_TRANSPORT=mpi I_MPI_FABRICS=shm (ofi
is tried when mpi fails; the header says which ran). Ours and MPICH run in other processes, as
`mpiexec -n N python benchmarks/bench_mpi.py --timing each --json --buffers plain` under
MPICH's mpiexec. Both sides measure alike: fp32 sum in place on plain memory, a correctness
check first (#wrong), then alternating blocks of back-to-back calls, each call timed, and per
size the slowest rank's mean, p50 and p99 (each rank's own percentile, then the maximum over
ranks). The two programs alternate `--rounds` times (oneCCL first in even rounds, last in
odd ones), under the same `--load`; the table shows the median over rounds. Ratios are the
other's time over ours: > 1, ours is faster.

Without an install (no --ccl-venv, DK_ONECCL_VENV or /work/venv-ccl holding oneCCL and Intel
MPI), it says so and exits 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))  # dist_kernels.bench.load, from a checkout

from dist_kernels.bench.load import BusyLoad, describe  # noqa: E402

SOURCE = _HERE / "oneccl" / "bench_oneccl.cc"
BENCH_MPI = _HERE / "bench_mpi.py"
DEFAULT_VENV = "/work/venv-ccl"
TRANSPORTS = ("mpi", "ofi")  # the first that runs is used; mpi was the fastest here
IMPLS = ("ours", "mpi", "oneccl")
RUN_TIMEOUT_S = 3600
# The files the program needs from the install (tools/install_oneccl.sh checks the same).
_NEEDED = (
    "include/oneapi/ccl.hpp",
    "include/mpi.h",
    "lib/libccl.so",
    "lib/libccl.so.2",
    "lib/libmpi.so",
    "lib/libintlc.so.5",
    "bin/mpiexec",
)

Rows = Dict[int, Dict[str, object]]  # size -> one JSON line of a program


@dataclass(frozen=True)
class Install:
    """A venv holding oneCCL and Intel MPI (tools/install_oneccl.sh)."""

    root: Path

    @property
    def mpiexec(self) -> Path:
        return self.root / "bin" / "mpiexec"

    @property
    def lib(self) -> Path:
        return self.root / "lib"


def find_install(venv: Optional[str]) -> Tuple[Optional[Install], str]:
    """(the install, "") or (None, why not): --ccl-venv, then DK_ONECCL_VENV, then the default."""
    root = Path(venv or os.environ.get("DK_ONECCL_VENV") or DEFAULT_VENV)
    missing = [name for name in _NEEDED if not (root / name).exists()]
    if missing:
        return None, f"{root} lacks {', '.join(missing)}"
    return Install(root), ""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dist_kernels" / "oneccl"


def build(install: Install, cache: Optional[Path] = None) -> Path:
    """The program built against `install`, compiled once per source and venv."""
    key = hashlib.sha256(SOURCE.read_bytes() + str(install.root).encode()).hexdigest()[:16]
    binary = (cache or cache_dir()) / key / "bench_oneccl"
    if binary.exists():
        return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    partial = binary.with_suffix(f".{os.getpid()}.tmp")
    lib = str(install.lib)
    command = ["g++", "-O2", "-std=c++17", "-Wall", "-I", str(install.root / "include")]
    command += [str(SOURCE), "-o", str(partial), "-L", lib, "-lccl", "-lmpi", "-lintlc"]
    command += [f"-Wl,-rpath,{lib}"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building {SOURCE.name} failed:\n{' '.join(command)}\n{done.stderr}")
    partial.rename(binary)  # whole or absent: a concurrent build cannot leave half a file
    return binary


def _json_lines(stdout: str) -> Tuple[Dict[str, object], Rows]:
    """(the header line, size -> row) from a program's output; other lines are ignored."""
    lines = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
    if not lines or "size" in lines[0]:
        raise RuntimeError(f"no header line in the output:\n{stdout[-2000:]}")
    return lines[0], {int(r["size"]): r for r in lines[1:]}


def size_args(args: argparse.Namespace) -> List[str]:
    """The sweep, passed alike to both programs."""
    sweep = ["-b", str(args.minbytes), "-e", str(args.maxbytes), "-f", str(args.stepfactor)]
    return sweep + ["--iter-bytes", str(args.iter_bytes), "--blocks", str(args.blocks)]


def oneccl_env(transport: str) -> Dict[str, str]:
    env = dict(os.environ, CCL_ATL_TRANSPORT=transport, I_MPI_FABRICS="shm")
    env.setdefault("CCL_LOG_LEVEL", "error")  # its warnings would hide a failure's line
    return env


def run_oneccl(
    install: Install, binary: Path, nproc: int, sweep: List[str], transport: str
) -> Tuple[Dict[str, object], Rows]:
    """One run of the program: (its header, size -> {mean_us, p50_us, p99_us, wrong})."""
    command = [str(install.mpiexec), "-n", str(nproc), str(binary), *sweep]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env=oneccl_env(transport),
        timeout=RUN_TIMEOUT_S,
    )
    if done.returncode != 0:
        tail = (done.stderr or done.stdout)[-2000:]
        raise RuntimeError(f"oneCCL ({transport}) exited {done.returncode}:\n{tail}")
    return _json_lines(done.stdout)


def choose_transport(install: Install, binary: Path, nproc: int) -> Tuple[str, List[str]]:
    """The first of TRANSPORTS whose 8-byte check passes, and why the ones before failed."""
    failures = []
    for transport in TRANSPORTS:
        try:
            _, rows = run_oneccl(install, binary, nproc, ["-e", "8", "--blocks", "1"], transport)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            failures.append(f"{transport}: {str(exc).splitlines()[0]}")
            continue
        if rows and all(r["wrong"] == 0 for r in rows.values()):
            return transport, failures
        failures.append(f"{transport}: wrong results {list(rows.values())}")
    raise RuntimeError("no oneCCL transport runs: " + "; ".join(failures))


def mpich_mpiexec() -> str:
    """MPICH's mpiexec: beside this Python (the mpich wheel), else the first on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        raise RuntimeError("no mpiexec for MPICH: pip install '.[mpi]'")
    return found


def run_ours_mpich(nproc: int, sweep: List[str], gloo: bool) -> Tuple[Dict[str, object], Rows]:
    """One run of bench_mpi.py: size -> {"ours": {...}, "mpi": {...}, "gloo": {...}}."""
    command = [mpich_mpiexec(), "-n", str(nproc), sys.executable, str(BENCH_MPI), *sweep]
    command += ["--timing", "each", "--json", "--buffers", "plain", "--algorithm", "auto"]
    if not gloo:
        command.append("--no-gloo")
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout)[-2000:]
        raise RuntimeError(f"bench_mpi.py exited {done.returncode}:\n{tail}")
    return _json_lines(done.stdout)


def combine(rounds: List[Dict[int, Dict[str, Dict]]]) -> Dict[int, Dict[str, Dict]]:
    """size -> impl -> median over rounds of mean/p50/p99, and #wrong summed over rounds."""
    out: Dict[int, Dict[str, Dict]] = {}
    for size in rounds[0]:
        out[size] = {}
        for impl in rounds[0][size]:
            runs = [r[size][impl] for r in rounds if size in r and impl in r[size]]
            cell = {"wrong": sum(int(x["wrong"]) for x in runs)}
            for key in ("mean_us", "p50_us", "p99_us"):
                values = [x[key] for x in runs if x.get(key) is not None]
                cell[key] = statistics.median(values) if values else None
            out[size][impl] = cell
    return out


def one_round(
    index: int, install: Install, binary: Path, transport: str, args: argparse.Namespace
) -> Tuple[Dict[int, Dict[str, Dict]], Dict[str, Dict]]:
    """Both programs once, oneCCL first in even rounds; (size -> impl -> cell, headers)."""
    sweep = size_args(args)
    runs = {
        "oneccl": lambda: run_oneccl(install, binary, args.nproc, sweep, transport),
        "bench_mpi": lambda: run_ours_mpich(args.nproc, sweep, args.gloo),
    }
    order = list(runs) if index % 2 == 0 else list(reversed(runs))
    results = {name: runs[name]() for name in order}
    ccl_head, ccl_rows = results["oneccl"]
    mpi_head, mpi_rows = results["bench_mpi"]
    merged = {}
    for size, row in mpi_rows.items():
        cells = {impl: row[impl] for impl in ("ours", "mpi", "gloo") if impl in row}
        if size in ccl_rows:
            cells["oneccl"] = ccl_rows[size]
        merged[size] = cells
    return merged, {"oneccl": ccl_head, "bench_mpi": mpi_head}


def _us(value: Optional[float]) -> str:
    return f" {value:>11.2f}" if value is not None else f" {'-':>11}"


def _ratio(theirs: Optional[float], ours: Optional[float]) -> str:
    return f" {theirs / ours:>10.3g}" if theirs and ours else f" {'-':>10}"


def table(combined: Dict[int, Dict[str, Dict]], gloo: bool) -> List[str]:
    """size, p50/p99 per implementation, #wrong, then the others' p50 and p99 over ours."""
    impls = [*IMPLS, "gloo"] if gloo else list(IMPLS)
    top = f"{'size(B)':>10}"
    for impl in impls:
        top += f" {impl + ':p50':>11} {impl + ':p99':>11}"
    top += f" {'#wrong':>6}"
    for other in ("ccl", "mpi"):
        top += f" {other + '/us:p50':>10} {other + '/us:p99':>10}"
    lines = [top]
    for size, cells in sorted(combined.items()):
        blank = {"p50_us": None, "p99_us": None, "wrong": 0}
        c = {impl: cells.get(impl, blank) for impl in impls}
        line = f"{size:>10d}"
        for impl in impls:
            line += _us(c[impl]["p50_us"]) + _us(c[impl]["p99_us"])
        line += f" {sum(int(x['wrong'] or 0) for x in c.values()):>6d}"
        ours = c["ours"]
        for other in ("oneccl", "mpi"):
            line += _ratio(c[other]["p50_us"], ours["p50_us"])
            line += _ratio(c[other]["p99_us"], ours["p99_us"])
        lines.append(line)
    return lines


def machine() -> str:
    model = platform.processor() or "unknown cpu"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cpus ({len(os.sched_getaffinity(0))} usable)"


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add(
        "--ccl-venv", help=f"venv of tools/install_oneccl.sh (else $DK_ONECCL_VENV, {DEFAULT_VENV})"
    )
    add("--nproc", type=int, default=2, help="ranks")
    add("-b", "--minbytes", default="8")
    add("-e", "--maxbytes", default="64M")
    add("-f", "--stepfactor", type=int, default=2)
    add("--iter-bytes", default="256M", help="calls per block: this many bytes, 5 to 200 calls")
    add("--blocks", type=int, default=5, help="timed blocks per implementation and size")
    add("--rounds", type=int, default=3, help="alternations of the two programs")
    add("--load", type=int, default=0, help="busy processes beside the benchmark")
    add("--load-nice", type=int, default=0, help="their niceness, 0 to 19")
    add("--gloo", action="store_true", help="time Gloo too (its columns; slow at 64 MiB)")
    args = parser.parse_args(argv)
    if args.nproc < 1 or args.rounds < 1 or args.blocks < 1:
        parser.error("--nproc, --rounds and --blocks must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    install, why = find_install(args.ccl_venv)
    if install is None:
        print(f"# oneCCL not installed ({why}): no oneCCL row.")
        print("# install with tools/install_oneccl.sh [VENV], then pass --ccl-venv VENV")
        return 0
    binary = build(install)
    transport, failed = choose_transport(install, binary, args.nproc)
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    print(f"# bench_oneccl: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    print(f"# command: python benchmarks/bench_oneccl.py {argv_text}".rstrip())
    print(f"# machine: {machine()}; load average at start {os.getloadavg()}")
    print(f"# oneCCL transport: CCL_ATL_TRANSPORT={transport} I_MPI_FABRICS=shm", end="")
    print(f" (failed first: {'; '.join(failed)})" if failed else "")
    with BusyLoad(args.load, args.load_nice) as load:
        print(
            f"# {args.nproc} ranks, fp32 sum in place, plain buffers; load: {describe(load.info())}"
        )
        rounds, heads = [], {}
        for index in range(args.rounds):
            merged, heads = one_round(index, install, binary, transport, args)
            rounds.append(merged)
            print(f"# round {index + 1}/{args.rounds} done, load average {os.getloadavg()}")
    ccl, mpi = heads["oneccl"], heads["bench_mpi"]
    print(f"# oneCCL {ccl['version']} over {ccl['mpi']}")
    print(f"# ours and {mpi['mpi']} in bench_mpi.py (torch {mpi['torch']}, Gloo initialised)")
    print(f"# p50/p99: us, the slowest rank's, median of {args.rounds} rounds; x/us: x's over ours")
    print("\n".join(table(combine(rounds), args.gloo)))
    print(f"# load average at end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
