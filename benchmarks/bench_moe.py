"""MoE dispatch + combine, and an MoE GPT step, on ep CPU ranks: ours against torch over gloo.

    python benchmarks/bench_moe.py [--nproc 2,4] [--mib 1,2,4,8,16] [--dim 1024] [--iters 10]
        [--gpt-iters 5] [--seed 7] [--json f]

1. **Ceiling first**: one process copies S bytes (``Tensor.copy_``), median time: the memcpy
   ceiling a rank's dispatch + combine is compared with (each moves every byte once each way),
   one thread as each rank has.
2. **Dispatch + combine** per world size and S (MiB of tokens per rank, rows of ``--dim``
   float32): every row gets a random destination rank and the rows are stably sorted by it, as
   the layer's router order does (uneven counts, ascending rows within a destination); dispatch
   sends them, combine sends them back. Three ways, same ranks, same run:
   - ours: the layer's path on one host, ``dk.moe.push_rows`` (each row gathered once, straight
     into the receiver's shared memory; the result is that memory);
   - a2a: the layer's path elsewhere, ``exchange_rows`` (gathered into the registered buffer,
     copied out by the peer: ``Communicator.all_to_all``);
   - gloo: the same permutation and ``all_to_all_single`` over gloo (torchtitan's dispatch).
   Correctness first: all three results must be equal. GB/s per rank = 2 S / time (slowest
   rank, median of ``--iters``); "x memcpy" is ours over the ceiling's GB/s for S bytes.
3. **MoE GPT step** at ep = 2 (forward + backward, every block MoE, median of
   ``--gpt-iters``): the same model with its exchange on our Communicator and on torch
   ``all_to_all_single`` / ``all_gather_into_tensor`` over gloo (the layer's ``comm`` argument
   given a torch-backed stand-in), same ranks, same inputs; losses must agree. Beside them the
   unsharded model on each rank's own batch (every expert local, nothing exchanged): about the
   same expert work per rank, so the floor of any exchange's step time.

Timings on a loaded machine are loaded: the table prints the load average beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from typing import Any, Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dist_kernels as dk  # noqa: E402
from dist_kernels import launch  # noqa: E402
from dist_kernels.models import GPT, GPTConfig  # noqa: E402
from dist_kernels.moe.exchange import exchange_rows  # noqa: E402
from dist_kernels.moe.push import RowPlan, push_rows  # noqa: E402

MIB = 1 << 20


class TorchComm:
    """The two calls the MoE layer makes, on torch.distributed (gloo): the torchtitan way."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, inp, group=self.group)

    def all_to_all(self, out, inp, sends, recvs) -> None:
        # The layer passes flat views and element counts: torch's split sizes, as they are.
        dist.all_to_all_single(out, inp, list(recvs), list(sends), group=self.group)


def _median_slowest(times: List[float]) -> float:
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def memcpy_ceiling(mib: List[int], iters: int) -> Dict[int, float]:
    """GB/s of one thread's copy of S bytes, per S (a rank runs one torch thread too; more
    threads would also pay a pool wake-up per copy, milliseconds on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    for m in mib:
        src, dst = torch.ones(m * MIB // 4), torch.empty(m * MIB // 4)
        dst.copy_(src)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        out[m] = m * MIB / statistics.median(times) / 1e9
    torch.set_num_threads(threads)
    return out


def _dispatch_combine(comm, x, index, plan):
    arrived = push_rows(x, index, comm, plan)  # what the layer does on one host
    return push_rows(arrived, None, comm, plan.transposed())


def _a2a_dispatch_combine(comm, x, index, sends, recvs, rows):
    arrived = exchange_rows(x, index, comm, sends, recvs, rows)  # the layer's other path
    return exchange_rows(arrived, torch.arange(arrived.shape[0]), comm, recvs, sends, rows)


def _torch_dispatch_combine(group, x, index, sends, recvs):
    send = x.index_select(0, index)
    arrived = send.new_empty(sum(recvs), send.shape[1])
    dist.all_to_all_single(arrived, send, recvs, sends, group=group)
    back = torch.empty_like(send)
    dist.all_to_all_single(back, arrived, sends, recvs, group=group)
    return back


def _time(fn, iters: int) -> float:
    fn()  # warm-up (and the registered buffer's allocation)
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return _median_slowest(times)


def _routing(rows: int, n: int, seed: int):
    """A router's order: a random destination rank per row, rows stably sorted by it (as the
    layer sorts its assignments by expert); every rank's counts, gathered."""
    dest = torch.randint(0, n, (rows,), generator=torch.Generator().manual_seed(seed))
    index = torch.sort(dest, stable=True).indices
    mine = torch.bincount(dest, minlength=n)
    counts = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(counts, mine)
    return index, [c.tolist() for c in counts]


