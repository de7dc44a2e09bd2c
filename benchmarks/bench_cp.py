"""Ring attention forward + backward on cp CPU ranks, against one process on the whole sequence.

    python benchmarks/bench_cp.py [--seq 2048 4096 8192 16384] [--cp 1 2 4] [--batch 1]
        [--heads 8] [--kv-heads 2] [--head-dim 64] [--no-causal] [--iters 3] [--json f]

For each sequence length the script first runs the baseline, ``F.scaled_dot_product_attention``
on the whole sequence in one process (torch's CPU flash attention, one thread), then for each
cp spawns cp ranks (``dist_kernels.launch``: a gloo group on localhost, our shared-memory
Communicator, one torch thread per rank) that run
``dist_kernels.context_parallel.ring_attention`` on zig-zag shards of the same inputs. Per
configuration, after one warm-up iteration:

- **correctness first**: the baseline saves its output and the gradients of q, k, v; each
  rank compares its shard of them with its own (max |error|, FP32);
- **time**: median over ``--iters`` of forward + backward, the slowest rank's, every rank
  starting together; "x one process" is that over the baseline's median, measured in the
  same run. "cpu x one" is the same ratio of the main thread's CPU time (the compute; the
  communicator's threads not counted): on a loaded machine, where ranks are time-sliced,
  it says what the wall time would be with a core per rank;
- **hidden**: ``1 - exposed / transfers``. ``exposed`` is the time the ranks spent waiting
  for ring transfers (``cp.ring_wait`` events, median of ``--iters`` profiled iterations,
  mean over ranks);
  ``transfers`` is the time the same messages take alone (per group of heads, as ring
  attention sends them: the forward's cp - 1 key/value blocks, the backward's cp - 1 blocks
  and cp - 1 key/value gradient blocks, one after another, no compute);
- **memory per rank**: "saved" is what autograd keeps for the backward (the storages the
  forward saves, inputs included); "peak" is the rise of resident memory over the iteration
  (Linux VmHWM after ``clear_refs``, with ``MALLOC_MMAP_THRESHOLD_`` fixed so that freed
  tensors leave), inputs excluded, outputs and gradients included.

After the table, one line per multi-rank run puts the wall-time ratio, the peak-memory ratio
and the hidden fraction beside issue 30's bars (<= 0.625, <= 0.6, >= 70%; set for cp = 2, seq
8192, causal): ``--seq 8192 --cp 1 2`` is the bars' run.

torch's ``torch.distributed.tensor.experimental.context_parallel`` is tried on the same ranks
and inputs (gloo device mesh); with torch 2.13 on CPU it raises (no DTensor sharding rule for
``aten._scaled_dot_product_flash_attention_for_cpu``), and the table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dist_kernels.bench.memory import reset_peak_rss, rss_kb  # noqa: E402

GRADS = ("q", "k", "v")


def _inputs(args, seq: int):
    """Full q, k, v, grad_out ``[batch, heads, seq, head_dim]`` from a fixed seed (FP32); k and
    v with ``--kv-heads`` heads (grouped-query attention)."""
    gen = torch.Generator().manual_seed(1234 + seq)
    shape = (args.batch, args.heads, seq, args.head_dim)
    grouped = (args.batch, args.kv_heads or args.heads, seq, args.head_dim)
    return [torch.randn(s, generator=gen) for s in (shape, grouped, grouped, shape)]


class _Attention:
    """Forward + backward of one engine on this rank's inputs."""

    def __init__(self, args, seq: int, comm: Any) -> None:
        from dist_kernels import context_parallel as cp

        self.comm, self.causal = comm, not args.no_causal
        full = _inputs(args, seq)
        if comm is None:  # the baseline: the whole sequence in one process
            self.tensors = full
            gqa = {"enable_gqa": True} if full[1].shape[1] != full[0].shape[1] else {}
            self.fn = lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, is_causal=self.causal, **gqa
            )
        else:
            self.tensors = [cp.shard_sequence(t, comm, dim=2) for t in full]
            self.fn = lambda q, k, v: cp.ring_attention(q, k, v, comm, causal=self.causal)
        del full
        self.q, self.k, self.v, self.grad_out = self.tensors
        for t in (self.q, self.k, self.v):
            t.requires_grad_()

    def step(self) -> torch.Tensor:
        for t in (self.q, self.k, self.v):
            t.grad = None
        out = self.fn(self.q, self.k, self.v)
        out.backward(self.grad_out)
        return out.detach()

    def timed(self) -> List[float]:
        """Seconds of one forward + backward, wall and this thread's CPU time, the slowest
        rank's of each, all ranks starting together."""
        if self.comm is not None:
            self.comm.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        self.step()
        elapsed = torch.tensor(
            [time.perf_counter() - t0, time.thread_time() - c0], dtype=torch.float64
        )
        if self.comm is not None:
            self.comm.all_reduce(elapsed, op="max")
        return elapsed.tolist()

    def memory(self) -> Dict[str, float]:
        """Bytes autograd saves for the backward, and the rise of resident memory (this rank)."""
        for t in (self.q, self.k, self.v):
            t.grad = None
        saved: Dict[int, int] = {}

        def pack(t):
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
            return t

        before = reset_peak_rss()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self.fn(self.q, self.k, self.v)
        out.backward(self.grad_out)
        peak = rss_kb("VmHWM") - before
        return {"saved_mb": sum(saved.values()) / 2**20, "peak_mb": peak / 1024}


