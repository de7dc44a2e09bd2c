"""Tensor-parallel GPT step time: dist_kernels.tensor_parallel against torch DTensor (gloo).

    python benchmarks/bench_tp.py [--tp 1 2 4] [--steps 20] [--dim 128 --seq 64 ...] [--json f]

For each tp size it spawns ``tp`` CPU ranks (``dist_kernels.launch``: a gloo process group, one
torch thread per rank). Every rank builds the same ``dist_kernels.models.GPT`` twice from one
seed and shards it two ways:

- **dk**: ``model.parallelize(comm)`` (ColumnParallelLinear / RowParallelLinear /
  VocabParallelEmbedding over our shared-memory Communicator, vocabulary-parallel loss);
- **dtensor**: ``torch.distributed.tensor.parallel.parallelize_module`` with torchtitan's plan
  (ColwiseParallel on qkv and fc, RowwiseParallel on the projections, RowwiseParallel on the
  embedding, ColwiseParallel head with a Shard(-1) output and ``loss_parallel``) over gloo.

Correctness first: both first-step losses must equal the unsharded model's. Then the two
engines alternate step by step (so the machine's load hits both alike) for ``--steps`` training
steps each (forward, backward, AdamW; all ranks start a step together). Reported per engine:
the median step time and forward+backward time, dk / dtensor of those medians, and the median
over steps of dk's time over the DTensor step that ran right after it (robust to load that
drifts). tp=1 runs the unsharded model as the baseline for scaling.
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


def _config(args):
    from dist_kernels.models import GPTConfig

    return GPTConfig(
        vocab_size=args.vocab,
        block_size=args.seq,
        n_layers=args.layers,
        n_heads=args.heads,
        dim=args.dim,
        tie_embeddings=False,  # DTensor's plan shards embedding and head differently
    )


def _dtensor_model(args, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from dist_kernels.models import GPT

    torch.manual_seed(0)
    model = GPT(_config(args))
    plan = {
        "embedding.wte": RowwiseParallel(input_layouts=Replicate()),
        "head.lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(args.layers):
        plan[f"blocks.{i}.attn.qkv"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.proj"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.fc"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.proj"] = RowwiseParallel()
    return parallelize_module(model, init_device_mesh("cpu", (world,)), plan)


def _dk_model(args, comm):
    from dist_kernels.models import GPT

    torch.manual_seed(0)
    model = GPT(_config(args))
    return model.parallelize(comm, sequence_parallel=args.sequence_parallel) if comm else model


def _loss_context(engine: str):
    if engine == "dtensor":
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    import contextlib

    return contextlib.nullcontext()


def _scalar(loss) -> float:
    loss = loss.detach()
    return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)


def _time_step(model, opt, batch, engine: str) -> Dict[str, float]:
    """One training step (all ranks start together); seconds for fwd+bwd and the whole step."""
    ids, targets = batch
    dist.barrier()
    t0 = time.perf_counter()
    with _loss_context(engine):
        loss = model(ids, targets)
        loss.backward()
    t1 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t2 = time.perf_counter()
    return {"step": t2 - t0, "fwd_bwd": t1 - t0}


def _rank_main(args) -> Dict:
    import dist_kernels as dk

    world = dist.get_world_size()

    comm = dk.Communicator() if world > 1 else None
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    batch = (tokens[:, :-1], tokens[:, 1:])
    engines = {"dk": _dk_model(args, comm)}
    if world > 1:
        engines["dtensor"] = _dtensor_model(args, world)
    # correctness before timing: the first-step loss equals the unsharded model's
    reference = _dk_model(args, None)
    ref_loss = reference(*batch).item()
    losses = {}
    for name, model in engines.items():
        with _loss_context(name):
            losses[name] = _scalar(model(*batch))
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4) for n, m in engines.items()}
    for name, model in engines.items():  # warm-up (allocations, DTensor's sharding caches)
        _time_step(model, opts[name], batch, name)
    # The engines alternate step by step, so that the machine's load hits both alike.
    steps: Dict[str, List[Dict[str, float]]] = {n: [] for n in engines}
    for _ in range(args.steps):
        for name, model in engines.items():
            steps[name].append(_time_step(model, opts[name], batch, name))
    if comm is not None:
        comm.close()
    return {"tp": world, "ref_loss": ref_loss, "losses": losses, "steps": steps}


def _run(world: int, args) -> Dict:
    """Rank 0's result on ``world`` new local ranks, one torch thread each."""
    from dist_kernels import launch

    return launch.run(world, _rank_main, args, threads=1, group_timeout=1800.0)[0]


def _median(steps: List[Dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in steps)


def _pair_ratio(res: Dict) -> float:
    """Median over steps of dk's step time / the DTensor step that ran right after it."""
    pairs = zip(res["steps"]["dk"], res["steps"]["dtensor"])
    return statistics.median(a["step"] / b["step"] for a, b in pairs)


def _report(results: List[Dict], args) -> str:
    lines = [
        f"GPT dim={args.dim} layers={args.layers} heads={args.heads} vocab={args.vocab} "
        f"seq={args.seq} batch={args.batch}, sequence_parallel={args.sequence_parallel}, "
        f"{args.steps} steps per engine (alternating), AdamW",
        "",
        "| tp | engine | step (ms, median) | fwd+bwd (ms) | loss - unsharded "
        "| dk / dtensor (medians) | dk / dtensor (median of step pairs) |",
        "|---|---|---|---|---|---|---|",
    ]
    for res in results:
        step = {n: _median(r, "step") for n, r in res["steps"].items()}
        for name, steps in res["steps"].items():
            ratios = ["", ""]
            if name == "dk" and "dtensor" in step:
                ratios = [f"{step['dk'] / step['dtensor']:.2f}", f"{_pair_ratio(res):.2f}"]
            elif name == "dk":
                ratios = ["-", "-"]
            lines.append(
                f"| {res['tp']} | {name} | {1e3 * step[name]:.1f} | "
                f"{1e3 * _median(steps, 'fwd_bwd'):.1f} | "
                f"{res['losses'][name] - res['ref_loss']:+.1e} | {ratios[0]} | {ratios[1]} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args()
    load_before = os.getloadavg()
    results = []
    for world in args.tp:
        res = _run(world, args)
        for name, loss in res["losses"].items():
            if abs(loss - res["ref_loss"]) > 1e-4:
                raise SystemExit(f"tp={world} {name}: loss {loss} != unsharded {res['ref_loss']}")
        results.append(res)
    load_after = os.getloadavg()
    print(_report(results, args))
    print(f"\nload average before {load_before}, after {load_after} (1, 5, 15 min)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": vars(args), "results": results, "load": [load_before, load_after]}, f
            )


if __name__ == "__main__":
    main()
