"""Muon's optimizer step on data-parallel ranks: ours (Newton-Schulz dealt over the replicas)
against torch.optim.Muon + torch.optim.AdamW on every rank, same run.

    python benchmarks/bench_muon.py                       # 2 CPU ranks, GPT 6 x 512
    python benchmarks/bench_muon.py --layers 4 --d-model 768 --steps 8

Every rank holds the same GPT (``dist_kernels.models.GPT``) and the same gradients (random,
seeded: what DDP's all-reduce leaves on every replica), so the step is measured alone,
without forward, backward or gradient reduction. Configurations, each on a fresh copy:

* ``torch Muon + AdamW``: torch.optim.Muon on the hidden matrices and torch.optim.AdamW on
  the embeddings, the head, biases and norms, each rank stepping everything: what a torch DDP
  script does, and the baseline every ratio is taken against;
* ``dk Muon, every rank``: ``dk.optim.Muon`` without a communicator (the same work as torch);
* ``dk Muon, dealt over dp``: ``dk.optim.Muon(comm=world)``: each rank orthogonalises its
  share of the matrices, one all_gather of the BF16 results;
* ``dk Muon, ZeRO-1``: the same with ``shard_state=True``: each rank also keeps the state of,
  and steps, only its share (AdamW's parameters all-gathered after the step).

Before timing, one step of each configuration is compared with the baseline's: the parameters
must be equal bit for bit (the same BF16 Newton-Schulz, the same AdamW), else the run stops.
The configurations then run in ``--rounds`` alternated rounds of ``--steps`` timed steps (a
slow spell of the shared machine hits each of them); the median step is printed, the slowest
rank's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _model(args):
    from dist_kernels.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(
        n_layers=args.layers, n_heads=args.heads, dim=args.d_model, block_size=args.seq,
        vocab_size=args.vocab, tie_embeddings=False,
    )  # fmt: skip
    return GPT(cfg)


def _set_grads(model, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2


def _torch_pair(model, args):
    from dist_kernels.optim import muon_param_groups

    groups = muon_param_groups(model, weight_decay=0.1)
    muon = torch.optim.Muon(
        groups[0]["params"], lr=1e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"
    )
    adamw = torch.optim.AdamW(
        [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups[1:]],
        lr=1e-3, betas=(0.9, 0.95),
    )  # fmt: skip
    return [muon, adamw]


def _ours(comm, shard_state=False):
    def build(model, args):
        from dist_kernels.optim import Muon, muon_param_groups

        return [
            Muon(
                muon_param_groups(model, weight_decay=0.1), lr=1e-3,
                adjust_lr_fn="match_rms_adamw", adamw_betas=(0.9, 0.95), comm=comm,
                shard_state=shard_state,
            )
        ]  # fmt: skip

    return build


class _Config:
    """One configuration: its own copy of the model and its optimizers."""

    def __init__(self, name: str, build: Callable, args) -> None:
        self.name, self.model = name, _model(args)
        self.optimizers = build(self.model, args)
        self.times: List[float] = []
        self.step = 0

    def run(self, steps: int, timed: bool) -> None:
        for _ in range(steps):
            _set_grads(self.model, self.step)
            dist.barrier()
            t0 = time.perf_counter()
            for opt in self.optimizers:
                opt.step()
            if timed:
                self.times.append(time.perf_counter() - t0)
            self.step += 1

    @property
    def state_mb(self) -> float:
        return (
            sum(
                v.numel() * v.element_size()
                for o in self.optimizers
                for st in o.state.values()
                for v in st.values()
                if v.dim()
            )
            / 1e6
        )

    @property
    def matrices(self) -> int:
        return sum(getattr(o, "last_orthogonalized", 0) for o in self.optimizers)


def _check_first_step(configs: List[_Config]) -> None:
    """One step of each, then every configuration's parameters against the baseline's bits."""
    for c in configs:
        c.run(1, timed=False)
    reference = list(configs[0].model.parameters())
    for c in configs[1:]:
        if not all(torch.equal(a, b) for a, b in zip(c.model.parameters(), reference)):
            raise RuntimeError(
                f"rank {dist.get_rank()}: {c.name}: parameters differ from the baseline"
            )


def _worker(args) -> None:
    import dist_kernels as dk

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = dk.Communicator()
    configs = [
        _Config("torch Muon + AdamW", _torch_pair, args),
        _Config("dk Muon, every rank", _ours(None), args),
        _Config("dk Muon, dealt over dp", _ours(comm), args),
        _Config("dk Muon, ZeRO-1", _ours(comm, shard_state=True), args),
    ]
    _check_first_step(configs)
    for c in configs:
        c.run(args.warmup, timed=False)
    for _ in range(args.rounds):  # alternated: a slow spell of the machine hits every one
        for c in configs:
            c.run(args.steps, timed=True)
    medians = torch.tensor([statistics.median(c.times) for c in configs])
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the slowest rank's
    comm.close()
    if rank == 0:
        _report(args, world, configs, medians.tolist())


def _report(args, world: int, configs: List[_Config], medians: List[float]) -> None:
    from dist_kernels.optim import muon_param_groups

    model = configs[0].model
    hidden = muon_param_groups(model)[0]["params"]
    print(
        f"# {world} CPU ranks, {args.threads} thread(s) each; GPT {args.layers} x "
        f"{args.d_model} (vocab {args.vocab}), "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
        f"{len(hidden)} Muon matrices ({sum(p.numel() for p in hidden) / 1e6:.1f}M); median "
        f"of {args.rounds} alternated rounds x {args.steps} steps after {args.warmup}, slowest "
        "rank; every configuration's first step equal to the baseline's bit for bit"
    )
    print(
        f"{'config':26s} {'step ms':>9s} {'vs torch':>9s} {'NS matrices on rank 0':>22s} "
        f"{'state MB on rank 0':>19s}"
    )
    for c, ms in zip(configs, medians):
        shown = c.matrices or len(hidden)
        print(
            f"{c.name:26s} {ms * 1e3:9.1f} {medians[0] / ms:8.2f}x {shown:>22d} {c.state_mb:19.1f}"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    from dist_kernels import launch

    launch.run(args.ranks, _worker, args, threads=args.threads, group_timeout=1800.0)


if __name__ == "__main__":
    main()
