"""Fused bucket kernels against the strongest eager torch sequences they replace.

    python benchmarks/bench_bucket.py [--device cpu|cuda] [--tensors 1 100 1000] [--mib 64]

For FP32 gradients totalling ``--mib`` MiB, split into 1, 100 and 1000 tensors, each fused
kernel runs beside every eager sequence a careful user would write for the same result, all into
preallocated outputs; the ratio is taken against the fastest of them (``x best``, its name in
``best``):

* pack:    ``dk.bucketing.pack`` into a BF16 bucket with a scale and the non-finite flag, vs
           ``torch._foreach_copy_`` (or a ``copy_`` loop) into the bucket's slices, then
           ``bucket.mul_(scale)`` (no non-finite flag: the baseline does less work)
* unpack:  ``dk.bucketing.unpack`` from the BF16 bucket with 1/loss_scale and the flag, vs
           ``torch._foreach_copy_`` (or a ``copy_`` loop) back into the gradients, then
           ``torch._amp_foreach_non_finite_check_and_unscale_`` (what GradScaler runs), or
           ``torch._foreach_mul_`` and an ``isfinite`` check
* unscale: ``dk.bucketing.unscale_`` vs ``torch._amp_foreach_non_finite_check_and_unscale_``

Every sequence's result is compared with the fused kernel's, bit for bit, before anything is
timed, and the run stops on a difference (power-of-two scales, so the eager sequences' double
rounding equals the fused single rounding). GB/s counts bytes read plus bytes written once
(GB = 1e9 B). On GPU the table adds the fraction of the measured device copy bandwidth
(``dst.copy_(src)`` of the FP32 gradients). ``run(args)`` returns the rows for
``benchmarks/bench_kernels.py``.
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Optional

import torch
from kernel_timing import Row, time_calls  # benchmarks/ is on sys.path when run as a script

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


def _setup(num: int, total_bytes: int, device: str):
    gen = torch.Generator().manual_seed(num)
    per = total_bytes // 4 // num
    grads = [(torch.randn(per, generator=gen)).to(device) for _ in range(num)]
    offsets = [i * per for i in range(num)]  # 16-byte aligned when per is a multiple of 8
    flat = torch.empty(per * num, dtype=torch.bfloat16, device=device)
    return grads, offsets, flat


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a, b))


def _copy_each(dsts, srcs) -> None:
    for d, g in zip(dsts, srcs):
        d.copy_(g)


def _pack_cases(grads, offsets, flat, threads):
    """The fused pack, and the eager sequences that fill a preallocated bucket the same way."""
    flag = torch.zeros(1, dtype=torch.int32, device=flat.device)
    slices = list(flat.split([g.numel() for g in grads]))

    def dk_pack():
        bk.pack(grads, flat, offsets, PACK_SCALE, flag, num_threads=threads)

    def foreach_pack():
        torch._foreach_copy_(slices, grads)
        flat.mul_(PACK_SCALE)

    def loop_pack():
        _copy_each(slices, grads)
        flat.mul_(PACK_SCALE)

    dk_pack()
    ours = flat.clone()
    checks = [flag.item() == 0]
    for fn in (foreach_pack, loop_pack):
        fn()
        checks.append(_same(flat, ours))
    nbytes = sum(g.numel() for g in grads) * (4 + 2)
    impls = {"dk": dk_pack, "foreach_copy_+mul_": foreach_pack, "copy_ loop+mul_": loop_pack}
    return nbytes, all(checks), impls


def _unpack_cases(grads, offsets, flat, threads):
    """The fused unpack, and the eager sequences that unscale into the gradients with a
    non-finite check (GradScaler's own kernel among them)."""
    device = flat.device
    counts = [g.numel() for g in grads]
    slices = list(flat.split(counts))
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    inv = torch.full((1,), INV_LOSS_SCALE, device=device)
    found = torch.zeros(1, device=device)
    bk.pack(grads, flat, offsets, 1.0)

    def dk_unpack():
        bk.unpack(flat, grads, offsets, inv, flag, num_threads=threads)

    def amp_foreach_unpack():
        torch._foreach_copy_(grads, slices)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)

    def amp_loop_unpack():
        _copy_each(grads, slices)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)

    def mul_isfinite_unpack():
        torch._foreach_copy_(grads, slices)
        torch._foreach_mul_(grads, INV_LOSS_SCALE)
        found.copy_(torch.stack([g.isfinite().all() for g in grads]).all().logical_not())

    dk_unpack()
    ours = [g.clone() for g in grads]
    checks = [flag.item() == 0]
    impls = {
        "dk": dk_unpack,
        "foreach_copy_+_amp_unscale_": amp_foreach_unpack,
        "copy_ loop+_amp_unscale_": amp_loop_unpack,
        "foreach_copy_+mul_+isfinite": mul_isfinite_unpack,
    }
    for name, fn in impls.items():
        if name != "dk":
            fn()
            checks.append(all(_same(a, b) for a, b in zip(ours, grads)) and found.item() == 0)
    nbytes = sum(counts) * (2 + 4)
    return nbytes, all(checks), impls


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
    return nbytes, ok, {"dk": dk_unscale, "_amp_foreach_unscale_": torch_unscale}


