"""Pipeline schedules beside torch.distributed.pipelining, same run, with the simulator's guess.

    python benchmarks/bench_pipeline.py                    # 2 and 4 CPU ranks, every schedule
    python benchmarks/bench_pipeline.py --nproc 2 --schedules 1f1b,zb-h1 --iters 20

Spawns its own ranks (``dist_kernels.launch``: a gloo process group, one torch thread each).
Every schedule of ours (``dk.Pipeline``) and its torch counterpart train the same model (an MLP
split evenly) on the same batches: GPipe, 1F1B, interleaved 1F1B, ZB-H1 against torch's ZB1P
(``ScheduleInterleavedZeroBubble`` with one stage per rank), ZB-V against
``ScheduleZBVZeroBubble``, DualPipeV against ``ScheduleDualPipeV``; ZB-H2 has no torch
counterpart. All engines step in turn inside each timed round, so noise from a shared machine
hits every row alike and rows compare with each other.

Correctness first: after one step of ours and of torch's (ZB-H2: torch's 1F1B) from the same
model on the same batch, the loss, every gradient and every parameter of each rank's stages
must agree (max relative difference at most ``--tolerance``), or every rank stops before
anything is timed.

The simulator's prediction beside each row: ``Pipeline.profile()`` times every action of our
pipeline on this model (means per stage, the send and receive costs, a ping-pong for the
latency), one profiled step in each timed round, so that the profile sees the same moments of
a shared machine's load as the timed steps (with three consecutive profiled steps before the
rounds, the errors spread from -40% to +76% over three runs on the shared 2-core machine);
``dk.pipeline.simulate`` turns the rounds' profiles, averaged, into a step time, and the row
shows it beside the measured median of ``Pipeline.step`` (the pipeline alone: no optimizer
step) and the error.

Columns: samples/s = batch / median step time (optimizer step included, for both engines);
bubble = 1 - (time this rank's stages take to compute the step alone, no pipeline, F and a full
backward per micro-batch, timed in the same rounds) / (step time), averaged over ranks: the
share of a step spent waiting, transferring or in the split's overhead; "ideal" = the
simulator's bubble at F = B = W. "ratio" = our samples/s / torch's. "step ms" and "mean ms":
the median and the mean ``Pipeline.step`` of the slowest rank, each with the simulator's error
against it (the simulator adds up mean action times, so the mean step is its like; the median
is the column samples/s uses).
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
from dist_kernels.pipeline.profiling import average_profiles  # noqa: E402

# ours -> torch's schedule class (None: no counterpart; checked against torch's 1F1B)
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "zb-h2": None,
    "zb-v": "ScheduleZBVZeroBubble",
    "dualpipe-v": "ScheduleDualPipeV",
}
SINGLE_STAGE = ("ScheduleGPipe", "Schedule1F1B")  # torch classes that take one stage


def _model(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


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
        self.pipe_seconds = 0.0  # the last Pipeline.step alone

    def step(self, x, y) -> None:
        self.opt.zero_grad()
        start = time.perf_counter()
        self.last_loss = self.pipe.step(x, y)  # on every rank: the engine broadcasts it
        self.pipe_seconds = time.perf_counter() - start
        self.opt.step()

    def loss(self) -> float:
        return self.last_loss.item()

    def stage_params(self):
        return {s: list(m.parameters()) for s, m in self.pipe.stages.items()}


class _Torch:
    def __init__(self, model, layout, torch_class, args):
        from torch.distributed import pipelining

        self.ids, n_stages = layout
        spans = plan_partition(model, n_stages)
        self.stages = [
            pipelining.PipelineStage(build_stage(model, spans[s]), s, n_stages, torch.device("cpu"))
            for s in self.ids
        ]
        cls = getattr(pipelining, torch_class)
        arg = self.stages[0] if torch_class in SINGLE_STAGE else self.stages
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
        holder = torch.tensor([dist.get_rank() if self.last else -1])
        dist.all_reduce(holder, op=dist.ReduceOp.MAX)  # rank 0 under V placement
        dist.broadcast(value, int(holder.item()))
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

    def __init__(self, model, layout, args):
        ids, n_stages = layout
        spans = plan_partition(model, n_stages)
        self.stages = [(s, build_stage(model, spans[s])) for s in ids]
        self.n_microbatches = args.microbatches

    def step(self, x, y) -> None:
        for stage_id, stage in self.stages:
            for mb in x.chunk(self.n_microbatches):
                inp = mb.detach().requires_grad_(stage_id > 0)  # as in the engines
                out = stage(inp)
                out.backward(torch.ones_like(out))


def _layout(schedule: str, world: int, rank: int, m: int):
    built = dk.pipeline.build_schedule(schedule, world, m)
    return built.stages_of(rank), built.n_stages


def _build(schedule, base, comm, x, y, args):
    """Our engine and torch's for ``schedule``, checked against each other on one step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = _layout(schedule, world, rank, args.microbatches)
    ours = _Ours(copy.deepcopy(base), comm, schedule, args)
    torch_class = TORCH_SCHEDULES[schedule]
    reference = _Torch(copy.deepcopy(base), layout, torch_class or "Schedule1F1B", args)
    first = _check_one_step(schedule, ours, reference, x, y, args.tolerance)
    return ours, (reference if torch_class else None), layout, first


