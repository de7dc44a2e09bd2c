"""Collectives across 2 emulated hosts: ours against flat Gloo and MPICH, in the same processes.

    sudo python benchmarks/bench_multihost.py                       # everything (~30 min loaded)
    sudo python benchmarks/bench_multihost.py --rates none 1gbit --ranks-per-host 2 \\
        --ops all_reduce -b 8 -e 64M -f 4 --out benchmarks/results/DATE-multihost.md

Two hosts (tools/emulated_hosts.py: network + mount + UTS namespaces over a veth bridge), each
with 1 or 2 ranks, the link uncapped or capped (tc tbf, ``--rates``). For every link setting it
first measures the link's own ceiling: ``--streams`` parallel TCP streams from host0 to host1
for a few seconds (tools/link_probe.py, what iperf3 -P measures). Then, for every op and size
(8 B to 64 MiB), every implementation runs on the same ranks:

    dk        our Communicator, algorithm="auto" (the cost model picks kind, chunks, engine)
    dk-gloo   ours with the inter-host leg forced onto Gloo (DK_INTER_HOST=gloo)
    dk-mpi    ours with the leg forced onto MPI (DK_INTER_HOST=mpi; under mpiexec only)
    gloo      torch.distributed on the flat gloo world group (dist.all_reduce, ...)
    mpich     MPI_Allreduce / MPI_Reduce_scatter_block / MPI_Allgather on MPI_COMM_WORLD

The ranks are started by MPICH's hydra with its manual launcher (``mpiexec -launcher manual``
on host0, each proxy started inside its host's namespaces) when mpi4py and mpiexec are present,
so MPI runs in the same processes; otherwise by ``torchrun --nnodes 2`` without the MPI rows.
Plain torch.empty tensors for every implementation. Correctness first (#wrong: elements that
differ from the exact sum of small integers, worst rank), then timing: implementations
alternate in blocks (a barrier, then back-to-back calls); a block's time is the slowest rank's
mean per call, the reported time the median over ``--blocks`` blocks. Columns follow
nccl-tests: time (us), busbw (GB/s) = algbw x 2(n-1)/n (all_reduce) or x (n-1)/n
(reduce_scatter, all_gather; S = the whole array), and busbw / ceiling. At 2 ranks per host an
all_reduce can reach 1.5 x the ceiling in busbw: the link must carry S each way, and the bus
factor counts the bytes moved inside the hosts too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

OPS = ("all_reduce", "reduce_scatter", "all_gather")
IMPLS = ("dk", "dk-gloo", "dk-mpi", "gloo", "mpich")
RANK_PORT = 29611  # the ranks' TCPStore on host0 (each run has a network of its own)


def parse_size(text: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = value[-1:] if value[-1:] in units else ""
    return int(value[: len(value) - len(unit)]) * units[unit]


def sizes(lo: int, hi: int, factor: int) -> List[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    if out[-1] != hi:
        out.append(hi)
    return out


def bus_factor(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/bench_multihost.py",
        description=__doc__.split("\n\n")[2],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--rates",
        nargs="+",
        default=["none", "10gbit", "1gbit"],
        help="link caps (tc rate), 'none' = uncapped",
    )
    p.add_argument("--ranks-per-host", nargs="+", type=int, default=[1, 2])
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("-b", "--minbytes", type=parse_size, default=8)
    p.add_argument("-e", "--maxbytes", type=parse_size, default=64 << 20)
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("--blocks", type=int, default=3, help="timed blocks per implementation")
    p.add_argument(
        "--iter-bytes",
        type=parse_size,
        default=256 << 20,
        help="calls per block: iter-bytes / size, within [--min-iters, --max-iters]",
    )
    p.add_argument("--min-iters", type=int, default=2)
    p.add_argument("--max-iters", type=int, default=50)
    p.add_argument("--streams", type=int, default=4, help="TCP streams of the ceiling probe")
    p.add_argument("--probe-seconds", type=float, default=3.0)
    p.add_argument("--launcher", choices=("auto", "mpiexec", "torchrun"), default="auto")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per launch")
    p.add_argument("--out", help="write the tables and the machine, date, load and command here")
    p.add_argument("--json", help="write every row as JSON here")
    p.add_argument(
        "--phases",
        action="store_true",
        help="instead of the tables: where dk's all_reduce spends its time (2 ranks per host)",
    )
    p.add_argument("--rank", nargs=2, metavar=("RESULT", "MASTER"), help=argparse.SUPPRESS)
    return p


# ---------------------------------------------------------------------------------------------
# On every rank (inside the emulated hosts)


def _init_rank(master: str):
    """torch.distributed (gloo) on every rank; under MPI the ranks come from MPI_COMM_WORLD."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=600)
    mpi = None
    if "PMI_RANK" in os.environ:
        from mpi4py import MPI

        mpi = MPI.COMM_WORLD
        rank, n = mpi.Get_rank(), mpi.Get_size()
        store = dist.TCPStore(master, RANK_PORT, n, rank == 0, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return mpi


def _communicator(engine: Optional[str]):
    import dist_kernels as dk

    if engine:
        os.environ["DK_INTER_HOST"] = engine
    try:
        return dk.Communicator(timeout=datetime.timedelta(seconds=600))
    finally:
        os.environ.pop("DK_INTER_HOST", None)


def _runners(impls, mpi) -> Dict[str, Any]:
    """impl -> function(op, out, inp) running one collective (all_reduce: in place on inp)."""
    import torch.distributed as dist

    out: Dict[str, Any] = {}
    engines = {"dk": None, "dk-gloo": "gloo", "dk-mpi": "mpi"}
    for impl in impls:
        if impl in engines and (impl != "dk-mpi" or mpi is not None):
            comm = _communicator(engines[impl])
            out[impl] = lambda op, o, i, c=comm: (
                c.all_reduce(i) if op == "all_reduce" else getattr(c, op)(o, i)
            )
            out[impl].communicator = comm
    if "gloo" in impls:
        calls = {
            "all_reduce": lambda o, i: dist.all_reduce(i),
            "reduce_scatter": dist.reduce_scatter_tensor,
            "all_gather": dist.all_gather_into_tensor,
        }
        out["gloo"] = lambda op, o, i: calls[op](o, i)
    if "mpich" in impls and mpi is not None:
        out["mpich"] = _mpi_runner(mpi)
    return out


def _mpi_runner(mpi):
    from mpi4py import MPI

    def run(op, o, i):
        if op == "all_reduce":
            mpi.Allreduce(MPI.IN_PLACE, i.numpy(), op=MPI.SUM)
        elif op == "reduce_scatter":
            mpi.Reduce_scatter_block(i.numpy(), o.numpy(), op=MPI.SUM)
        else:
            mpi.Allgather(i.numpy(), o.numpy())

    return run


def _case(op: str, size: int, rank: int, n: int):
    """(out, inp, expected) of fp32 ``op`` on ``size`` bytes (the whole array for RS / AG)."""
    import torch

    count = max(1, size // 4)
    if op != "all_reduce":
        count = max(n, count // n * n)
    pattern = lambda r, c: (torch.arange(c) % 7 + r).float()  # noqa: E731
    if op == "all_reduce":
        inp = pattern(rank, count)
        return None, inp, sum(pattern(r, count) for r in range(n))
    if op == "reduce_scatter":
        chunk = count // n
        total = sum(pattern(r, count) for r in range(n))
        return torch.empty(chunk), pattern(rank, count), total[rank * chunk : (rank + 1) * chunk]
    piece = count // n
    out = torch.empty(piece * n)
    return out, pattern(rank, piece), torch.cat([pattern(r, piece) for r in range(n)])


def _wrong(runner, op, size, rank, n) -> int:
    out, inp, expected = _case(op, size, rank, n)
    runner(op, out, inp)
    got = inp if op == "all_reduce" else out
    return int((got != expected).sum())


def _time_block(runner, op, out, inp, iters: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        runner(op, out, inp)
    return (time.perf_counter() - start) / iters


def _measure(runners, op, size, args, rank, n) -> Dict[str, Dict[str, float]]:
    import torch
    import torch.distributed as dist

    names = sorted(runners)
    wrong = torch.tensor(
        [_wrong(runners[i], op, size, rank, n) for i in names], dtype=torch.float64
    )
    out, inp, _ = _case(op, size, rank, n)
    nbytes = inp.numel() * 4 * (n if op == "all_gather" else 1)
    iters = min(args.max_iters, max(args.min_iters, args.iter_bytes // max(nbytes, 1)))
    for name in names:  # warm-up: connections, staging buffers
        runners[name](op, out, inp)
    blocks = torch.zeros(args.blocks, len(names), dtype=torch.float64)
    for b in range(args.blocks):
        for j, name in enumerate(names):
            blocks[b, j] = _time_block(runners[name], op, out, inp, iters)
    dist.all_reduce(blocks, op=dist.ReduceOp.MAX)  # a block lasts as long as its slowest rank
    dist.all_reduce(wrong, op=dist.ReduceOp.MAX)
    result = {}
    for j, name in enumerate(names):
        t = statistics.median(blocks[:, j].tolist())
        algbw = nbytes / t / 1e9
        result[name] = {
            "time_us": t * 1e6,
            "algbw": algbw,
            "busbw": algbw * bus_factor(op, n),
            "wrong": int(wrong[j]),
            "iters": iters,
        }
    return result


def rank_main(args) -> int:
    import torch.distributed as dist

    result_path, master = args.rank
    mpi = _init_rank(master)
    if args.phases:
        return phases_main(args, result_path)
    rank, n = dist.get_rank(), dist.get_world_size()
    runners = _runners(args.impls, mpi)
    dk_choices = {}
    rows = []
    for op in args.ops:
        for size in sizes(args.minbytes, args.maxbytes, args.stepfactor):
            rows.append(
                {"op": op, "size": size, "impls": _measure(runners, op, size, args, rank, n)}
            )
            if "dk" in runners:
                dk_choices[f"{op} {size}"] = _dk_choice(runners["dk"].communicator, op, size, n)
    if rank == 0:
        with open(result_path + ".tmp", "w") as f:
            json.dump(
                {"world_size": n, "rows": rows, "dk_choices": dk_choices, "mpi": mpi is not None}, f
            )
        os.replace(result_path + ".tmp", result_path)
    dist.barrier()
    dist.destroy_process_group()
    return 0


# The phase profile (--phases): dk's multi-leader all_reduce taken apart, every part timed on
# the same ranks as flat Gloo and the whole, so each part reads as a fraction of flat Gloo.
PHASES = (
    "gloo (flat)",
    "dk auto",
    "dk x1",
    "dk x2",
    "dk x4",
    "dk x8",
    "host reduce-scatter",
    "cross all-reduce, every group",
    "cross all-reduce, group 0 alone",
    "host all-gather",
    "3 phases in turn, 1 chunk",
)


def _phase_runners(comm):
    """PHASES -> a call on ``S``-byte all-reduce buffers (full, slice: what a rank holds)."""
    import torch
    import torch.distributed as dist

    from dist_kernels.dtypes import DTYPE_CODES, ReduceOp

    be = comm._backend
    f32, sum_ = DTYPE_CODES[torch.float32], int(ReduceOp.SUM)

    def forced(chunks):
        def run(full, part):
            be.settings.kind, be.settings.chunks = "multi_leader", chunks
            be._choices.clear()
            try:
                comm.all_reduce(full)
            finally:
                be.settings.kind, be.settings.chunks = "auto", 0
                be._choices.clear()

        return run

    def rs(full, part):
        be.local.reduce_scatter(part, full, f32, sum_, 0, False)

    def ag(full, part):
        be.local.all_gather(full, part, f32, 0, False)

    def cross(full, part):
        be._cross("gloo", "all_reduce", part, ReduceOp.SUM).wait()

    def cross0(full, part):
        if be.cross_index == 0:
            cross(full, part)

    def in_turn(full, part):
        rs(full, part)
        cross(full, part)
        ag(full, part)

    return dict(
        zip(
            PHASES,
            (
                lambda full, part: dist.all_reduce(full),
                lambda full, part: comm.all_reduce(full),
                forced(1),
                forced(2),
                forced(4),
                forced(8),
                rs,
                cross,
                cross0,
                ag,
                in_turn,
            ),
        )
    )


def phases_main(args, result_path: str) -> int:
    """--phases on every rank: medians over blocks of the slowest rank's mean per call."""
    import torch
    import torch.distributed as dist

    comm = _communicator("gloo")
    n, local = dist.get_world_size(), comm._backend.local_n
    if local != 2 or n != 4:
        raise SystemExit(f"--phases: 2 hosts x 2 ranks only (got {n} ranks, {local} per host)")
    runners = _phase_runners(comm)
    rows = []
    for size in sizes(max(args.minbytes, 64 << 10), args.maxbytes, args.stepfactor):
        full = torch.ones(size // 4 // local * local)
        part = torch.ones(full.numel() // local)
        iters = min(args.max_iters, max(args.min_iters, args.iter_bytes // size))
        for run in runners.values():  # warm-up
            run(full, part)
        blocks = torch.zeros(args.blocks, len(PHASES), dtype=torch.float64)
        for b in range(args.blocks):
            for j, run in enumerate(runners.values()):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    run(full, part)
                blocks[b, j] = (time.perf_counter() - start) / iters
        dist.all_reduce(blocks, op=dist.ReduceOp.MAX)
        times = {p: statistics.median(blocks[:, j].tolist()) * 1e6 for j, p in enumerate(PHASES)}
        choice = _dk_choice(comm, "all_reduce", size, n)
        rows.append({"size": size, "iters": iters, "us": times, "dk_choice": choice})
    if dist.get_rank() == 0:
        with open(result_path + ".tmp", "w") as f:
            json.dump({"world_size": n, "phases": rows}, f)
        os.replace(result_path + ".tmp", result_path)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def phase_table(rate: str, result: Dict[str, Any]) -> List[str]:
    """Each part's time, and its fraction of flat Gloo's all_reduce of the same size."""
    head = "| size | " + " | ".join(PHASES) + " | dk auto's choice |"
    lines = [
        f"### where dk's all_reduce spends its time, 2 hosts x 2 ranks, link {rate}",
        "",
        "us per call (slowest rank), and / flat gloo's time",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for r in result["phases"]:
        base = r["us"]["gloo (flat)"]
        cells = [f"{r['us'][p]:.0f} ({r['us'][p] / base:.2f})" for p in PHASES]
        lines.append(f"| {_human(r['size'])} | " + " | ".join(cells) + f" | {r['dk_choice']} |")
    return lines + [""]


def _dk_choice(comm, op: str, size: int, n: int) -> str:
    """What dk's auto ran at this size: its communicator's choice (rank 0's settings)."""
    _, inp, _ = _case(op, size, 0, n)
    nbytes = inp.numel() * 4 * (n if op == "all_gather" else 1)
    c = comm._backend._choice(op, nbytes)
    return f"{c.kind} x{c.chunks} {c.engine}"


# ---------------------------------------------------------------------------------------------
# The driver (outside the namespaces)


def probe_ceiling(hosts, streams: int, seconds: float) -> float:
    """Bytes per second that ``streams`` TCP streams carry from host0 to host1."""
    probe = os.path.join(ROOT, "tools", "link_probe.py")
    server = hosts.popen(1, [sys.executable, probe, "server", "--streams", str(streams)])
    client = hosts.popen(
        0,
        [
            sys.executable,
            probe,
            "client",
            hosts.address(1),
            "--streams",
            str(streams),
            "--seconds",
            str(seconds),
        ],
    )
    hosts.wait([server, client], 120 + seconds)
    for line in client.output.splitlines():
        if line.startswith("ceiling_bytes_per_s="):
            return float(line.split("=", 1)[1])
    raise RuntimeError(f"link probe printed no result:\n{client.output}\n{server.output}")


def _use_mpiexec(launcher: str) -> bool:
    have = shutil.which("mpiexec") is not None
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        have = False
    if launcher == "mpiexec" and not have:
        raise SystemExit("--launcher mpiexec: mpiexec or mpi4py is missing (pip install '.[mpi]')")
    return have and launcher != "torchrun"


def _mpiexec_manual(hosts, per_host: int, argv: List[str], env, timeout: float):
    """hydra's manual launcher: mpiexec on host0 prints one proxy command per host, which we
    start inside that host's namespaces."""
    names = ",".join(hosts.host_name(h) for h in range(hosts.hosts))
    launcher = hosts.popen(
        0,
        [
            "mpiexec",
            "-launcher",
            "manual",
            "-hosts",
            names,
            "-ppn",
            str(per_host),
            "-n",
            str(per_host * hosts.hosts),
            *argv,
        ],
        env=env,
    )
    commands: List[str] = []
    deadline = time.monotonic() + 60
    while len(commands) < hosts.hosts:
        lines = launcher.output.splitlines()
        commands = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("HYDRA_LAUNCH:")]
        if time.monotonic() > deadline or launcher.proc.poll() is not None:
            raise RuntimeError(f"mpiexec printed no proxy commands:\n{launcher.output}")
        time.sleep(0.05)
    proxies = [hosts.popen(h, ["sh", "-c", cmd], env=env) for h, cmd in enumerate(commands)]
    hosts.wait([launcher, *proxies], timeout)
    return [launcher, *proxies]


def launch(hosts, per_host: int, args, result_path: str) -> Dict[str, Any]:
    rank_args = [
        os.path.abspath(__file__),
        "--rank",
        result_path,
        hosts.address(0),
        "--ops",
        *args.ops,
        "--impls",
        *args.impls,
        "-b",
        str(args.minbytes),
        "-e",
        str(args.maxbytes),
        "-f",
        str(args.stepfactor),
        "--blocks",
        str(args.blocks),
        "--iter-bytes",
        str(args.iter_bytes),
        "--min-iters",
        str(args.min_iters),
        "--max-iters",
        str(args.max_iters),
        *(["--phases"] if args.phases else []),
    ]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DK_NUM_THREADS": "1"}
    if _use_mpiexec(args.launcher) and not args.phases:
        procs = _mpiexec_manual(hosts, per_host, [sys.executable, *rank_args], env, args.timeout)
    else:
        procs = hosts.torchrun(rank_args, per_host, env=env)
        hosts.wait(procs, args.timeout)
    if not os.path.exists(result_path):
        logs = "\n".join(f"--- {p.host}:\n{p.output[-4000:]}" for p in procs)
        raise RuntimeError(f"the ranks wrote no result:\n{logs}")
    with open(result_path) as f:
        return json.load(f)


def table(op: str, per_host: int, rate: str, ceiling: float, result: Dict[str, Any]) -> List[str]:
    rows = [r for r in result["rows"] if r["op"] == op]
    impls = sorted(rows[0]["impls"], key=IMPLS.index)
    head = "| size | " + " | ".join(f"{i} us | {i} busbw | {i} /ceil | #wrong" for i in impls)
    ratios = [i for i in ("gloo", "mpich") if i in impls and "dk" in impls]
    head += "".join(f" | dk/{i} busbw" for i in ratios) + " | dk's choice |"
    lines = [
        f"### {op}, 2 hosts x {per_host} ranks, link {rate} (ceiling {ceiling / 1e9:.3f} GB/s)",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for r in rows:
        cells = [_human(r["size"])]
        for i in impls:
            c = r["impls"][i]
            cells += [
                f"{c['time_us']:.1f}",
                f"{c['busbw']:.3f}",
                f"{c['busbw'] * 1e9 / ceiling:.2f}",
                str(c["wrong"]),
            ]
        for i in ratios:
            cells.append(f"{r['impls']['dk']['busbw'] / r['impls'][i]['busbw']:.2f}")
        cells.append(result.get("dk_choices", {}).get(f"{op} {r['size']}", ""))
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def _human(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _meta(argv: Sequence[str]) -> List[str]:
    sys.path.insert(0, ROOT)
    from dist_kernels.bench import report

    machine = report.machine_info()
    load = os.getloadavg()
    return [
        f"- date: {report.utc_now()}",
        f"- command: `{' '.join(['python', 'benchmarks/bench_multihost.py', *argv])}`",
        f"- machine: {machine}",
        f"- load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        "",
    ]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.rank:
        return rank_main(args)
    from emulated_hosts import EmulatedHosts, missing_requirements

    reason = missing_requirements()
    if reason:
        print(f"bench_multihost: {reason}", file=sys.stderr)
        return 2
    lines = ["# Collectives across 2 emulated hosts", "", *_meta(argv)]
    everything = []
    for rate in args.rates:
        with EmulatedHosts(2, rate=None if rate == "none" else rate) as hosts:
            ceiling = probe_ceiling(hosts, args.streams, args.probe_seconds)
            print(
                f"# link {rate}: ceiling {ceiling / 1e9:.3f} GB/s ({args.streams} TCP streams)",
                flush=True,
            )
            if args.phases:
                result = launch(hosts, 2, args, os.path.join(hosts._dir, "phases.json"))
                everything.append({"rate": rate, "load": os.getloadavg()[0], **result})
                block = phase_table(rate, result)
                print("\n".join(block), flush=True)
                lines += block
                continue
            for per_host in args.ranks_per_host:
                path = os.path.join(hosts._dir, f"result-{per_host}.json")
                result = launch(hosts, per_host, args, path)
                everything.append(
                    {
                        "rate": rate,
                        "ceiling": ceiling,
                        "per_host": per_host,
                        "load": os.getloadavg()[0],
                        **result,
                    }
                )
                for op in args.ops:
                    block = table(op, per_host, rate, ceiling, result)
                    print("\n".join(block), flush=True)
                    lines += block
    lines.append(f"- load average at the end: {os.getloadavg()[0]:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
