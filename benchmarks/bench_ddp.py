"""DDP training-step benchmark: dist_kernels DDP against torch DDP (Gloo), 1 and 2 CPU ranks.

    python benchmarks/bench_ddp.py [--nproc 1 2] [--grad-dtype bf16] [--steps 6] [--rounds 3]
    python benchmarks/bench_ddp.py --hooks allreduce bf16 powersgd1 powersgd2 powersgd4 --nproc 2

Spawns its own ranks (``dist_kernels.launch``: a gloo process group, one torch thread per
rank). Each rank trains a ~20M-parameter transformer; both engines run in the same processes,
alternating in rounds so that machine noise hits both alike. Per engine and world size it prints:

- step time (median over ``--rounds`` rounds of the mean of ``--steps`` steps: forward,
  backward, SGD step; 5 x 5 by default),
- samples/s over all ranks, and scaling efficiency = samples/s(n) / (n * samples/s(1)),
- with ``--hooks``: per comm hook, step time and bytes all-reduced per step and rank, for our DDP
  with ``dk.ddp_hooks`` and torch DDP with torch's hook of the same name over gloo (bytes counted
  by wrapping ``torch.distributed.all_reduce``), after a check that both engines' parameters
  agree after the warm-up steps (PowerSGD starts compressing at step 2);
- hidden fraction of all-reduce time: 1 - (T_step - T_local) / T_allreduce, where T_local is the
  same step under ``no_sync()`` (no communication) and T_allreduce is the time of all-reducing
  the engine's buckets back to back with nothing else running. 1 = communication fully hidden
  behind backward, 0 = fully exposed.

Correctness first: before anything is timed, both engines run one forward and backward on the
same batch from the same initial model, and their averaged gradients must agree (max relative
difference at most 1e-5 for FP32 gradients, 4 ulp of the wire dtype for BF16 / FP16); otherwise
every rank stops. The difference is printed.
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
import torch.nn as nn

# Run from a source checkout without installing: the repository root (with an in-place build)
# comes first; the spawned ranks inherit sys.path.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Transformer(nn.Module):
    """GPT-style: embedding (tied with the head), pre-norm encoder layers."""

    def __init__(self, vocab: int, dim: int, layers: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        layer = nn.TransformerEncoderLayer(
            dim, dim // 64, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(h)))


def add_model_args(parser) -> None:
    """The transformer's size, its batch and the bucket size: the arguments of every benchmark
    that trains this model (bench_ddp, bench_torch_backend, bench_deepspeed)."""
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=25.0)


def _make_model(args) -> nn.Module:
    torch.manual_seed(0)
    return Transformer(args.vocab, args.dim, args.layers, args.seq)


def _step(model, opt, tokens, sync: bool = True) -> None:
    ctx = model.no_sync() if not sync else _Null()
    with ctx:
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
    opt.step()
    opt.zero_grad()


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _gradients(model, tokens) -> List[torch.Tensor]:
    logits = model(tokens[:, :-1])
    nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _check_engines_agree(engines, tokens, args) -> float:
    """Both engines' averaged gradients for one batch, compared before any timing; stops every
    rank when they differ by more than the wire dtype's rounding."""
    ours, theirs = (_gradients(model, tokens) for _name, model, _, _ in engines)
    for _name, model, _, _ in engines:
        model.zero_grad(set_to_none=True)
    scale = max(t.abs().max().item() for t in theirs)
    diff = torch.tensor([max((a - b).abs().max().item() for a, b in zip(ours, theirs)) / scale])
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    wire = DTYPES[args.grad_dtype]
    tolerance = 1e-5 if wire is None else 4 * torch.finfo(wire).eps
    if not diff.item() <= tolerance:  # NaN stops too
        raise SystemExit(
            f"bench_ddp: dist_kernels and torch DDP gradients differ before timing: max "
            f"relative difference {diff.item():.3e} > {tolerance:g}"
        )
    return diff.item()


def _time_steps(model, opt, batches, steps: int, sync: bool) -> float:
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        _step(model, opt, batches[i % len(batches)], sync)
    dist.barrier()
    return (time.perf_counter() - start) / steps


