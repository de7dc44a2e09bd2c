"""Element-wise kernel benchmark: dist_kernels.ops against torch, in GB/s, as a table.

    python benchmarks/bench_kernels.py [--device cpu|cuda] [--sizes 4MiB 64MiB] [--repeats 20]
                                       [--torch-threads N] [--sections reduce cast adamw ...]

GB/s counts the bytes a kernel must move at least: every input read once plus the output
written once (``dst += src``: 3 buffers; an FP32 -> BF16 cast of n elements: 4n + 2n bytes),
divided by the median time of ``--repeats`` calls. Ours and torch's baseline are charged the
same bytes, so the ratio (ours / torch) is a speed ratio. The baseline is the strongest eager
sequence a careful user would write for the same result: preallocated outputs, in-place ops,
``torch._foreach_*`` and GradScaler's ``_amp_foreach_non_finite_check_and_unscale_``; where
there are several, each is checked to give our bits and the fastest is reported (named in the
``baseline`` column). Each case is checked against torch's result before it is timed.

Sections are plain functions ``section(device, sizes, repeats) -> iterable of Row`` (``Row`` and
the timing live in kernel_timing.py, which bench_bucket.py's section uses too). Each row is
printed as soon as it is measured (a generator section yields them one by one), so a run cut
short still shows what it measured.
"""

from __future__ import annotations

import argparse
import re
from typing import Iterator, List, Optional, Sequence

import torch
from bench_bucket import bucket_rows  # benchmarks/ is on sys.path when run as a script
from kernel_timing import Row, Section, time_calls

from dist_kernels import _C, ReduceOp, ops
from dist_kernels.dtypes import dtype_code


