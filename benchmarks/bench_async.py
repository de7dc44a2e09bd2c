"""Synchronous vs asynchronous training: time to a target loss, with a straggler or a slow link.

    python benchmarks/bench_async.py [--nproc 3] [--steps 150] [--target 0.02 0.015] \
        [--png benchmarks/results/async.png] [--json out.json]

Spawns ``--nproc`` CPU ranks (``dist_kernels.launch``: a gloo process group, one torch thread
each) that train the same small MLP student on a fixed random teacher (MSE regression, fresh
batches per rank and step) with six methods: synchronous DDP (dk.DistributedDataParallel),
LocalSGD with H = 4 and 16 (plain averaging), and the ParameterServer (server on rank 0, every
rank a worker) in sync, bounded(2) and async mode. Every method runs under three conditions in
the same processes:

- ``none``: nothing simulated;
- ``straggler``: the last rank is 50% slower (after each step's compute it sleeps half of it);
- ``slow_link``: every message (each send, isend and all_reduce call) is delayed ``--link-ms``.

A step's compute is the real forward/backward plus ``--compute-ms`` of simulated work (a sleep:
on a shared machine a sleep is a steadier stand-in for a bigger model than more arithmetic).
Rank 0 evaluates its current model on a held-out set after every step; it reports the
wall-clock time at which that loss first reaches each ``--target`` and the loss after the last step.
Every rank does ``--steps`` steps, so in async modes the fast ranks do not wait for the slow.
All methods use SGD with lr 0.05 and momentum 0.9, except the servers of the bounded and async
modes, which use ``--async-momentum`` (0.5): asynchrony adds implicit momentum (Mitliagkas et
al., 2016, "Asynchrony begets momentum"), and at 0.9 those modes oscillate.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

METHODS = ["ddp", "local_sgd_h4", "local_sgd_h16", "ps_sync", "ps_bounded2", "ps_async"]
CONDITIONS = ["none", "straggler", "slow_link"]
SEED = 77
_link_delay_s = 0.0  # set per run; read by the patched Communicator methods


def _delay_messages() -> None:
    """Wraps the Communicator's message-sending calls with a sleep of ``_link_delay_s``."""
    from dist_kernels.comm.communicator import Communicator

    for name in ("send", "isend", "all_reduce"):
        original = getattr(Communicator, name)

        def delayed(self, *args, _original=original, **kwargs):
            if _link_delay_s:
                time.sleep(_link_delay_s)
            return _original(self, *args, **kwargs)

        setattr(Communicator, name, delayed)


