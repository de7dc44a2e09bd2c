"""Sharded optimizer benchmark: step time and optimizer-state bytes per rank, same run.

    python benchmarks/bench_zero.py                      # 2 CPU ranks, ~21M-parameter transformer
    python benchmarks/bench_zero.py --ranks 2 --layers 6 --d-model 512 --steps 6

Configurations, each on a fresh copy of the same model, in one process per rank:

* ``dk zero-1`` / ``dk zero-2``: :class:`dist_kernels.ShardedOptimizer` with FusedAdamW;
* ``dk DDP + AdamW``: dist_kernels DDP with a full (unsharded) torch AdamW (``fused=True``) on
  every rank (torch DDP on gloo stands in, labelled so, where dist_kernels.ddp is not available);
* ``torch ZeRO (gloo)``: ``torch.distributed.optim.ZeroRedundancyOptimizer`` over torch DDP on
  gloo with torch's fused AdamW (``fused=True``, its fastest CPU AdamW), the baseline every ratio
  is taken against;
* ``dk zero-3``: stage 3 (parameters sharded too, gathered per transformer block);
* ``torch FSDP2 (gloo)``: ``torch.distributed.fsdp.fully_shard`` per block and on the root,
  over gloo, with torch's fused AdamW: the stage 3 baseline.

The memory table gives bytes per rank measured from the tensors each configuration holds
(parameters, gradients, optimizer state, the engine's communication buffers; torch DDP's
internal gradient buckets are not reachable from Python and appear only in the RSS), the ZeRO
formula for the configuration's stage, and the process's peak RSS during the configuration
(``/proc/self/clear_refs`` resets the high-water mark before each one) minus its RSS before,
and the growth of its PSS (proportional set size) from before the configuration to after its
last backward: RSS counts every shared page a process touched whole, so a rank reading its
peer's registered buffers in place shows them in its own RSS too; PSS splits them.

A step is forward + backward + optimizer step (+ zero_grad); the median over the timed steps is
printed, after warm-up steps. State bytes are measured from the optimizer's tensors on rank 0;
"grad bytes" counts gradient storage the configuration keeps (parameter ``.grad`` plus the
engine's own buffers). Correctness comes first: after the warm-up steps, before any timed step,
every configuration's parameters are compared with the baseline's after its warm-up (same
model, same batches); a max relative difference above ``--tolerance`` (default 1e-5; measured
3e-7) stops the run on every rank. Adam's update hardly depends on a constant gradient scale, so
this gate catches wrong gradients and broken updates, not a factor of two: tests/test_zero.py
checks that with SGD.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dist_kernels.bench.memory import pss_kb, reset_peak_rss, rss_kb  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Transformer(torch.nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.zeros(seq, d))
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _tensor_bytes(tensors) -> int:
    tensors = [getattr(t, "_local_tensor", t) for t in tensors]  # a DTensor: this rank's shard
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return _tensor_bytes(v for s in optimizer.state.values() for v in s.values() if v.numel() > 1)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views count once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _torch_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, int]:
    """Bytes per kind that a torch configuration holds, from its tensors."""
    state = [v for s in optimizer.state.values() for v in s.values() if v.numel() > 1]
    return {
        "parameters": _storage_bytes(model.parameters()),
        "gradients": _storage_bytes(p.grad for p in model.parameters()),
        "optimizer_state": _storage_bytes(state),
        "buffers": 0,
    }


def _formula(stage: int, numel: int, world_size: int) -> int:
    """ZeRO paper, FP32 Adam (4 + 4 + 8 bytes per parameter), bytes per rank; stage 0: plain
    data parallelism (everything replicated)."""
    shard = numel / world_size
    return int(
        {0: 16 * numel, 1: 8 * numel + 8 * shard, 2: 4 * numel + 12 * shard, 3: 16 * shard}[stage]
    )


def _comm() -> Tuple[Any, str]:
    import dist_kernels as dk

    return dk.Communicator(), "dk.Communicator (shared memory)"


def _configs(args, comm) -> List[Tuple[str, Callable]]:
    from dist_kernels.optim import FusedAdamW

    kwargs = {"lr": 1e-4, "weight_decay": 0.01}

    def sharded(stage):
        def build(model):
            import dist_kernels as dk

            extra = {"module": model} if stage == 3 else {}
            opt = dk.ShardedOptimizer(
                model.parameters(), FusedAdamW, comm, stage=stage, **extra, **kwargs
            )
            master = opt.state_bytes()["master"]
            return model, opt, lambda: _state_bytes(opt.optim), opt.gradient_bytes, master

        return build

    def torch_fsdp2(model):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **kwargs)
        return model, opt, lambda: _state_bytes(opt), lambda: _grad_bytes(model), 0

    has_dk_ddp = importlib.util.find_spec("dist_kernels.ddp") is not None

    def dk_ddp(model):
        if has_dk_ddp:
            import dist_kernels as dk

            wrapped = dk.DistributedDataParallel(model, comm)
        else:  # not built in this tree: torch DDP stands in, and the row says so
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **kwargs)
        return wrapped, opt, lambda: _state_bytes(opt), lambda: _grad_bytes(model), 0

    def torch_zero(model):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, fused=True, **kwargs)
        return wrapped, opt, lambda: _state_bytes(opt.optim), lambda: _grad_bytes(model), 0

    return [
        ("torch ZeRO fused (gloo)", torch_zero),
        ("dk zero-1", sharded(1)),
        ("dk zero-2", sharded(2)),
        ("dk zero-3", sharded(3)),
        ("torch FSDP2 (gloo)", torch_fsdp2),
        ("dk DDP + AdamW" if has_dk_ddp else "torch DDP + AdamW", dk_ddp),
    ]


def _grad_bytes(model: torch.nn.Module) -> int:
    return _tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)


def _params(model: torch.nn.Module, opt: Any) -> torch.Tensor:
    """Full parameter values (stage 3 and FSDP2 gather theirs: collective)."""
    with _full_parameters(opt):
        return torch.cat([_full(p).detach().reshape(-1) for p in model.parameters()])


def _check_against(reference, params: torch.Tensor, name: str, tolerance: float) -> float:
    """Max relative difference from the baseline's parameters; stops every rank when it is
    above ``tolerance`` (the ranks agree on the largest difference first)."""
    if reference is None:
        return 0.0
    diff = torch.tensor([((params - reference).abs().max() / reference.abs().max()).item()])
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    if not diff.item() <= tolerance:  # NaN stops too
        raise SystemExit(
            f"bench_zero: {name} disagrees with the baseline after the warm-up: max relative "
            f"difference {diff.item():.3e} > {tolerance:g}; not timing it"
        )
    return diff.item()


def _run_config(build, args, rank, name, reference) -> Dict[str, Any]:
    """Warm-up steps, the correctness check against ``reference`` (the baseline's parameters
    after its warm-up; None for the baseline itself), then the timed steps."""
    torch.manual_seed(0)
    rss_before = reset_peak_rss()
    pss_before = pss_kb()
    model = Transformer(args.vocab, args.d_model, args.layers, args.heads, args.seq)
    wrapped, opt, state_bytes, grad_bytes, master_bytes = build(model)
    g = torch.Generator().manual_seed(1 + rank)
    times, peak_grad, diff, warm = [], 0, None, None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            warm = _params(model, opt)
            diff = _check_against(reference, warm, name, args.tolerance)
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        start = time.perf_counter()
        logits = wrapped(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        peak_grad = max(peak_grad, grad_bytes())
        if step == args.warmup + args.steps - 1:  # bytes held after backward, untimed
            probe = time.perf_counter()
            memory = _memory_of(opt, model, build)
            pss = pss_kb() - pss_before
            start += time.perf_counter() - probe
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - start
        if step >= args.warmup:
            times.append(elapsed)
    peak_rss = rss_kb("VmHWM") - rss_before
    stage = opt.stage if hasattr(opt, "memory_report") else _TORCH_STAGES[build.__name__]
    result = {
        "ms": 1e3 * statistics.median(times),
        "state": state_bytes(),
        "master": master_bytes,
        "grad": peak_grad,
        "warm_params": warm,
        "diff": diff,
        "memory": memory,
        "stage": stage,
        "rss": peak_rss * 1024,
        "pss": pss * 1024,
    }
    if hasattr(opt, "close"):
        opt.close()
    return result


_TORCH_STAGES = {
    "torch_zero": 1,
    "torch_zero_fused": 1,
    "torch_fsdp2": 3,
    "dk_ddp": 0,
}  # what each one shards


def _memory_of(opt, model, build) -> Dict[str, int]:
    if hasattr(opt, "memory_report"):
        return dict(opt.memory_report().measured)
    return _torch_memory(model, getattr(opt, "optim", opt))


def _full_parameters(opt):
    import contextlib

    return opt.full_parameters() if hasattr(opt, "full_parameters") else contextlib.nullcontext()


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2: a DTensor


def _print_memory(rows, numel: int, world_size: int) -> None:
    """Bytes per rank from the tensors, the ZeRO formula beside them, and the peak RSS."""
    print(
        f"\n{'config':24s} {'params MB':>10s} {'grads MB':>9s} {'state MB':>9s} "
        f"{'buffers MB':>11s} {'total MB':>9s} {'formula MB':>11s} {'vs formula':>11s} "
        f"{'peak RSS MB':>12s} {'PSS MB':>7s}"
    )
    for name, r in rows:
        m = r["memory"]
        total = sum(m.values())
        stage = r["stage"]
        formula = _formula(stage, numel, world_size)
        print(
            f"{name:24s} {m['parameters'] / 1e6:10.1f} {m['gradients'] / 1e6:9.1f} "
            f"{m['optimizer_state'] / 1e6:9.1f} {m['buffers'] / 1e6:11.1f} {total / 1e6:9.1f} "
            f"{formula / 1e6:8.1f} z{stage} {total / formula:10.2f}x {r['rss'] / 1e6:12.1f} "
            f"{r['pss'] / 1e6:7.1f}"
        )


def _worker(rank: int, world_size: int, port: int, args) -> None:
    torch.set_num_threads(args.threads)
    store = dist.TCPStore(
        "127.0.0.1", port, world_size, is_master=rank == 0, timeout=datetime.timedelta(seconds=600)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    numel = sum(
        p.numel()
        for p in Transformer(
            args.vocab, args.d_model, args.layers, args.heads, args.seq
        ).parameters()
    )
    comm, comm_kind = _comm()
    configs = _configs(args, comm)
    warm = argparse.Namespace(**{**vars(args), "warmup": 0, "steps": 1})
    _run_config(configs[0][1], warm, rank, "set-up", None)  # one-time process set-up, untimed
    rows = []
    reference = None  # the baseline (first config) after its warm-up
    for name, build in configs:
        dist.barrier()
        result = _run_config(build, args, rank, name, reference)
        warm = result.pop("warm_params")
        reference = warm if reference is None else reference
        rows.append((name, result))
    comm.close()
    if rank == 0:
        print(
            f"# {world_size} CPU ranks, transformer {numel / 1e6:.1f}M params "
            f"(d={args.d_model}, layers={args.layers}, vocab={args.vocab}), batch {args.batch}"
            f"x{args.seq} per rank, {args.threads} thread(s) per rank, median of {args.steps} "
            f"steps after {args.warmup} warm-up; dk engines on: {comm_kind}; parameters "
            f"checked against the baseline's before timing (tolerance {args.tolerance:g})"
        )
        base = rows[0][1]
        print(
            f"{'config':24s} {'step ms':>9s} {'vs torch':>9s} {'state MB/rank':>14s} "
            f"{'master MB/rank':>15s} {'grad MB/rank':>13s} {'max rel diff':>13s}"
        )
        for name, r in rows:
            diff = r["diff"]
            print(
                f"{name:24s} {r['ms']:9.1f} {base['ms'] / r['ms']:8.2f}x "
                f"{r['state'] / 1e6:14.1f} {r['master'] / 1e6:15.1f} {r['grad'] / 1e6:13.1f} "
                f"{diff:13.2e}"
            )
        _print_memory(rows, numel, world_size)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--tolerance",
        type=float,
        default=1e-5,
        help="max relative parameter difference from the baseline after the warm-up",
    )
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: parameters are checked after it")
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    port = store.port
    del store
    mp.spawn(_worker, args=(args.ranks, port, args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
