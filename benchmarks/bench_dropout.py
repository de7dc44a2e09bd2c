"""Counter-based dropout (``dk.models.dropout``) against torch's dropout, same run, one process.

    python benchmarks/bench_dropout.py                      # the driver's GPT and a wider one
    python benchmarks/bench_dropout.py --iters 30 --dim 512 --seq 256

A training step (forward and backward) of ``dist_kernels.models.GPT`` three ways, alternated
inside each round so a shared machine's load hits all alike:

``none``     dropout 0 (SDPA's fused attention): the floor
``torch``    dropout p, torch's masks (SDPA with ``dropout_p``; ``nn.Dropout`` on the residuals)
``counter``  dropout p inside ``dropout_keys``: hashed masks, the attention written out

Prints the median step time of each, and counter / torch (the cost of masks that are the same
in every layout) and torch / none (what dropout costs at all). A second table times the mask
alone: ``keep_mask`` of a ``[b, s, h]`` tensor against ``torch.empty(...).bernoulli_``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dist_kernels.models import GPT, GPTConfig  # noqa: E402
from dist_kernels.models import dropout as dk_dropout  # noqa: E402


def _models(dim: int, seq: int, layers: int, heads: int, p: float):
    cfg = GPTConfig(vocab_size=256, block_size=seq, n_layers=layers, n_heads=heads, dim=dim,
                    tie_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    none = GPT(cfg)
    dropped = GPT(GPTConfig(**{**cfg.__dict__, "dropout": p}))
    dropped.load_state_dict(none.state_dict())
    return none, dropped


def _step(model, ids, targets, keys) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with keys:
        model(ids, targets).backward()
    return time.perf_counter() - t0


def _bench_steps(args) -> None:
    none, dropped = _models(args.dim, args.seq, args.layers, args.heads, args.p)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen)
    x, y = ids[:, :-1], ids[:, 1:]
    rows = {
        "none": (none, lambda step: contextlib.nullcontext()),
        "torch": (dropped, lambda step: contextlib.nullcontext()),
        "counter": (dropped, lambda step: dk_dropout.dropout_keys(1, step)),
    }
    times = {name: [] for name in rows}
    for it in range(args.warmup + args.iters):
        for name, (model, keys) in rows.items():
            t = _step(model, x, y, keys(it))
            if it >= args.warmup:
                times[name].append(t)
    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    print(
        f"\nGPT dim {args.dim}, {args.layers} blocks, {args.heads} heads, seq {args.seq}, "
        f"batch {args.batch}, p {args.p}: median forward + backward over {args.iters} steps"
    )
    print(f"{'none ms':>9} {'torch ms':>9} {'counter ms':>11} {'counter/torch':>14} "
          f"{'torch/none':>11}")  # fmt: skip
    print(f"{med['none']:9.2f} {med['torch']:9.2f} {med['counter']:11.2f} "
          f"{med['counter'] / med['torch']:14.2f} {med['torch'] / med['none']:11.2f}")  # fmt: skip


def _bench_masks(args) -> None:
    print(f"\nmask alone, p {args.p}: median of {args.iters}")
    print(f"{'shape [b, s, h]':>18} {'bernoulli ms':>13} {'counter ms':>11} {'ratio':>6}")
    for b, s, h in ((8, 64, 128), (8, args.seq, args.dim), (8, 1024, 1024)):
        coords = [torch.arange(b), torch.arange(s), torch.arange(h)]
        bern, counter = [], []
        for _ in range(args.warmup + args.iters):
            t0 = time.perf_counter()
            torch.empty(b, s, h).bernoulli_(1 - args.p)
            t1 = time.perf_counter()
            dk_dropout.keep_mask(12345, coords, args.p)
            t2 = time.perf_counter()
            bern.append(t1 - t0)
            counter.append(t2 - t1)
        mb, mc = (statistics.median(v[args.warmup :]) * 1e3 for v in (bern, counter))
        print(f"{str([b, s, h]):>18} {mb:13.3f} {mc:11.3f} {mc / mb:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load {os.getloadavg()[0]:.2f}")  # fmt: skip
    small = argparse.Namespace(**{**vars(args), "dim": 128, "seq": 64, "heads": 4})
    _bench_steps(small)  # the driver's default model
    _bench_steps(args)
    _bench_masks(args)


if __name__ == "__main__":
    main()