def _copy_bandwidth(grads, device: str, repeats: int) -> float:
    src = torch.cat(grads)
    dst = torch.empty_like(src)
    (seconds,) = time_calls([lambda: dst.copy_(src)], device, repeats)
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
    rows = []
    for num in tensor_counts:
        grads, offsets, flat = _setup(num, total_bytes, device)
        copy_gbps = _copy_bandwidth(grads, device, repeats) if device == "cuda" else None
        for op, cases in (("pack", _pack_cases), ("unpack", _unpack_cases),
                          ("unscale", _unscale_cases)):  # fmt: skip
            nbytes, ok, impls = cases(grads, offsets, flat, threads)
            if not ok:  # a fast wrong answer is no result: nothing of it is timed
                raise SystemExit(f"bench_bucket: {op} with {num} tensors: eager and fused differ")
            # interleaved in blocks, so that a shared machine's load hits every impl alike
            seconds = dict(zip(impls, time_calls(list(impls.values()), device, repeats)))
            best = min((name for name in seconds if name != "dk"), key=seconds.get)
            for name, t in seconds.items():
                gbps = nbytes / t / 1e9
                rows.append({
                    "op": op, "device": device, "tensors": num, "bytes": nbytes,
                    "impl": name, "time_us": t * 1e6, "gbps": gbps, "best": best,
                    "speedup_vs_best": seconds[best] / t, "correct": ok,
                    "copy_fraction": gbps / copy_gbps if copy_gbps else None,
                })  # fmt: skip
    return rows


def bucket_rows(device: str, sizes, repeats: int) -> list:
    """bench_kernels.py's bucket section.

    Each size is the total FP32 gradient bytes, split into 1, 100 and 1000 tensors; each row's
    baseline is the fastest eager sequence of its op, named.
    """
    rows = []
    for size in sizes:
        results = measure_cases(device, [1, 100, 1000], size, repeats)
        by_key = {(r["op"], r["tensors"], r["impl"]): r for r in results}
        for (op, num, impl), r in by_key.items():
            if impl != "dk":
                continue
            best = by_key[(op, num, r["best"])]
            case = f"{op} {num} tensors" + (" fp32<->bf16 x scale" if op != "unscale" else "")
            rows.append(Row("bucket", case, size, r["bytes"], r["time_us"] / 1e6,
                            r["best"], best["time_us"] / 1e6))  # fmt: skip
    return rows


def format_rows(rows: List[Dict]) -> str:
    width = max(len(r["impl"]) for r in rows) if rows else 4
    header = (
        f"{'op':>8} {'tensors':>7} {'impl':>{width}} {'time(us)':>10} {'GB/s':>7} {'x best':>7}"
    )
    header += f" {'ok':>3}" + (f" {'%copy':>6}" if rows and rows[0]["copy_fraction"] else "")
    lines = [header]
    for r in rows:
        line = (
            f"{r['op']:>8} {r['tensors']:>7} {r['impl']:>{width}} {r['time_us']:>10.0f} "
            f"{r['gbps']:>7.2f} {r['speedup_vs_best']:>7.2f} {'yes' if r['correct'] else 'NO':>3}"
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
