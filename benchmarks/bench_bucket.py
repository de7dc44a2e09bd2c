"""Fused bucket kernels against the eager torch sequences they replace.

    python benchmarks/bench_bucket.py [--device cpu|cuda] [--tensors 1 100 1000] [--mib 64]

For FP32 gradients totalling ``--mib`` MiB, split into 1, 100 and 1000 tensors:

* pack:    ``dk.bucketing.pack`` into a BF16 bucket with a scale and the non-finite flag, vs
           ``torch.cat([g.to(bf16) for g in grads]).mul_(scale)``
* unpack:  ``dk.bucketing.unpack`` from the BF16 bucket with 1/loss_scale and the flag, vs
           slices ``.copy_`` back, ``mul_``, and an ``isfinite`` check (``eager``), and vs
           slices ``.copy_`` back then ``torch._amp_foreach_non_finite_check_and_unscale_``
           (``eager_amp``, the strongest eager sequence)
* unscale: ``dk.bucketing.unscale_`` vs ``torch._amp_foreach_non_finite_check_and_unscale_``

Results are checked against the eager result before timing (power-of-two scales, so the eager
double rounding equals the fused single rounding). GB/s counts bytes read plus bytes written
once (GB = 1e9 B). On GPU the table adds the fraction of the measured device copy bandwidth
(``dst.copy_(src)`` of the FP32 gradients). ``run(args)`` returns the rows for
``benchmarks/bench_kernels.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

from dist_kernels.amp import bucketing as bk

PACK_SCALE = 0.125  # e.g. 1 / world_size
INV_LOSS_SCALE = 2.0**-16


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tensors", type=int, nargs="+", default=[1, 100, 1000])
    parser.add_argument("--mib", type=int, default=64, help="total FP32 gradient size")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="dk CPU threads")
    parser.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads")
    return parser


def _timer(device: str, repeats: int) -> Callable[[Callable[[], None]], float]:
    """Median seconds of `repeats` calls after one warm-up call."""

    def measure(fn: Callable[[], None]) -> float:
        fn()
        times = []
        for _ in range(repeats):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                begin = time.perf_counter()
                fn()
                times.append(time.perf_counter() - begin)
        return statistics.median(times)

    return measure


def _setup(num: int, total_bytes: int, device: str):
    gen = torch.Generator().manual_seed(num)
    per = total_bytes // 4 // num
    grads = [(torch.randn(per, generator=gen)).to(device) for _ in range(num)]
    offsets = [i * per for i in range(num)]  # 16-byte aligned when per is a multiple of 8
    flat = torch.empty(per * num, dtype=torch.bfloat16, device=device)
    return grads, offsets, flat


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a, b))


def _pack_cases(grads, offsets, flat, threads):
    flag = torch.zeros(1, dtype=torch.int32, device=flat.device)

    def dk_pack():
        bk.pack(grads, flat, offsets, PACK_SCALE, flag, num_threads=threads)

    def eager_pack():
        return torch.cat([g.to(torch.bfloat16) for g in grads]).mul_(PACK_SCALE)

    dk_pack()
    ok = _same(flat, eager_pack()) and flag.item() == 0
    nbytes = sum(g.numel() for g in grads) * (4 + 2)
    return nbytes, ok, {"dk": dk_pack, "eager": eager_pack}


def _unpack_cases(grads, offsets, flat, threads):
    device = flat.device
    counts = [g.numel() for g in grads]
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    inv = torch.full((1,), INV_LOSS_SCALE, device=device)
    found = torch.zeros(1, device=device)
    bk.pack(grads, flat, offsets, 1.0)

    def dk_unpack():
        bk.unpack(flat, grads, offsets, inv, flag, num_threads=threads)

    def eager_unpack():
        for g, piece in zip(grads, flat.split(counts)):
            g.copy_(piece)
        torch._foreach_mul_(grads, INV_LOSS_SCALE)
        return torch.stack([g.isfinite().all() for g in grads]).all().logical_not()

    def eager_amp_unpack():
        for g, piece in zip(grads, flat.split(counts)):
            g.copy_(piece)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)

    dk_unpack()
    ours = [g.clone() for g in grads]
    bad = eager_unpack()
    ok = all(_same(a, b) for a, b in zip(ours, grads)) and flag.item() == 0 and not bad.item()
    nbytes = sum(counts) * (2 + 4)
    impls = {"dk": dk_unpack, "eager": eager_unpack, "eager_amp": eager_amp_unpack}
    return nbytes, ok, impls


def _unscale_cases(grads, offsets, flat, threads):
    device = flat.device
    inv = torch.full((1,), 1.0, device=device)  # keeps the data unchanged across repeats
    found = torch.zeros(1, device=device)
    found_ref = torch.zeros(1, device=device)
    ref = [g.clone() for g in grads]

    def dk_unscale():
        bk.unscale_(grads, inv, found, num_threads=threads)

    def torch_unscale():
        torch._amp_foreach_non_finite_check_and_unscale_(ref, found_ref, inv)

    dk_unscale()
    torch_unscale()
    ok = all(_same(a, b) for a, b in zip(grads, ref)) and found.item() == found_ref.item() == 0
    nbytes = sum(g.numel() for g in grads) * (4 + 4)
    return nbytes, ok, {"dk": dk_unscale, "eager": torch_unscale}


def _copy_bandwidth(grads, measure) -> float:
    src = torch.cat(grads)
    dst = torch.empty_like(src)
    seconds = measure(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / seconds / 1e9


def run(args: Optional[argparse.Namespace] = None) -> List[Dict]:
    """Runs every case; returns one row (a dict) per (op, tensors, impl)."""
    if args is None:
        args = add_arguments(argparse.ArgumentParser()).parse_args([])
    if getattr(args, "torch_threads", None):
        torch.set_num_threads(args.torch_threads)
    return measure_cases(args.device, args.tensors, args.mib << 20, args.repeats, args.threads)


def measure_cases(
    device: str, tensor_counts, total_bytes: int, repeats: int, threads: Optional[int] = None
) -> List[Dict]:
    """The benchmark proper: FP32 gradients of ``total_bytes`` split into each tensor count."""
    measure = _timer(device, repeats)
    rows = []
    for num in tensor_counts:
        grads, offsets, flat = _setup(num, total_bytes, device)
        copy_gbps = _copy_bandwidth(grads, measure) if device == "cuda" else None
        for op, cases in (("pack", _pack_cases), ("unpack", _unpack_cases),
                          ("unscale", _unscale_cases)):  # fmt: skip
            nbytes, ok, impls = cases(grads, offsets, flat, threads)
            seconds = {name: measure(fn) for name, fn in impls.items()}
            for name, t in seconds.items():
                gbps = nbytes / t / 1e9
                rows.append({
                    "op": op, "device": device, "tensors": num, "bytes": nbytes,
                    "impl": name, "time_us": t * 1e6, "gbps": gbps,
                    "speedup_vs_eager": seconds["eager"] / t, "correct": ok,
                    "copy_fraction": gbps / copy_gbps if copy_gbps else None,
                })  # fmt: skip
    return rows


_BASELINES = {
    "pack": "cat(.to(bf16)).mul_()",
    "unpack": "copy_+mul_+isfinite",
    "unscale": "_amp_foreach_..._unscale_",
}


def bucket_rows(device: str, sizes, repeats: int) -> list:
    """A section for benchmarks/bench_kernels.py: ``SECTIONS.append(bucket_rows)``.

    Each size is the total FP32 gradient bytes, split into 1, 100 and 1000 tensors.
    """
    from bench_kernels import Row  # benchmarks/ is on sys.path when bench_kernels runs

    rows = []
    for size in sizes:
        results = measure_cases(device, [1, 100, 1000], size, repeats)
        by_key = {(r["op"], r["tensors"], r["impl"]): r for r in results}
        for (op, num, impl), r in by_key.items():
            if impl != "dk":
                continue
            if not r["correct"]:
                raise RuntimeError(f"bench_bucket: {op} with {num} tensors gave wrong results")
            eager = by_key[(op, num, "eager")]
            case = f"{op} {num} tensors" + (" fp32<->bf16 x scale" if op != "unscale" else "")
            rows.append(Row("bucket", case, size, r["bytes"], r["time_us"] / 1e6,
                            _BASELINES[op], eager["time_us"] / 1e6))  # fmt: skip
    return rows


def format_rows(rows: List[Dict]) -> str:
    header = f"{'op':>8} {'tensors':>7} {'impl':>10} {'time(us)':>10} {'GB/s':>7} {'x eager':>8}"
    header += f" {'ok':>3}" + (f" {'%copy':>6}" if rows and rows[0]["copy_fraction"] else "")
    lines = [header]
    for r in rows:
        line = (
            f"{r['op']:>8} {r['tensors']:>7} {r['impl']:>10} {r['time_us']:>10.0f} "
            f"{r['gbps']:>7.2f} {r['speedup_vs_eager']:>8.2f} {'yes' if r['correct'] else 'NO':>3}"
        )
        if r["copy_fraction"]:
            line += f" {100 * r['copy_fraction']:>6.1f}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    parser = add_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    args = parser.parse_args(argv)
    print(f"torch threads: {torch.get_num_threads()}, dk threads: {args.threads or 'default'}")
    print(format_rows(run(args)))


if __name__ == "__main__":
    main()