def _time_allreduce(buffers: List[torch.Tensor], reduce, repeats: int = 3) -> float:
    """Back-to-back all-reduce of every bucket (nothing else running), best of ``repeats``."""
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for buf in buffers:
            reduce(buf)
        best = min(best, time.perf_counter() - start)
    return best


def _engines(args, world: int):
    """(name, model, all-reduce buffers, reduce function) for our DDP and torch DDP."""
    import dist_kernels as dk

    ours = dk.DDP(
        _make_model(args), grad_dtype=DTYPES[args.grad_dtype], bucket_cap_mb=args.bucket_mb
    )
    theirs = nn.parallel.DistributedDataParallel(_make_model(args), bucket_cap_mb=args.bucket_mb)
    flat = torch.cat([p.detach().reshape(-1) for p in theirs.parameters()])
    chunk = int(args.bucket_mb * 2**20 // 4)
    torch_buckets = [c.clone() for c in flat.split(chunk)]
    return [
        ("dist_kernels", ours, None, lambda b: ours.comm.all_reduce(b)),
        ("torch+gloo", theirs, torch_buckets, lambda b: dist.all_reduce(b)),
    ]


def _rank_main(args):
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)]
    results: Dict[str, Dict[str, List[float]]] = {}
    engines = _engines(args, world)
    grad_diff = _check_engines_agree(engines, batches[0], args)
    for _name, model, _, _ in engines:  # warm-up (and the first-iteration bucket rebuild)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        for _ in range(2):
            _step(model, opt, batches[0])
    for _ in range(args.rounds):
        for name, model, buffers, reduce in engines:
            opt = torch.optim.SGD(model.parameters(), lr=1e-4)
            r = results.setdefault(name, {"step": [], "local": [], "allreduce": []})
            r["step"].append(_time_steps(model, opt, batches, args.steps, sync=True))
            r["local"].append(_time_steps(model, opt, batches, args.steps, sync=False))
            if world > 1:
                bufs = buffers if buffers is not None else model.buckets
                r["allreduce"].append(_time_allreduce(bufs, reduce))
    nparams = sum(p.numel() for p in engines[0][1].parameters())
    return world, nparams, results, grad_diff


# ----------------------------------------------------------------------------- comm hooks

HOOKS = ("allreduce", "bf16", "fp16", "powersgd1", "powersgd2", "powersgd4")
POWERSGD_START = 2  # compress from the third step (the first iterations rebuild buckets)


def _hook_pair(name: str):
    """(our hook, state), (torch's hook, state) for a ``--hooks`` name."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    import dist_kernels as dk

    if name.startswith("powersgd"):
        rank = int(name[len("powersgd") :])
        kwargs = dict(matrix_approximation_rank=rank, start_powerSGD_iter=POWERSGD_START)
        return (
            (dk.ddp_hooks.powerSGD_hook, dk.ddp_hooks.PowerSGDState(None, **kwargs)),
            (torch_psgd.powerSGD_hook, torch_psgd.PowerSGDState(None, **kwargs)),
        )
    full = {"allreduce": "allreduce_hook", "bf16": "bf16_compress_hook",
            "fp16": "fp16_compress_hook"}[name]  # fmt: skip
    theirs = getattr(default_hooks, full)

    def torch_hook(state, bucket):  # torch refuses bf16_compress_hook by name without NCCL
        return theirs(state, bucket)

    return (getattr(dk.ddp_hooks, full), None), (torch_hook, None)


#: PowerSGD rows use one bucket on both engines: torch's powerSGD_hook over gloo issues the P
#: and Q all-reduces from future callbacks (gloo's threads), which race with the next bucket's
#: all-reduce from the backward thread; with several buckets the ranks issued them in
#: different orders here and gloo aborted ("collective mismatch"). Ours orders them.
ONE_BUCKET_MB = 1024.0


class _CountingAllReduce:
    """Wraps ``torch.distributed.all_reduce`` to count the bytes torch's hooks send."""

    def __init__(self) -> None:
        self.bytes = 0
        self._inner = dist.all_reduce

    def __call__(self, tensor, *args, **kwargs):
        self.bytes += tensor.numel() * tensor.element_size()
        return self._inner(tensor, *args, **kwargs)