def _exposed_wait_ms(attention: _Attention, iters: int) -> Dict[str, float]:
    """Time waiting for ring transfers and computing blocks: medians of ``iters`` profiled
    iterations (on a time-sliced host one iteration can catch a rank descheduled)."""
    from torch.profiler import ProfilerActivity, profile

    from dist_kernels.context_parallel.ring_attention import WAIT_EVENT

    waits, blocks = [], []
    for _ in range(iters):
        attention.comm.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            attention.step()
        totals = {e.key: e.cpu_time_total / 1e3 for e in prof.key_averages()}
        waits.append(totals.get(WAIT_EVENT, 0.0))
        blocks.append(sum(totals.get(f"cp.block_{d}", 0.0) for d in ("forward", "backward")))
    return {"wait_ms": statistics.median(waits), "block_ms": statistics.median(blocks)}


def _transfers_alone_ms(attention: _Attention, iters: int) -> float:
    """The ring's messages with nothing to hide behind, as ring attention sends them (per group
    of heads: the forward's cp - 1 key/value blocks, k and v apart; the backward's cp - 1 of
    them and cp - 1 key/value gradient blocks, k and v stacked): median of ``iters`` runs."""
    from dist_kernels.context_parallel import layout

    comm = attention.comm
    size, rank = comm.world_size, comm.rank
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    k, v = attention.k.detach(), attention.v.detach()

    def shift(messages, dst: int, src: int) -> None:
        sends, recvs = messages
        works = [comm.irecv(t, src) for t in recvs] + [comm.isend(t, dst) for t in sends]
        for w in works:
            w.wait()

    def with_buffers(sends: List[torch.Tensor]):
        return sends, [torch.empty_like(t) for t in sends]

    groups = []
    for sample, heads in layout.head_groups(k.shape[0], k.shape[1]):
        kv = [t[sample : sample + 1, heads].contiguous() for t in (k, v)]
        groups.append((with_buffers(kv), with_buffers([torch.stack(kv)])))
    times = []
    for _ in range(iters):
        comm.barrier()
        t0 = time.perf_counter()
        for kv, dkv in groups:
            for _ in range(size - 1):  # forward: key/value blocks to the next rank
                shift(kv, nxt, prev)
            for _ in range(size - 1):  # backward: the blocks to the previous rank
                shift(kv, prev, nxt)
            for _ in range(size - 1):  # and their gradients (FP32: the blocks' size), stacked
                shift(dkv, prev, nxt)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _torch_context_parallel(args, seq: int, world: int) -> Dict[str, Any]:
    """torch's context_parallel on the same inputs over a gloo device mesh: its time, or why
    it did not run."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,))
    q, k, v, g = _inputs(args, seq)
    try:
        dist.barrier()
        t0 = time.perf_counter()
        with context_parallel(mesh, buffers=[q, k, v, g], buffer_seq_dims=[2, 2, 2, 2]):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*leaves, is_causal=not args.no_causal)
            out.backward(g)
        return {"ms": 1e3 * (time.perf_counter() - t0)}
    except Exception as e:  # noqa: BLE001 - the reason goes into the table
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}


def _check(attention: _Attention, out: torch.Tensor, reference: str) -> float:
    """Max |error| of this rank's output and gradients against the baseline's, on its shard."""
    from dist_kernels import context_parallel as cp

    ref = torch.load(reference)
    seq = ref["out"].shape[2]
    mine = cp.positions(seq, attention.comm)
    ours = {"out": out, **{n: getattr(attention, n).grad for n in GRADS}}
    return max((ours[n] - ref[n].index_select(2, mine)).abs().max().item() for n in ours)


def _rank_main(args, seq: int, mode: str, ref: str) -> Optional[Dict[str, Any]]:
    """One rank of :func:`dist_kernels.launch.run` (gloo group up, one torch thread); rank 0
    returns the row."""
    rank, world = dist.get_rank(), dist.get_world_size()
    import dist_kernels as dk

    comm = dk.Communicator() if mode == "ring" else None
    row: Dict[str, Any] = {"seq": seq, "cp": world, "engine": mode}
    attention = _Attention(args, seq, comm)
    out = attention.step()  # warm-up, and the result to check
    if mode == "ring":
        row["max_error"] = _check(attention, out, ref)
    else:
        grads = {n: getattr(attention, n).grad for n in GRADS}
        torch.save({"out": out, **grads}, ref)
    del out
    times = [attention.timed() for _ in range(args.iters)]
    row["times_ms"] = [1e3 * wall for wall, _ in times]
    row["cpu_ms"] = [1e3 * cpu for _, cpu in times]
    # memory before the profiler runs, as for the baseline: its freed buffers would hide a rise
    row.update(_gathered(comm, attention.memory(), "max"))
    if mode == "ring":
        row.update(_gathered(comm, _exposed_wait_ms(attention, args.iters), "mean"))
    if mode == "ring" and world > 1:
        row["transfers_ms"] = _transfers_alone_ms(attention, args.iters)
    if mode == "ring" and world > 1:
        row["torch_cp"] = _torch_context_parallel(args, seq, world)
    if comm is not None:
        comm.close()
    return row if rank == 0 else None


def _gathered(comm, values: Dict[str, float], how: str) -> Dict[str, float]:
    """Each value over the ranks: their mean or max (this rank's alone without a comm)."""
    if comm is None:
        return values
    row = torch.tensor(list(values.values()), dtype=torch.float64)
    every = torch.empty(comm.world_size * row.numel(), dtype=torch.float64)
    comm.all_gather(every, row)
    every = every.view(comm.world_size, -1)
    reduced = every.mean(0) if how == "mean" else every.max(0).values
    return dict(zip(values, reduced.tolist()))


def _run(world: int, args, seq: int, mode: str, ref: str) -> Dict[str, Any]:
    from dist_kernels import launch

    return launch.run(world, _rank_main, args, seq, mode, ref, threads=1, group_timeout=3600.0)[0]


def _report(rows: List[Dict[str, Any]], args) -> str:
    lines = [
        f"attention batch={args.batch} heads={args.heads} head_dim={args.head_dim} FP32, "
        f"causal={not args.no_causal}, zig-zag shards, one thread per rank, median of "
        f"{args.iters} forward + backward",
        "",
        "| seq | cp | engine | fwd+bwd ms | x one process | cpu x one | exposed wait ms | "
        "transfers alone ms | hidden | saved MB/rank | x one | peak MB/rank | x one | "
        "max abs error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {}
    for row in rows:
        ms, cpu = statistics.median(row["times_ms"]), statistics.median(row["cpu_ms"])
        if row["engine"] == "sdpa":
            base[row["seq"]] = (ms, cpu, row["saved_mb"], row["peak_mb"])
        b_ms, b_cpu, b_saved, b_peak = base[row["seq"]]
        hidden = "-"
        if row.get("transfers_ms"):
            hidden = f"{100 * max(0.0, 1 - row['wait_ms'] / row['transfers_ms']):.0f}%"
        lines.append(
            f"| {row['seq']} | {row['cp']} | {row['engine']} | {ms:.0f} | {ms / b_ms:.3f} | "
            f"{cpu / b_cpu:.3f} | "
            f"{row.get('wait_ms', 0):.1f} | {row.get('transfers_ms', 0):.1f} | {hidden} | "
            f"{row['saved_mb']:.1f} | {row['saved_mb'] / b_saved:.2f} | {row['peak_mb']:.1f} "
            f"| {row['peak_mb'] / b_peak:.2f} | {row.get('max_error', 0):.1e} |"
        )
    lines += ["", *_against_the_bars(rows, base, causal=not args.no_causal)]
    tried = [r["torch_cp"] for r in rows if "torch_cp" in r]
    errors = sorted({t["error"] for t in tried if "error" in t})
    ran = [t["ms"] for t in tried if "ms" in t]
    lines.append("")
    if errors:
        lines.append(f"torch context_parallel (gloo, CPU) did not run: {'; '.join(errors)}")
    if ran:
        lines.append(f"torch context_parallel ran: {ran} ms (one iteration each)")
    return "\n".join(lines)


def _against_the_bars(rows: List[Dict[str, Any]], base, causal: bool) -> List[str]:
    """One line per multi-rank run: the ratios issue 30's "done" bars are set on (cp = 2,
    seq 8192, causal, one thread per rank), with the bars."""
    lines = ["Against the bars (set for cp = 2, seq 8192, causal; the other rows for scale):"]
    for row in rows:
        if row["engine"] != "ring" or row["cp"] == 1:
            continue
        b_ms, _, _, b_peak = base[row["seq"]]
        wall = statistics.median(row["times_ms"]) / b_ms
        hidden = max(0.0, 1 - row["wait_ms"] / row["transfers_ms"])
        marks = [
            f"wall {wall:.3f}x one process (bar <= 0.625)",
            f"peak memory {row['peak_mb'] / b_peak:.2f}x (bar <= 0.6)",
            f"transfers hidden {100 * hidden:.0f}% (bar >= 70%)",
        ]
        lines.append(f"- seq {row['seq']}, cp {row['cp']}, causal {causal}: " + ", ".join(marks))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument(
        "--kv-heads", type=int, default=0, help="key / value heads (grouped-query; 0: --heads)"
    )
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--json", help="also write the raw rows here")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # freed tensors leave: honest peaks
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq in args.seq:
            ref = os.path.join(tmp, f"reference-{seq}.pt")
            rows.append(_run(1, args, seq, "sdpa", ref))
            for world in args.cp:
                rows.append(_run(world, args, seq, "ring", ref))
                if rows[-1]["max_error"] > 1e-3:
                    raise SystemExit(f"seq={seq} cp={world}: wrong result {rows[-1]}")
    load_after = os.getloadavg()
    print(_report(rows, args))
    print(f"\nload average before {load_before}, after {load_after} (1, 5, 15 min)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "load": [load_before, load_after]}, f)


if __name__ == "__main__":
    main()
