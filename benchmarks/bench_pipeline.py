"""Pipeline engine throughput and bubble beside torch.distributed.pipelining, same run.

    python benchmarks/bench_pipeline.py                    # 2 and 4 CPU ranks, every schedule
    python benchmarks/bench_pipeline.py --nproc 2 --schedules 1f1b --iters 10

Spawns its own ranks (``dist_kernels.launch``: a gloo process group, one torch thread each).
For each world size and schedule both engines train the same model (an MLP split evenly) on
the same batches; steps alternate between the two engines so that noise from a shared machine
hits both alike.
Correctness first: after one step of each engine from the same model on the same batch, the
loss, every gradient and every parameter of each rank's stages must agree with torch's (max
relative difference at most ``--tolerance``, 1e-5 by default), or every rank stops before
anything is timed. A timed step is only the engine's own step: torch's loss stays on its last
rank (ours broadcasts its loss inside ``Pipeline.step``, so its time includes that).

Columns: samples/s = batch / median step time; bubble = 1 - (time this rank's stages take to
compute the step alone, no transfers, timed in the same rounds) / (step time), averaged over
ranks: the share of a step spent waiting or transferring. "ratio" = our samples/s / torch's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import dist_kernels as dk  # noqa: E402
from dist_kernels import launch  # noqa: E402
from dist_kernels.pipeline.partition import build_stage, plan_partition  # noqa: E402

TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
}


def _model(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


def _stage_ids(schedule: str, world: int, rank: int):
    per_rank = 2 if schedule == "interleaved-1f1b" else 1
    return list(range(rank, world * per_rank, world)), world * per_rank


class _Ours:
    def __init__(self, model, comm, schedule, args):
        self.pipe = dk.Pipeline(
            model,
            comm,
            n_microbatches=args.microbatches,
            schedule=schedule,
            loss_fn=nn.functional.mse_loss,
            print_partition=False,
        )
        self.opt = torch.optim.SGD(self.pipe.parameters(), lr=1e-3)
        self.last_loss = None

    def step(self, x, y) -> None:
        self.opt.zero_grad()
        self.last_loss = self.pipe.step(x, y)  # on every rank: the engine broadcasts it
        self.opt.step()

    def loss(self) -> float:
        return self.last_loss.item()

    def stage_params(self):
        return {s: list(m.parameters()) for s, m in self.pipe.stages.items()}


class _Torch:
    def __init__(self, model, schedule, args):
        from torch.distributed import pipelining

        world, rank = dist.get_world_size(), dist.get_rank()
        self.ids, n_stages = _stage_ids(schedule, world, rank)
        spans = plan_partition(model, n_stages)
        self.stages = [
            pipelining.PipelineStage(build_stage(model, spans[s]), s, n_stages, torch.device("cpu"))
            for s in self.ids
        ]
        cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
        arg = self.stages if schedule == "interleaved-1f1b" else self.stages[0]
        self.sched = cls(arg, args.microbatches, loss_fn=nn.functional.mse_loss)
        self.first, self.last = 0 in self.ids, n_stages - 1 in self.ids
        params = [p for st in self.stages for p in st.submod.parameters()]
        self.opt = torch.optim.SGD(params, lr=1e-3)
        self.losses = []

    def step(self, x, y) -> None:
        self.opt.zero_grad()
        self.losses = []
        args = (x,) if self.first else ()
        self.sched.step(*args, target=y if self.last else None, losses=self.losses)
        self.opt.step()

    def loss(self) -> float:
        """The last step's loss on every rank: a Gloo broadcast, never inside a timed step."""
        value = torch.stack(self.losses).mean().reshape(1) if self.last else torch.zeros(1)
        dist.broadcast(value, dist.get_world_size() - 1)
        return value.item()

    def stage_params(self):
        return {s: list(st.submod.parameters()) for s, st in zip(self.ids, self.stages)}


def _rel_diff(ours, theirs) -> float:
    scale = max(max(t.abs().max().item() for t in theirs), 1e-30)
    return max((a - b).abs().max().item() for a, b in zip(ours, theirs)) / scale


def _check_one_step(schedule, ours, theirs, x, y, tolerance) -> dict:
    """One step of each engine, then loss, gradients and parameters compared on every rank;
    every rank stops when any differs by more than ``tolerance``."""
    ours.step(x, y)
    theirs.step(x, y)
    losses = (ours.loss(), theirs.loss())
    mine, torch_stages = ours.stage_params(), theirs.stage_params()
    if sorted(mine) != sorted(torch_stages):
        raise SystemExit(
            f"{schedule}: stages differ: ours {sorted(mine)}, torch's {sorted(torch_stages)}"
        )
    ps = (
        [p for s in sorted(mine) for p in mine[s]],
        [p for s in sorted(mine) for p in torch_stages[s]],
    )
    diffs = torch.tensor(
        [
            abs(losses[0] - losses[1]) / max(1.0, abs(losses[1])),
            _rel_diff([p.grad for p in ps[0]], [p.grad for p in ps[1]]),
            _rel_diff([p.detach() for p in ps[0]], [p.detach() for p in ps[1]]),
        ]
    )
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    result = dict(zip(("loss", "grad", "param"), diffs.tolist()))
    if not all(d <= tolerance for d in result.values()):  # NaN stops too
        raise SystemExit(
            f"bench_pipeline: {schedule}: ours and torch's differ after one step (max relative "
            f"difference {result}, tolerance {tolerance:g}); losses {losses}; not timing it"
        )
    return result