def _max_rel_diff(a: nn.Module, b: nn.Module) -> float:
    pairs = list(zip(a.parameters(), b.parameters()))
    scale = max(q.detach().abs().max().item() for _, q in pairs)
    return max((p.detach() - q.detach()).abs().max().item() for p, q in pairs) / scale


def _hooks_rank_main(args):
    import dist_kernels as dk

    counter = _CountingAllReduce()
    dist.all_reduce = counter  # torch's hooks look it up at call time
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)]
    results: Dict[str, dict] = {}
    for name in args.hooks:
        (our_hook, our_state), (torch_hook, torch_state) = _hook_pair(name)
        cap = ONE_BUCKET_MB if name.startswith("powersgd") else args.bucket_mb
        # torch: an explicit bucket_cap_mb caps the first bucket too; ours: first_bucket_mb.
        ours = dk.DDP(_make_model(args), bucket_cap_mb=cap, first_bucket_mb=cap)
        ours.register_comm_hook(our_state, our_hook)
        theirs = nn.parallel.DistributedDataParallel(_make_model(args), bucket_cap_mb=cap)
        theirs.register_comm_hook(torch_state, torch_hook)
        engines = [("dist_kernels", ours, lambda m=ours: m.bytes_all_reduced),
                   ("torch+gloo", theirs, lambda: counter.bytes)]  # fmt: skip
        opts = {n: torch.optim.SGD(m.parameters(), lr=1e-4) for n, m, _ in engines}
        for _ in range(POWERSGD_START + 1):  # warm-up: rebuild, then compressed steps
            for n, model, _ in engines:
                _step(model, opts[n], batches[0])
        r = results[name] = {"vs_torch": _max_rel_diff(ours, theirs)}
        for _ in range(args.rounds):
            for n, model, sent in engines:
                before = sent()
                t = _time_steps(model, opts[n], batches, args.steps, sync=True)
                r.setdefault(n, {"step": [], "bytes": []})
                r[n]["step"].append(t)
                r[n]["bytes"].append((sent() - before) / args.steps)
        ours.close()
    nparams = sum(p.numel() for p in _make_model(args).parameters())
    return dist.get_world_size(), nparams, results


def _print_hooks(runs, args) -> List[dict]:
    rows = []
    for world, nparams, results in runs:
        for name, r in results.items():
            for engine in ("dist_kernels", "torch+gloo"):
                rows.append({
                    "hook": name, "engine": engine, "world": world, "params_M": nparams / 1e6,
                    "step_ms": statistics.median(r[engine]["step"]) * 1e3,
                    "bytes_per_step": statistics.median(r[engine]["bytes"]),
                    "vs_torch": r["vs_torch"],
                })  # fmt: skip
    print(
        f"# bench_ddp --hooks: {rows[0]['params_M']:.1f}M-parameter transformer, batch "
        f"{args.batch} x seq {args.seq} per rank, bucket {args.bucket_mb} MiB, {args.rounds} "
        f"rounds x {args.steps} steps (median); PowerSGD from step {POWERSGD_START}, in one "
        f"bucket ({ONE_BUCKET_MB:.0f} MiB cap, both engines); machine shared, timings noisy"
    )
    print(f"{'hook':>10} {'ranks':>5} {'engine':>13} {'step ms':>9} {'MB/step':>9} "
          f"{'vs full':>7} {'ours/torch':>10} {'param diff':>10}")  # fmt: skip
    full = {
        (r["world"], r["engine"]): r["bytes_per_step"] for r in rows if r["hook"] == "allreduce"
    }
    for r in rows:
        base = full.get((r["world"], r["engine"]))
        ratio = f"{base / r['bytes_per_step']:.1f}x" if base and r["bytes_per_step"] else "-"
        other = next(o for o in rows if o["hook"] == r["hook"] and o["world"] == r["world"]
                     and o["engine"] != r["engine"])  # fmt: skip
        speed = f"{r['step_ms'] / other['step_ms']:.2f}" if r["engine"] == "dist_kernels" else ""
        mb = r["bytes_per_step"] / 1e6
        print(
            f"{r['hook']:>10} {r['world']:>5} {r['engine']:>13} {r['step_ms']:>9.1f} {mb:>9.3f} "
            f"{ratio:>7} {speed:>10} {r['vs_torch']:>10.1e}"
        )
    return rows


