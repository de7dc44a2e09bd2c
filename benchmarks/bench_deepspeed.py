"""DeepSpeed's ZeRO engines on the "dk" backend against the same engines on gloo, CPU ranks.

    python benchmarks/bench_deepspeed.py [--nproc 2] [--stages 1 2 3] [--steps 3] [--rounds 3]

DeepSpeed runs on the default group (``deepspeed.init_distributed(dist_backend=...)``), so
each backend gets a pool of ranks of its own (``dist_kernels.launch.LocalRanks``, one torch
thread per rank): one whose default group is gloo, one whose default group is dk. The pools
take turns, round after round, so that machine noise hits both alike; the idle pool's ranks
sleep in a pipe read. Each round, each pool builds a ``deepspeed.initialize`` engine per ZeRO
stage for the ~20M-parameter transformer of bench_ddp.py (torch AdamW as the client
optimizer, FP32 or BF16), takes two warm-up steps and times ``--steps`` steps (forward,
``engine.backward``, ``engine.step``). Prints the median step time per stage and backend and
the ratio dk / gloo. docs/integrations.md says what DeepSpeed runs on dk and how it is tested.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_ddp import _make_model, add_model_args  # noqa: E402
from bench_torch_backend import BACKENDS, print_rows, write_json  # noqa: E402

from dist_kernels.launch import LocalRanks  # noqa: E402


def _engine(args, stage: int):
    import deepspeed

    model = _make_model(args)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,  # torch's AdamW: no DeepSpeed op to compile
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": int(args.bucket_mb * 2**20 / 4),
            "allgather_bucket_size": int(args.bucket_mb * 2**20 / 4),
        },
        "bf16": {"enabled": args.dtype == "bf16"},
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=opt, config=config, dist_init_required=False
    )
    return engine


def _step(engine, tokens) -> float:
    logits = engine(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    engine.backward(loss)
    engine.step()
    return float(loss)


def _round(args) -> Dict[str, float]:
    """One round on this pool's default group: seconds per step for each ZeRO stage."""
    import deepspeed

    deepspeed.init_distributed(dist_backend=dist.get_backend())  # the group made: no-op
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    out = {}
    for stage in args.stages:
        engine = _engine(args, stage)
        for _ in range(2):  # warm-up: DeepSpeed's lazy buffers, the first bucket pass
            _step(engine, tokens)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            _step(engine, tokens)
        dist.barrier()
        out[f"ZeRO-{stage}"] = (time.perf_counter() - start) / args.steps
        engine.destroy()
    return out


def _env(nproc: int) -> Dict[str, List[str]]:
    """torchrun's variables, which DeepSpeed reads beside the group made by the pool."""
    ranks = [str(r) for r in range(nproc)]
    return {"RANK": ranks, "LOCAL_RANK": ranks, "WORLD_SIZE": [str(nproc)] * nproc}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--stages", nargs="+", type=int, choices=(1, 2, 3), default=[1, 2, 3])
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    add_model_args(parser)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    start_load = os.getloadavg()
    results: Dict[str, Dict[str, List[float]]] = {}
    pools = {b: LocalRanks(args.nproc, backend=b, threads=1, group_timeout=600.0) for b in BACKENDS}
    try:
        for _ in range(args.rounds):
            for backend, pool in pools.items():
                outcomes = pool.run(_round, (args,), env=_env(args.nproc), timeout=1800)
                bad = [o for o in outcomes if not isinstance(o, dict)]
                if bad:
                    raise RuntimeError(f"bench_deepspeed on {backend}: {bad[0]}")
                for stage in outcomes[0]:
                    slowest = max(o[stage] for o in outcomes)
                    results.setdefault(stage, {}).setdefault(backend, []).append(slowest)
    finally:
        for pool in pools.values():
            pool.close()
    import deepspeed

    nparams = sum(p.numel() for p in _make_model(args).parameters())
    end_load = os.getloadavg()
    print(
        f"# bench_deepspeed: DeepSpeed {deepspeed.__version__}, {nparams / 1e6:.1f}M-parameter "
        f"transformer, {args.dtype}, {args.nproc} CPU ranks, batch {args.batch} x seq "
        f"{args.seq} per rank, {args.rounds} rounds x {args.steps} steps (median of the "
        f"slowest rank's); load average {start_load[0]:.1f} at start, {end_load[0]:.1f} at end "
        f"on {os.cpu_count()} cpus"
    )
    rows = print_rows(results, width=8)
    if args.json:
        write_json(args.json, args, rows, results)


if __name__ == "__main__":
    main()