def _exchange_rows_worker(args) -> List[Dict[str, Any]]:
    comm, n, me = dk.Communicator(), dist.get_world_size(), dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    rows_out = []
    for m in args.mib:
        rows = m * MIB // (4 * args.dim)
        x = torch.randn(rows, args.dim, generator=torch.Generator().manual_seed(me))
        index, counts = _routing(rows, n, args.seed + me)
        plan = RowPlan.blocks(counts)
        sends, recvs = counts[me], [counts[s][me] for s in range(n)]
        room = max(max(sum(c) for c in counts), max(plan.recv_rows))
        ours = _dispatch_combine(comm, x, index, plan)
        a2a = _a2a_dispatch_combine(comm, x, index, sends, recvs, room)
        theirs = _torch_dispatch_combine(gloo, x, index, sends, recvs)
        wrong = int((ours != theirs).sum()) + int((a2a != theirs).sum())
        del ours, a2a, theirs
        t_ours = _time(partial(_dispatch_combine, comm, x, index, plan), args.iters)
        t_a2a = _time(
            partial(_a2a_dispatch_combine, comm, x, index, sends, recvs, room), args.iters
        )
        t_torch = _time(partial(_torch_dispatch_combine, gloo, x, index, sends, recvs), args.iters)
        rows_out.append(
            {
                "world": n,
                "mib": m,
                "ours_s": t_ours,
                "a2a_s": t_a2a,
                "torch_s": t_torch,
                "wrong": wrong,
            }
        )
    comm.close()
    return rows_out


def _gpt_worker(args) -> Dict[str, Any]:
    comm = dk.Communicator()
    gloo = TorchComm(dist.new_group(backend="gloo"))
    cfg = GPTConfig(
        vocab_size=256,
        block_size=args.seq,
        n_layers=2,
        n_heads=4,
        dim=args.gpt_dim,
        n_experts=8,
        top_k=2,
        moe_every=1,
    )
    ids = torch.randint(
        0, 256, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(dist.get_rank())
    )
    out = {}
    # "local": the unsharded model on this rank's batch, every expert here and no exchange:
    # about the same expert work per rank (each rank computes E / ep experts for ep ranks'
    # tokens at ep = 2), so its time is the floor any exchange could bring the step to.
    for name, c in (("ours", comm), ("torch", gloo), ("local", None)):
        torch.manual_seed(0)
        model = GPT(cfg) if c is None else GPT(cfg).expert_parallel(c)

        def step(model=model):
            model.zero_grad()
            loss = model(ids[:, :-1], ids[:, 1:])
            loss.backward()
            return loss.item()

        out[f"{name}_loss"] = step()
        out[f"{name}_s"] = _time(step, args.gpt_iters)
    comm.close()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", default="2,4")
    p.add_argument("--mib", default="1,2,4,8,16")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--gpt-iters", type=int, default=5)
    p.add_argument("--gpt-dim", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json")
    args = p.parse_args(argv)
    args.mib = [int(m) for m in args.mib.split(",")]
    ceiling = memcpy_ceiling(args.mib, max(args.iters, 20))
    load = os.getloadavg()[0]
    round_trip = dk.info.cross_core_round_trip_ns()  # the VM's vCPU placement (info.py)
    print(
        f"{os.cpu_count()} CPUs, load {load:.1f}, cache-line round trip between the first two "
        f"CPUs {round_trip and round(round_trip)} ns; memcpy ceiling (one process): "
        + ", ".join(f"{m} MiB {g:.2f} GB/s" for m, g in ceiling.items())
    )
    print(
        f"{'ranks':>5} {'MiB/rank':>8} {'ours GB/s':>10} {'x memcpy':>9} {'a2a GB/s':>9} "
        f"{'gloo GB/s':>10} {'x gloo':>7} {'#wrong':>6}"
    )
    table = []
    for world in (int(w) for w in args.nproc.split(",")):
        for r in launch.run(world, _exchange_rows_worker, args, threads=1)[0]:
            ours, a2a, theirs = (
                2 * r["mib"] * MIB / r[k] / 1e9 for k in ("ours_s", "a2a_s", "torch_s")
            )
            r.update(
                ours_gbs=ours,
                a2a_gbs=a2a,
                torch_gbs=theirs,
                x_memcpy=ours / ceiling[r["mib"]],
                x_gloo=ours / theirs,
            )
            table.append(r)
            print(
                f"{world:>5} {r['mib']:>8} {ours:>10.2f} {r['x_memcpy']:>9.2f} {a2a:>9.2f} "
                f"{theirs:>10.2f} "
                f"{r['x_gloo']:>7.2f} {r['wrong']:>6}"
            )
    gpt = launch.run(2, _gpt_worker, args, threads=1)[0]
    print(
        f"MoE GPT step, ep=2 (dim {args.gpt_dim}, seq {args.seq}, batch {args.batch}, 8 "
        f"experts top-2, every block MoE): ours {gpt['ours_s'] * 1e3:.1f} ms, torch "
        f"all_to_all_single/gloo {gpt['torch_s'] * 1e3:.1f} ms, ours/torch "
        f"{gpt['ours_s'] / gpt['torch_s']:.2f}; losses {gpt['ours_loss']:.6f} vs "
        f"{gpt['torch_loss']:.6f}; the unsharded model on one rank's batch (no exchange) "
        f"{gpt['local_s'] * 1e3:.1f} ms, {gpt['local_s'] / gpt['torch_s']:.2f} of torch's"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "load": load,
                    "cpu_round_trip_ns": round_trip,
                    "cpus": os.cpu_count(),
                    "ceiling_gbs": ceiling,
                    "exchange": table,
                    "gpt": gpt,
                    "argv": sys.argv,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
