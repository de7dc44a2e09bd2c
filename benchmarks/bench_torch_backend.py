"""torch's own engines on the "dk" backend against the same engines on gloo, 2 CPU ranks.

    python benchmarks/bench_torch_backend.py [--nproc 2] [--steps 3] [--rounds 3]

Spawns its ranks (``dist_kernels.launch``: a gloo default group, one torch thread per rank)
and trains the ~20M-parameter transformer of bench_ddp.py with unmodified torch code:

- torch DDP (``DistributedDataParallel(model, process_group=...)``),
- FSDP2 (``fully_shard`` on every encoder layer and the root, over a 1-D DeviceMesh),

each once on the gloo group and once on a ``new_group(backend="dk")``, in the same processes,
alternating in rounds so that machine noise hits both alike. Prints the median step time
(forward, backward, SGD step) per engine and backend and the ratio dk / gloo, and, for DDP,
the same step under ``no_sync()`` (no communication): the difference is the communication
that backward did not hide, the most any backend can save.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_ddp import _make_model, _step, add_model_args  # noqa: E402

from dist_kernels import launch  # noqa: E402

BACKENDS = ("gloo", "dk")


def _ddp(args, group):
    return torch.nn.parallel.DistributedDataParallel(
        _make_model(args), process_group=group, bucket_cap_mb=args.bucket_mb
    )


def _fsdp2(args, group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    model = _make_model(args)
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model.blocks.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


ENGINES = {"torch DDP": _ddp, "FSDP2": _fsdp2}


def _time_steps(model, opt, batches, steps: int, sync: bool = True) -> float:
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        _step(model, opt, batches[i % len(batches)], sync)
    dist.barrier()
    return (time.perf_counter() - start) / steps


def _rank_main(args):
    rank = dist.get_rank()
    groups = {"gloo": dist.group.WORLD, "dk": dist.new_group(backend="dk")}
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)]
    runs = []
    for engine in args.engines:
        for backend in BACKENDS:
            model = ENGINES[engine](args, groups[backend])
            opt = torch.optim.SGD(model.parameters(), lr=1e-4)
            for _ in range(2):  # warm-up (DDP's first-iteration bucket rebuild, FSDP2 lazy init)
                _step(model, opt, batches[0])
            runs.append((engine, backend, model, opt))
    results: Dict[str, Dict[str, List[float]]] = {}
    for _ in range(args.rounds):
        for engine, backend, model, opt in runs:
            seconds = _time_steps(model, opt, batches, args.steps)
            results.setdefault(engine, {}).setdefault(backend, []).append(seconds)
            if engine == "torch DDP":  # the same step without communication (no_sync)
                local = _time_steps(model, opt, batches, args.steps, sync=False)
                results.setdefault("DDP no_sync", {}).setdefault(backend, []).append(local)
    nparams = sum(p.numel() for p in _make_model(args).parameters())
    return nparams, results, os.getloadavg()


def print_rows(results: Dict[str, Dict[str, List[float]]], width: int) -> List[dict]:
    """One row per engine: the median seconds per step on each backend, in ms, and dk / gloo;
    printed, and returned for the JSON file."""
    print(f"{'engine':>{width}} {'gloo ms':>9} {'dk ms':>9} {'dk / gloo':>9}")
    rows = []
    for engine, by in results.items():
        gloo, dk = (statistics.median(by[b]) * 1e3 for b in BACKENDS)
        rows.append({"engine": engine, "gloo_ms": gloo, "dk_ms": dk, "ratio": dk / gloo})
        print(f"{engine:>{width}} {gloo:>9.1f} {dk:>9.1f} {dk / gloo:>9.2f}")
    return rows


def write_json(path: str, args, rows: List[dict], raw) -> None:
    with open(path, "w") as f:
        json.dump({"args": vars(args), "rows": rows, "raw": raw}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--engines", nargs="+", choices=sorted(ENGINES), default=list(ENGINES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    add_model_args(parser)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    start_load = os.getloadavg()
    nparams, results, end_load = launch.run(
        args.nproc, _rank_main, args, threads=1, group_timeout=600.0
    )[0]
    print(
        f"# bench_torch_backend: {nparams / 1e6:.1f}M-parameter transformer, {args.nproc} CPU "
        f"ranks, batch {args.batch} x seq {args.seq} per rank, {args.rounds} rounds x "
        f"{args.steps} steps (median); load average {start_load[0]:.1f} at start, "
        f"{end_load[0]:.1f} at end on {os.cpu_count()} cpus (machine shared: timings noisy)"
    )
    rows = print_rows(results, width=11)
    if "DDP no_sync" in results:
        by = {r["engine"]: r for r in rows}
        exposed = {b: by["torch DDP"][f"{b}_ms"] - by["DDP no_sync"][f"{b}_ms"] for b in BACKENDS}
        print(
            "# torch DDP step minus its no_sync step (communication not hidden by backward): "
            + ", ".join(f"{b} {ms:.1f} ms" for b, ms in exposed.items())
        )
    if args.json:
        write_json(args.json, args, rows, results)


if __name__ == "__main__":
    main()