def _worker(args) -> list:
    """This world size's rows (rank 0; the others return [])."""
    world, rank = dist.get_world_size(), dist.get_rank()
    comm = dk.Communicator()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randn(args.batch, args.width, generator=gen)
    base = _model(args.width, args.layers)
    engines, alone, first = {}, {}, {}
    for schedule in args.schedules:
        ours, theirs, layout, first[schedule] = _build(schedule, base, comm, x, y, args)
        key = tuple(layout[0])
        alone.setdefault(key, _Alone(copy.deepcopy(base), layout, args))
        engines[schedule] = (ours, theirs, alone[key])
    for _ in range(args.warmup):
        for ours, theirs, _ in engines.values():
            ours.step(x, y)
            if theirs is not None:
                theirs.step(x, y)
    times = {s: {"ours": [], "pipe": [], "torch": [], "alone": []} for s in engines}
    profiles = {s: [] for s in engines}
    for _ in range(args.iters):  # every engine once per round: machine noise hits all alike
        for schedule, (ours, theirs, yardstick) in engines.items():
            for name, engine in (("ours", ours), ("torch", theirs), ("alone", yardstick)):
                if engine is None:
                    continue
                dist.barrier()
                start = time.perf_counter()
                engine.step(x, y)
                times[schedule][name].append(time.perf_counter() - start)
            times[schedule]["pipe"].append(ours.pipe_seconds)
            profiles[schedule].append(ours.pipe.profile(x, y, steps=1))  # untimed
            ours.opt.zero_grad()
    predicted = {}
    for schedule, rounds in profiles.items():
        profile = average_profiles(rounds)
        predicted[schedule] = (profile, _predict(schedule, world, args.microbatches, profile))
    rows = []
    for schedule in engines:
        medians = {
            k: statistics.median(v) if v else float("nan") for k, v in times[schedule].items()
        }
        # the simulator turns mean action times into a step: its like is the mean step
        medians["pipe_mean"] = statistics.mean(times[schedule]["pipe"])
        gathered = [None] * world
        dist.all_gather_object(gathered, medians)
        if rank == 0:
            rows.append(_row(schedule, world, gathered, args, first[schedule], predicted[schedule]))
    comm.close()
    return rows


def _predict(schedule: str, world: int, m: int, profile: dict) -> float:
    return dk.pipeline.simulate(schedule, world, m, **profile).step_time