def parse_size(text: str) -> int:
    """'4MiB' -> 4194304; accepts B, KiB, MiB, GiB (and plain integers)."""
    match = re.fullmatch(r"(\d+)\s*(B|KiB|MiB|GiB)?", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"--sizes: cannot parse {text!r} (e.g. 4MiB, 64MiB)")
    unit = {"B": 1, None: 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[match.group(2)]
    return int(match.group(1)) * unit


def format_size(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"bench_kernels: {what}: result differs from torch; not timing it")


def _reduce_case(dtype: torch.dtype, size: int, device: str, repeats: int, parallel: bool) -> Row:
    n = size // torch.tensor([], dtype=dtype).element_size()
    gen = torch.Generator(device=device).manual_seed(0)
    dst = torch.randn(n, generator=gen, device=device).to(dtype)
    src = torch.randn(n, generator=gen, device=device).to(dtype)
    expected = dst.float() + src.float()
    check = dst.clone()
    ops.reduce_(check, src, op=ReduceOp.SUM)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    _check(torch.allclose(check.float(), expected, rtol=tol, atol=tol), f"{dtype} sum")

    if parallel or device == "cuda":
        run_ours = lambda: ops.reduce_(dst, src)  # noqa: E731
        ours, baseline = time_calls([run_ours, lambda: dst.add_(src)], device, repeats)
    else:  # both on one thread: torch's add_ too, or the row would compare 1 core with all
        run_ours = lambda: _reduce_one_thread(dst, src)  # noqa: E731
        saved = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            ours, baseline = time_calls([run_ours, lambda: dst.add_(src)], device, repeats)
        finally:
            torch.set_num_threads(saved)
    name = str(dtype).replace("torch.", "")
    threads = "" if parallel or device == "cuda" else " (1 thread)"
    return Row("reduce", f"{name} sum{threads}", size, 3 * size, ours, "add_", baseline)


def _reduce_one_thread(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Our kernel as the communicator runs it on each rank: one core, no thread pool."""
    ptrs = [dst.data_ptr(), src.data_ptr()]
    _C.kernels_reduce(dst.data_ptr(), ptrs, dst.numel(), dtype_code(dst.dtype), 0, parallel=False)


def reduce_rows(device: str, sizes: Sequence[int], repeats: int) -> Iterator[Row]:
    """dst += src with ops.reduce_ against torch's dst.add_(src): fp32 and bf16."""
    for size in sizes:
        yield _reduce_case(torch.float32, size, device, repeats, parallel=True)
        if device == "cpu":
            yield _reduce_case(torch.float32, size, device, repeats, parallel=False)
        yield _reduce_case(torch.bfloat16, size, device, repeats, parallel=True)


def _cast_case(dtype: torch.dtype, size: int, device: str, repeats: int) -> Row:
    n = size // 4
    scale = 1.0 / 1024
    src = torch.randn(n, generator=torch.Generator(device=device).manual_seed(1), device=device)
    dst = torch.empty(n, dtype=dtype, device=device)
    scratch = torch.empty_like(src)  # the baselines' preallocated FP32 product
    ops.cast_(dst, src, scale)
    ours = dst.clone()
    _check(torch.equal(ours.view(torch.int16), (src * scale).to(dtype).view(torch.int16)),
           f"cast to {dtype}")  # fmt: skip

    def mul_then_copy():  # one rounding, as ours: the FP32 product, then the cast
        torch.mul(src, scale, out=scratch)
        dst.copy_(scratch)

    def copy_then_mul():  # rounds twice; the same bits for a power-of-two scale (checked)
        dst.copy_(src)
        dst.mul_(scale)

    baselines = {"mul(out=)+copy_": mul_then_copy, "copy_+mul_": copy_then_mul}
    baselines = _same_result_only(baselines, dst, ours, f"cast to {dtype}")
    base_name, base_s, ours_s = _fastest_baseline(
        lambda: ops.cast_(dst, src, scale), baselines, device, repeats
    )
    name = str(dtype).replace("torch.", "")
    return Row("cast", f"fp32->{name} x scale", size, 6 * n, ours_s, base_name, base_s)


def _same_result_only(baselines, out: torch.Tensor, ours: torch.Tensor, what: str):
    """The baselines whose result in ``out`` is bit-identical to ours (the others compute
    something else on this data, e.g. a double rounding that differs); at least one."""
    same = {}
    for name, fn in baselines.items():
        out.fill_(0)
        fn()
        if torch.equal(out.view(torch.uint8), ours.view(torch.uint8)):
            same[name] = fn
    _check(bool(same), what)
    return same


def _fastest_baseline(ours, baselines, device: str, repeats: int):
    """(name, seconds) of the fastest baseline and our seconds, timed in the same blocks."""
    times = time_calls([ours, *baselines.values()], device, repeats)
    name, seconds = min(zip(baselines, times[1:]), key=lambda pair: pair[1])
    return name, seconds, times[0]


def cast_rows(device: str, sizes: Sequence[int], repeats: int) -> Iterator[Row]:
    """FP32 -> BF16 / FP16 with a scale: ops.cast_ against the fastest preallocated eager
    sequence with the same result (``mul(out=)`` then ``copy_``, or ``copy_`` then ``mul_``)."""
    for size in sizes:
        for dtype in (torch.bfloat16, torch.float16):
            yield _cast_case(dtype, size, device, repeats)


def copy_rows(device: str, sizes: Sequence[int], repeats: int) -> Iterator[Row]:
    """The device's copy bandwidth (dst.copy_(src): 2 buffers moved), for scale; CUDA only."""
    if device == "cuda":
        for size in sizes:
            yield _copy_case(size, device, repeats)


def _copy_case(size: int, device: str, repeats: int) -> Row:
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    (seconds,) = time_calls([lambda: dst.copy_(src)], device, repeats)
    return Row("copy", "device copy_", size, 2 * size, seconds, "-", None)


# AdamW: an element's step reads the parameter, gradient and both moments and writes back
# the parameter and moments (FP32 throughout)
ADAMW_BYTES_PER_ELEMENT = 4 * 4 + 3 * 4
ADAMW_TENSORS = (1, 100)


def adamw_rows(device: str, sizes: Sequence[int], repeats: int) -> Iterator[Row]:
    """One AdamW step (``size`` bytes of FP32 parameters in 1 and 100 tensors): FusedAdamW
    against torch.optim.AdamW's three implementations (``fused=True``, ``foreach=True``, the
    per-tensor loop), the fastest named. Checked first: one step of each from the same state
    agrees with ours to FP32 rounding (the update is not bitwise: orders differ)."""
    for size in sizes:
        for count in ADAMW_TENSORS:
            yield _adamw_case(size, count, device, repeats)


def _adamw_case(size: int, count: int, device: str, repeats: int) -> Row:
    from dist_kernels.optim import FusedAdamW

    numel = size // 4
    gen = torch.Generator().manual_seed(0)
    shapes = [len(part) for part in torch.arange(numel).tensor_split(count)]
    start = [torch.randn(n, generator=gen).to(device) for n in shapes]
    grads = [torch.randn(n, generator=gen).to(device) for n in shapes]

    def make(cls, **kwargs):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        for p, g in zip(params, grads):
            p.grad = g
        return params, cls(params, lr=1e-3, weight_decay=0.01, **kwargs)

    ours_params, ours = make(FusedAdamW)
    ours.step()
    baselines = {}
    for name, kwargs in (("AdamW(fused=True)", {"fused": True}),
                         ("AdamW(foreach=True)", {"foreach": True}),
                         ("AdamW(foreach=False)", {"foreach": False})):  # fmt: skip
        params, opt = make(torch.optim.AdamW, **kwargs)
        opt.step()
        error = max(((a - b).abs().max() / b.abs().max()).item()
                    for a, b in zip(ours_params, params))  # fmt: skip
        _check(error < 1e-5, f"adamw: {name} differs from FusedAdamW by {error:.1e}")
        baselines[name] = opt.step
    name, seconds, ours_s = _fastest_baseline(ours.step, baselines, device, repeats)
    moved = numel * ADAMW_BYTES_PER_ELEMENT
    return Row("adamw", f"step, {count} tensors", size, moved, ours_s, name, seconds)


#: bucket_rows: the fused bucket kernels (pack / unpack / unscale), from bench_bucket.py.
SECTIONS: List[Section] = [copy_rows, reduce_rows, cast_rows, bucket_rows, adamw_rows]


#: Columns and their widths: fixed, so each row can be printed as soon as it is measured.
COLUMNS = (
    ("section", 8),
    ("case", 38),
    ("size", 7),
    ("ours GB/s", 9),
    ("baseline", 28),
    ("base GB/s", 9),
    ("ours/base", 9),
)


def _line(cells: Sequence[str]) -> str:
    return "  ".join(c.ljust(w) for c, (_, w) in zip(cells, COLUMNS)).rstrip()


def format_header() -> str:
    return _line([name for name, _ in COLUMNS])


def format_row(row: Row) -> str:
    base = "-" if row.baseline_gbps is None else f"{row.baseline_gbps:.1f}"
    ratio = "-" if row.ratio is None else f"{row.ratio:.2f}x"
    cells = (row.section, row.case, format_size(row.size_bytes), f"{row.ours_gbps:.1f}")
    return _line((*cells, row.baseline, base, ratio))


def run_sections(
    sections: Sequence[Section], device: str, sizes: Sequence[int], repeats: int
) -> Iterator[Row]:
    """Every section's rows, one at a time, as they are measured."""
    for section in sections:
        yield from section(device, sizes, repeats)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=[4 << 20, 64 << 20])
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per case (median)")
    names = {section.__name__.removesuffix("_rows"): section for section in SECTIONS}
    parser.add_argument(
        "--sections", nargs="+", choices=list(names), default=list(names), help="what to run"
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch.set_num_threads for the baselines (default: torch's own choice)",
    )
    args = parser.parse_args(argv)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_kernels: --device cuda but torch sees no CUDA device")
    threads = f", torch threads {torch.get_num_threads()}" if args.device == "cpu" else ""
    print(f"device {args.device}, CPU kernel build {ops.cpu_isa()}{threads}")
    print("GB/s = (bytes read + bytes written, each buffer once) / median time\n")
    print(format_header(), flush=True)
    sections = [names[name] for name in args.sections]
    for row in run_sections(sections, args.device, args.sizes, args.repeats):
        print(format_row(row), flush=True)


if __name__ == "__main__":
    main()