class _Alone:
    """This rank's stages doing the step's compute with no pipeline: the bubble's yardstick."""

    def __init__(self, model, schedule, args):
        world, rank = dist.get_world_size(), dist.get_rank()
        ids, n_stages = _stage_ids(schedule, world, rank)
        spans = plan_partition(model, n_stages)
        self.stages = [(s, build_stage(model, spans[s])) for s in ids]
        self.n_microbatches = args.microbatches

    def step(self, x, y) -> None:
        for stage_id, stage in self.stages:
            for mb in x.chunk(self.n_microbatches):
                inp = mb.detach().requires_grad_(stage_id > 0)  # as in the engines
                out = stage(inp)
                out.backward(torch.ones_like(out))


def _worker(args) -> list:
    """This world size's rows (rank 0; the others return [])."""
    world, rank = dist.get_world_size(), dist.get_rank()
    comm = dk.Communicator()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randn(args.batch, args.width, generator=gen)
    rows = []
    for schedule in args.schedules:
        base = _model(args.width, args.layers)
        ours = _Ours(copy.deepcopy(base), comm, schedule, args)
        theirs = _Torch(copy.deepcopy(base), schedule, args)
        first = _check_one_step(schedule, ours, theirs, x, y, args.tolerance)
        for _ in range(args.warmup):
            ours.step(x, y), theirs.step(x, y)
        alone = _Alone(copy.deepcopy(base), schedule, args)
        times = {"ours": [], "torch": [], "alone": []}
        for _ in range(args.iters):  # alternate, so that machine noise hits all three alike
            for name, engine in (("ours", ours), ("torch", theirs), ("alone", alone)):
                dist.barrier()
                start = time.perf_counter()
                engine.step(x, y)
                times[name].append(time.perf_counter() - start)
        gathered = [None] * world
        medians = tuple(statistics.median(times[k]) for k in ("ours", "torch", "alone"))
        dist.all_gather_object(gathered, medians)
        if rank == 0:
            rows.append(_row(schedule, world, gathered, args, first))
    comm.close()
    return rows


def _row(schedule, world, gathered, args, first) -> dict:
    step_ours = max(g[0] for g in gathered)
    step_torch = max(g[1] for g in gathered)
    alone = [g[2] for g in gathered]
    bubble = lambda step: 1 - statistics.mean(a / step for a in alone)  # noqa: E731
    return {
        "ranks": world,
        "schedule": schedule,
        "ours_samples_s": args.batch / step_ours,
        "torch_samples_s": args.batch / step_torch,
        "ours_bubble": bubble(step_ours),
        "torch_bubble": bubble(step_torch),
        "ideal_bubble": dk.pipeline.simulate(
            dk.pipeline.build_schedule(schedule, world, args.microbatches)
        ).bubble_fraction,
        "first_step_rel_diff": first,
    }


def _print(results: list) -> None:
    head = (
        f"{'ranks':>5} {'schedule':>17} {'ours smp/s':>11} {'torch smp/s':>12} {'ratio':>6} "
        f"{'ours bubble':>12} {'torch bubble':>13} {'ideal':>6}"
    )
    print(head)
    for r in results:
        print(
            f"{r['ranks']:>5} {r['schedule']:>17} {r['ours_samples_s']:>11.1f} "
            f"{r['torch_samples_s']:>12.1f} {r['ours_samples_s'] / r['torch_samples_s']:>6.2f} "
            f"{100 * r['ours_bubble']:>11.1f}% {100 * r['torch_bubble']:>12.1f}% "
            f"{100 * r['ideal_bubble']:>5.1f}%"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", default="2,4", help="comma-separated world sizes")
    parser.add_argument("--schedules", default=",".join(TORCH_SCHEDULES))
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8, help="Linear+ReLU pairs")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=1e-5, help="correctness gate")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    args.schedules = args.schedules.split(",")
    results = []
    for world in (int(n) for n in args.nproc.split(",")):
        results += launch.run(world, _worker, args, threads=1, group_timeout=1800.0)[0]
    print(
        f"MLP {args.layers} x Linear({args.width}) + ReLU, batch {args.batch}, "
        f"{args.microbatches} micro-batches, {os.cpu_count()} CPUs; ours over dk.Communicator"
    )
    _print(results)
    worst = {
        k: max(r["first_step_rel_diff"][k] for r in results) for k in ("loss", "grad", "param")
    }
    print(
        "checked before timing, one step of each engine: max relative difference "
        + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
        + f" (tolerance {args.tolerance:g})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