def _mlp(width_in: int, hidden: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(width_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
        nn.Linear(hidden, 1),
    )  # fmt: skip


class Task:
    """Student-teacher regression; batches depend only on (rank, step), so runs compare."""

    def __init__(self, batch: int) -> None:
        self.teacher = _mlp(16, 32, SEED + 1).requires_grad_(False)
        self.teacher[-1].weight.mul_(4)  # targets of variance ~0.3: a few dozen steps to learn
        self.batch = batch
        g = torch.Generator().manual_seed(SEED + 2)
        self.eval_x = torch.randn(512, 16, generator=g)
        self.eval_y = self.teacher(self.eval_x)

    def batch_for(self, rank: int, step: int):
        g = torch.Generator().manual_seed(SEED + 10_000 * rank + step)
        x = torch.randn(self.batch, 16, generator=g)
        return x, self.teacher(x) + 0.01 * torch.randn(self.batch, 1, generator=g)

    @torch.no_grad()
    def eval_loss(self, model: nn.Module) -> float:
        return nn.functional.mse_loss(model(self.eval_x), self.eval_y).item()


def _compute(model, task, rank, step, args, slow: bool) -> None:
    """Forward/backward plus simulated work; a straggler takes 50% longer."""
    start = time.perf_counter()
    model.zero_grad()
    x, y = task.batch_for(rank, step)
    nn.functional.mse_loss(model(x), y).backward()
    time.sleep(args.compute_ms / 1e3)
    if slow:
        time.sleep(0.5 * (time.perf_counter() - start))


def _sgd(params, momentum: float = 0.9):
    return torch.optim.SGD(params, lr=0.05, momentum=momentum)


def _train(method: str, comm, task, args, slow: bool) -> List[tuple]:
    """One run; returns rank 0's (seconds since start, eval loss) after each step."""
    import dist_kernels as dk

    rank = comm.rank
    model = _mlp(16, 64, SEED)
    curve = []
    comm.barrier()
    t0 = time.perf_counter()
    if method.startswith("ps_"):
        mode = {"ps_sync": "sync", "ps_bounded2": "bounded", "ps_async": "async"}[method]
        staleness = 2 if mode == "bounded" else 0
        momentum = 0.9 if mode == "sync" else args.async_momentum
        server_opt = functools.partial(_sgd, momentum=momentum)
        with dk.ParameterServer(model, comm, server_opt, mode=mode, max_staleness=staleness) as ps:
            ps.pull()
            for step in range(args.steps):
                _compute(model, task, rank, step, args, slow)
                ps.step()
                if rank == 0:
                    curve.append((time.perf_counter() - t0, task.eval_loss(model)))
        return curve
    engine = dk.DistributedDataParallel(model, comm) if method == "ddp" else model
    local = None
    if method.startswith("local_sgd"):
        local = dk.LocalSGD(model, comm, sync_every=int(method.rsplit("h", 1)[1]))
    opt = _sgd(model.parameters())
    for step in range(args.steps):
        _compute(engine, task, rank, step, args, slow)
        opt.step()
        if local is not None:
            local.step()
        if rank == 0:
            curve.append((time.perf_counter() - t0, task.eval_loss(model)))
    return curve


def _rank_main(args) -> Dict[str, Dict[str, List[tuple]]]:
    global _link_delay_s
    import dist_kernels as dk

    rank, world = dist.get_rank(), dist.get_world_size()

    _delay_messages()
    task = Task(args.batch)
    results: Dict[str, Dict[str, List[tuple]]] = {c: {} for c in CONDITIONS}
    warm_up = argparse.Namespace(**{**vars(args), "steps": 3})
    for method in args.methods:  # first-call costs (communicator set-up paths) stay out of timing
        with dk.Communicator() as comm:
            _train(method, comm, task, warm_up, slow=False)
    for condition in CONDITIONS:
        for method in args.methods:
            _link_delay_s = args.link_ms / 1e3 if condition == "slow_link" else 0.0
            slow = condition == "straggler" and rank == world - 1
            with dk.Communicator() as comm:
                results[condition][method] = _train(method, comm, task, args, slow)
            _link_delay_s = 0.0
            if rank == 0:
                print(f"  {condition:9s} {method:14s} done", flush=True)
    return results


def _time_to(curve, target: float):
    return next((t for t, loss in curve if loss <= target), None)


def _summarise(results, targets: List[float]) -> List[dict]:
    """One row per (condition, method); speed-ups against DDP of the same condition."""
    rows = []
    for condition in CONDITIONS:
        ddp = results[condition].get("ddp", [])
        for method in results[condition]:
            curve = results[condition][method]
            row = {"condition": condition, "method": method}
            for target in targets:
                hit, base = _time_to(curve, target), _time_to(ddp, target)
                row[f"t@{target}"] = hit
                row[f"vs_ddp@{target}"] = base / hit if (base and hit) else None
            row.update(final_loss=curve[-1][1], wall_s=curve[-1][0])
            rows.append(row)
    return rows


def _fmt(value, spec: str, missing: str) -> str:
    return format(value, spec) if value is not None else missing


def _print(rows, targets: List[float]) -> None:
    cols = "".join(f" time to {t} (s) | vs DDP |" for t in targets)
    print(f"\n| condition | method |{cols} final loss | run time (s) |")
    print("|---|---|" + "---:|---:|" * len(targets) + "---:|---:|")
    for r in rows:
        cells = "".join(
            f" {_fmt(r[f't@{t}'], '.2f', 'not hit')} | {_fmt(r[f'vs_ddp@{t}'], '.2f', '-')}x |"
            for t in targets
        )
        print(
            f"| {r['condition']} | {r['method']} |{cells} {r['final_loss']:.4f} | "
            f"{r['wall_s']:.2f} |"
        )


def _plot(results, targets: List[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CONDITIONS), figsize=(15, 4.5), sharey=True)
    for ax, condition in zip(axes, CONDITIONS):
        for method in results[condition]:
            t, loss = zip(*results[condition][method])
            ax.plot(t, loss, label=method)
        for target in targets:
            ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_title(f"condition: {condition}")
        ax.set_xlabel("wall-clock time on rank 0 (s)")
    axes[0].set_ylabel("held-out MSE (rank 0's model)")
    axes[-1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--link-ms", type=float, default=10.0)
    parser.add_argument("--target", type=float, nargs="+", default=[0.02, 0.015])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
    parser.add_argument(
        "--async-momentum",
        type=float,
        default=0.5,
        help="server momentum in bounded and async mode (the others use 0.9): staleness "
        "acts as extra momentum, and 0.9 oscillates there (docs/async.md)",
    )
    parser.add_argument("--png", help="write the loss-vs-time plot here")
    parser.add_argument("--json", help="write the rows and curves here")
    args = parser.parse_args()

    from dist_kernels import launch

    results = launch.run(args.nproc, _rank_main, args, threads=1, group_timeout=1800.0)[0]
    rows = _summarise(results, args.target)
    _print(rows, args.target)
    if args.png:
        _plot(results, args.target, args.png)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "curves": results}, f, indent=1)


if __name__ == "__main__":
    main()