def _run_world(world: int, args, target=_rank_main) -> tuple:
    """Rank 0's result of ``target(args)`` on ``world`` new local ranks, one torch thread each."""
    from dist_kernels import launch

    return launch.run(world, target, args, threads=1, group_timeout=300.0)[0]


def _summarise(args, runs) -> List[dict]:
    rows = []
    base = {}
    for world, nparams, results, grad_diff in runs:
        for name, r in results.items():
            step = statistics.median(r["step"])
            local = statistics.median(r["local"])
            samples = world * args.batch / step
            if world == 1:
                base[name] = samples
            row = {
                "engine": name,
                "world": world,
                "params_M": nparams / 1e6,
                "step_ms": step * 1e3,
                "local_ms": local * 1e3,
                "samples_per_s": samples,
                "scaling": samples / (world * base[name]) if name in base else None,
                "grad_rel_diff": grad_diff,
            }
            if r["allreduce"]:
                comm = statistics.median(r["allreduce"])
                row["allreduce_ms"] = comm * 1e3
                row["hidden"] = min(1.0, max(0.0, 1 - (step - local) / comm))
            rows.append(row)
    return rows


def _print(rows: List[dict], args) -> None:
    print(
        f"# bench_ddp: {rows[0]['params_M']:.1f}M-parameter transformer, batch {args.batch} x "
        f"seq {args.seq} per rank, grad dtype {args.grad_dtype}, bucket {args.bucket_mb} MiB, "
        f"{args.rounds} rounds x {args.steps} steps (median); machine shared, timings noisy"
    )
    for world in sorted({r["world"] for r in rows}):
        diff = next(r["grad_rel_diff"] for r in rows if r["world"] == world)
        print(f"# {world} ranks: gradients checked before timing, max rel diff {diff:.2e}")
    header = f"{'engine':>13} {'ranks':>5} {'step ms':>9} {'no-comm ms':>10} {'samples/s':>9} "
    header += f"{'scaling':>7} {'allred ms':>9} {'hidden':>6}"
    print(header)
    for r in rows:
        scaling = f"{r['scaling']:.2f}" if r["scaling"] is not None else "-"
        comm = f"{r['allreduce_ms']:.1f}" if "allreduce_ms" in r else "-"
        hidden = f"{r['hidden']:.2f}" if "hidden" in r else "-"
        print(
            f"{r['engine']:>13} {r['world']:>5} {r['step_ms']:>9.1f} {r['local_ms']:>10.1f} "
            f"{r['samples_per_s']:>9.2f} {scaling:>7} {comm:>9} {hidden:>6}"
        )
    for world in sorted({r["world"] for r in rows}):
        by = {r["engine"]: r for r in rows if r["world"] == world}
        if len(by) == 2:
            ratio = by["dist_kernels"]["step_ms"] / by["torch+gloo"]["step_ms"]
            print(f"{world} ranks: step time dist_kernels / torch+gloo = {ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--grad-dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    add_model_args(parser)
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument(
        "--hooks", nargs="+", choices=HOOKS, help="compare comm hooks instead (2+ ranks)"
    )
    args = parser.parse_args()
    if args.hooks:
        runs = [_run_world(n, args, _hooks_rank_main) for n in args.nproc if n > 1]
        rows = _print_hooks(runs, args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "rows": rows}, f, indent=1)
        return
    runs = [_run_world(n, args) for n in args.nproc]
    rows = _summarise(args, runs)
    _print(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