def _row(schedule, world, gathered, args, first, predicted) -> dict:
    step = {k: max(g[k] for g in gathered) for k in ("ours", "pipe", "pipe_mean", "torch")}
    alone = [g["alone"] for g in gathered]
    bubble = lambda s: 1 - statistics.mean(a / s for a in alone)  # noqa: E731
    profile, sim_step = predicted
    return {
        "ranks": world,
        "schedule": schedule,
        "torch_schedule": TORCH_SCHEDULES[schedule],
        "ours_samples_s": args.batch / step["ours"],
        "torch_samples_s": args.batch / step["torch"] if step["torch"] == step["torch"] else None,
        "ours_bubble": bubble(step["ours"]),
        "torch_bubble": bubble(step["torch"]) if step["torch"] == step["torch"] else None,
        "ideal_bubble": dk.pipeline.simulate(schedule, world, args.microbatches).bubble_fraction,
        "pipe_step_s": step["pipe"],
        "predicted_step_s": sim_step,
        "prediction_error": sim_step / step["pipe"] - 1,
        "pipe_step_mean_s": step["pipe_mean"],
        "prediction_error_mean": sim_step / step["pipe_mean"] - 1,
        "profile": profile,
        "first_step_rel_diff": first,
    }


def _print(results: list) -> None:
    head = (
        f"{'ranks':>5} {'schedule':>16} {'ours smp/s':>10} {'torch smp/s':>11} {'ratio':>5} "
        f"{'ours bub':>8} {'torch bub':>9} {'ideal':>5} {'step ms':>7} {'sim ms':>6} {'err':>5} "
        f"{'mean ms':>7} {'err':>5}"
    )
    print(head)
    for r in results:
        theirs = r["torch_samples_s"]
        print(
            f"{r['ranks']:>5} {r['schedule']:>16} {r['ours_samples_s']:>10.1f} "
            + (
                f"{theirs:>11.1f} {r['ours_samples_s'] / theirs:>5.2f} "
                if theirs
                else f"{'-':>11} {'-':>5} "
            )
            + f"{100 * r['ours_bubble']:>7.1f}% "
            + (f"{100 * r['torch_bubble']:>8.1f}% " if theirs else f"{'-':>9} ")
            + f"{100 * r['ideal_bubble']:>4.1f}% {1e3 * r['pipe_step_s']:>7.2f} "
            f"{1e3 * r['predicted_step_s']:>6.2f} {100 * r['prediction_error']:>+4.0f}% "
            f"{1e3 * r['pipe_step_mean_s']:>7.2f} {100 * r['prediction_error_mean']:>+4.0f}%"
        )


def _summary(results: list) -> None:
    """The zero-bubble claims, as ratios of rows measured in the same rounds."""
    for world in sorted({r["ranks"] for r in results}):
        rows = {r["schedule"]: r for r in results if r["ranks"] == world}
        base = rows.get("1f1b")
        for name in ("zb-h1", "zb-h2", "zb-v", "dualpipe-v"):
            if base is None or name not in rows:
                continue
            r = rows[name]
            speed = r["ours_samples_s"] / base["ours_samples_s"]
            bubble = r["ours_bubble"] / base["ours_bubble"]
            print(
                f"{world} ranks: {name} / 1f1b samples/s {speed:.3f}, bubble {bubble:.2f} of 1f1b's"
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
    unknown = sorted(set(args.schedules) - set(TORCH_SCHEDULES))
    if unknown:
        parser.error(f"unknown schedule(s) {unknown}; choose from {', '.join(TORCH_SCHEDULES)}")
    results = []
    for world in (int(n) for n in args.nproc.split(",")):
        results += launch.run(world, _worker, args, threads=1, group_timeout=1800.0)[0]
    print(
        f"MLP {args.layers} x Linear({args.width}) + ReLU, batch {args.batch}, "
        f"{args.microbatches} micro-batches, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
        "ours over dk.Communicator"
    )
    _print(results)
    _summary(results)
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
