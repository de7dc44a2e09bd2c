"""What the benchmark prints and saves: machine facts, the memcpy ceiling, tables, JSON, plot.

A row is a plain dict (it goes to JSON as is)::

    {"algorithm": "ring", "size": 1024, "count": 256, "type": "float32", "redop": "sum",
     "root": -1, "iters": 50, "warmup": 5, "busbw_factor": 1.0,
     "out_of_place": {"time_us": 9.1, "p50_us": 8.8, "p99_us": 12.0, "algbw": 0.11,
                      "busbw": 0.11, "wrong": 0, "vs_baseline": 80.2, "error": None},
     "in_place": {...}}

``vs_baseline`` is baseline time / our time, which equals our busbw / baseline busbw.
``time_us`` is nccl-tests' average (the slowest rank's); ``p50_us`` / ``p99_us`` are each rank's
percentiles over its iterations, the slowest rank's.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import statistics
import time
from typing import Any, Dict, List, Optional, Union

import torch

from .load import describe as describe_load
from .ops import PLACEMENTS

Row = Dict[str, Any]
SMALL_MAX = 64 << 10  # latency-bound sizes summarised below: 8 B .. 64 KiB
LARGE_MIN = 16 << 20  # bandwidth-bound sizes summarised below: 16 MiB and up
MEMCPY_BYTES = 64 << 20


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> Optional[float]:
    try:
        with open("/proc/meminfo") as meminfo:
            kib = int(meminfo.readline().split()[1])
        return round(kib / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        return None


def machine_info() -> Dict[str, Any]:
    """CPU, cores, memory, OS and load: enough to tell whether two runs are comparable."""
    return {
        "host": socket.gethostname(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": memory_gib(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cpu_round_trip_ns": _round_trip(),
    }


def _round_trip() -> Optional[float]:
    from ..info import cross_core_round_trip_ns

    ns = cross_core_round_trip_ns()
    return None if ns is None else round(ns, 1)


def memcpy_bandwidth(
    device: Union[str, torch.device] = "cpu", nbytes: int = MEMCPY_BYTES, reps: int = 10
) -> Dict[str, Any]:
    """One process's ``torch`` copy of ``nbytes`` on ``device``: GB/s = bytes copied / s (1e9).

    The best of ``reps`` copies is the ceiling (noise only ever slows a copy down).
    """
    device = torch.device(device)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the pages is not a copy
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    seconds = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        seconds.append(time.perf_counter() - start)
    return {
        "bytes": nbytes,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "best_gbps": nbytes / min(seconds) / 1e9,
        "median_gbps": nbytes / statistics.median(seconds) / 1e9,
    }


def human_bytes(size: float) -> str:
    """8 -> '8 B', 65536 -> '64 KiB', 3 << 20 -> '3 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:g} {unit}"
        size /= 1024
    return f"{size:g} GiB"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def header_lines(meta: Dict[str, Any]) -> List[str]:
    m, c = meta["machine"], meta["memcpy"]
    lines = [
        f"# dist_kernels.bench  {meta['date']}",
        f"# command: {meta['command']}  (launcher: {meta['launcher']})",
        f"# machine: {m['cpu']}, {m['cpus']} cpus ({m['cpus_usable']} usable), "
        f"{m['memory_gib']} GiB, {m['os']}, host {m['host']}, load average {m['load_average']}, "
        f"cache-line round trip between the first two CPUs {m.get('cpu_round_trip_ns')} ns",
        f"# python {m['python']}, torch {m['torch']} ({m['torch_threads']} threads per rank), "
        f"env {meta['env']}",
        f"# dist_kernels.build_info(): {json.dumps(meta['build_info'], sort_keys=False)}",
        f"# memcpy ceiling (one process, torch copy_ of {c['bytes'] >> 20} MiB on {c['device']}, "
        f"{c['threads']} threads): {c['best_gbps']:.2f} GB/s best, {c['median_gbps']:.2f} median",
        f"# op {meta['op']}, {meta['world_size']} ranks, device {meta['device']}, "
        f"buffers {meta['buffers_label']}",
        f"# baseline: {meta['baseline_label']}",
        f"# Gloo in the process: {'yes' if meta.get('gloo_in_process') else 'no'}; "
        f"competing load: {describe_load(meta.get('load'))}",
        f"# iterations: {meta['iteration_policy']}",
        f"# busbw = algbw * {meta['busbw_factor']:.4g} ({meta['busbw_formula']}); "
        "GB/s = 1e9 bytes/s; time = max over ranks of the per-op average; p50, p99 = max over "
        "ranks of each rank's percentiles over its iterations",
    ]
    if meta["baseline"]:
        lines.append(
            f"# vs {meta['baseline']} = {meta['baseline']} time / our time "
            f"(= our busbw / {meta['baseline']} busbw; > 1 is faster)"
        )
    lines += [f"# note: {note}" for note in meta["notes"]]
    return lines


_PREFIX = ("size", 12), ("count", 12), ("type", 8), ("redop", 5), ("root", 4), ("algo", 7)
_PREFIX_UNITS = ("(B)", "(elements)", "", "", "", "")
_CELL = ("time", 9), ("p50", 9), ("p99", 9), ("algbw", 7), ("busbw", 7), ("#wrong", 6), ("vs", 7)
_CELL_UNITS = ("(us)", "(us)", "(us)", "(GB/s)", "(GB/s)", "", "{baseline}")
_CELL_WIDTH = sum(width for _, width in _CELL) + len(_CELL) - 1


def _line(prefix: List[str], cell: List[str], last: str) -> str:
    head = " ".join(f"{text:>{w}}" for text, (_, w) in zip(prefix, _PREFIX))
    cells = "  ".join(
        " ".join(f"{text:>{w}}" for text, (_, w) in zip(cell, _CELL)) for _ in PLACEMENTS
    )
    return "#" + f"{head}  {cells}  {last:>7}"[1:]


def table_header(baseline: Optional[str]) -> List[str]:
    """Three comment lines: placement titles, column names, units; aligned with format_row."""
    prefix_width = sum(w for _, w in _PREFIX) + len(_PREFIX) - 1
    titles = "  ".join(f"{p.replace('_', '-'):^{_CELL_WIDTH}}" for p in PLACEMENTS)
    return [
        ("#" + " " * prefix_width + "  " + titles).rstrip(),
        _line([n for n, _ in _PREFIX], [n for n, _ in _CELL], "iters"),
        _line(
            list(_PREFIX_UNITS),
            [u.format(baseline=baseline or "-") for u in _CELL_UNITS],
            "it/wu",
        ),
    ]


def _time(us: float) -> str:
    return f"{us:9.2f}" if us < 1e5 else f"{us:9.0f}"


def ratio_text(ratio: float) -> str:
    """Three significant digits at most, so the column keeps its width: 0.87x, 12.3x, 866x."""
    return f"{ratio:.2f}x" if ratio < 10 else f"{ratio:.1f}x" if ratio < 100 else f"{ratio:.0f}x"


def _cell(result: Dict[str, Any], is_baseline: bool) -> str:
    if result.get("error"):
        return f"{'n/a':>9} {'':>9} {'':>9} {'':>7} {'':>7} {'':>6} {'':>7}"
    ratio = result.get("vs_baseline")
    vs = "" if is_baseline else ("-" if ratio is None else ratio_text(ratio))
    return (
        f"{_time(result['time_us'])} {_time(result['p50_us'])} {_time(result['p99_us'])} "
        f"{result['algbw']:7.2f} {result['busbw']:7.2f} "
        f"{result['wrong']:6d} {vs:>7}"
    )


def format_row(row: Row, baseline: Optional[str]) -> str:
    is_baseline = row["algorithm"] == baseline
    cells = "  ".join(_cell(row[p], is_baseline) for p in PLACEMENTS)
    iters = f"{row['iters']}/{row['warmup']}"
    return (
        f"{row['size']:12d} {row['count']:12d} {row['type']:>8} {row['redop']:>5} "
        f"{row['root']:4d} {row['algorithm']:>7}  {cells}  {iters:>7}"
    )


def error_lines(rows: List[Row]) -> List[str]:
    seen, lines = set(), []
    for row in rows:
        for placement in PLACEMENTS:
            error = row[placement].get("error")
            key = (row["algorithm"], placement, error)
            if error and key not in seen:
                seen.add(key)
                lines.append(f"# n/a: {row['algorithm']} {placement}: {error}")
    return lines


def _span(values: List[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}} - {hi:{fmt}}"


def _ok(rows: List[Row], placement: str = "in_place") -> List[Row]:
    return [r for r in rows if not r[placement].get("error")]


def summary_placement(meta: Dict[str, Any]) -> str:
    """The placement summarised and plotted: in-place, or out-of-place for an op without it."""
    return meta.get("summary_placement", "in_place")


def summary_lines(rows: List[Row], meta: Dict[str, Any]) -> List[str]:
    """In-place (else out-of-place) results at latency- and bandwidth-bound sizes, per algorithm."""
    baseline, ceiling = meta["baseline"], meta["memcpy"]["best_gbps"]
    placement = summary_placement(meta)
    title = placement.replace("_", "-")
    lines = [f"# summary ({title}; ranges over sizes; memcpy ceiling {ceiling:.2f} GB/s)"]
    for algorithm in meta["algorithms"] + ([baseline] if baseline else []):
        mine = _ok([r for r in rows if r["algorithm"] == algorithm], placement)
        small = [r[placement] for r in mine if r["size"] <= SMALL_MAX]
        large = [r[placement] for r in mine if r["size"] >= LARGE_MIN]
        parts = []
        if small:
            part = f"<= 64 KiB: {_span([s['time_us'] for s in small], '.1f')} us"
            if algorithm != baseline and all(s["vs_baseline"] for s in small):
                part += f" ({_span([s['vs_baseline'] for s in small], '.1f')}x vs {baseline})"
            parts.append(part)
        if large:
            busbw = [s["busbw"] for s in large]
            part = f">= 16 MiB: busbw {_span(busbw, '.2f')} GB/s"
            if algorithm != baseline and all(s["vs_baseline"] for s in large):
                part += f" ({_span([s['vs_baseline'] for s in large], '.2f')}x vs {baseline}"
                part += f", {_span([b / ceiling for b in busbw], '.2f')} of memcpy)"
            else:
                part += f" ({_span([b / ceiling for b in busbw], '.2f')} of memcpy)"
            parts.append(part)
        lines.append(f"#   {algorithm:>7}: " + ("; ".join(parts) or "no sizes in these ranges"))
    wrong = sum(r[p]["wrong"] or 0 for r in rows for p in PLACEMENTS if not r[p].get("error"))
    lines.append(f"# total #wrong: {wrong}")
    lines.append(
        f"# load average at start {meta['machine']['load_average']}, at end "
        f"{meta.get('load_average_end')} ({meta['machine']['cpus']} cpus): a load above the "
        "cpu count means other work shared the machine and the times are inflated"
    )
    return lines


def layer_overhead_lines(rows: List[Row], meta: Dict[str, Any], layer: str, direct: str):
    """What ``layer`` (torch's API on a dk group) adds over ``direct`` (the same communicator
    called directly): time added at latency-bound sizes, busbw kept at bandwidth-bound ones."""
    placement = summary_placement(meta)
    if layer not in meta["algorithms"] or direct not in meta["algorithms"]:
        return []
    ok = _ok(rows, placement)
    by_size: Dict[int, Dict[str, Dict[str, Any]]] = {}
    for r in ok:
        by_size.setdefault(r["size"], {})[r["algorithm"]] = r[placement]
    pairs = [
        (s, c[layer], c[direct]) for s, c in sorted(by_size.items()) if layer in c and direct in c
    ]
    small = [a["time_us"] - b["time_us"] for s, a, b in pairs if s <= SMALL_MAX]
    large = [a["busbw"] / b["busbw"] for s, a, b in pairs if s >= LARGE_MIN and b["busbw"]]
    parts = []
    if small:
        parts.append(f"<= 64 KiB: {_span(small, '+.1f')} us per call")
    if large:
        parts.append(f">= 16 MiB: {_span(large, '.2f')}x the busbw")
    if not parts:
        return []
    return [f"# ProcessGroup layer ({layer} over {direct}): " + "; ".join(parts)]


def gloo_comparison_lines(without: List[Row], with_gloo: List[Row], meta: Dict[str, Any]):
    """Per size and algorithm, p50 / p99 without Gloo in the process and with it (``--gloo
    both``): the ratio with / without shows what Gloo's threads cost, sizes up to 64 KiB."""
    placement = summary_placement(meta)
    before = {(r["algorithm"], r["size"]): r[placement] for r in _ok(without, placement)}
    lines = [
        f"# Gloo in the process ({placement.replace('_', '-')}, sizes <= 64 KiB): p50 / p99 "
        "in us without Gloo -> with Gloo (with / without)"
    ]
    for row in _ok(with_gloo, placement):
        old = before.get((row["algorithm"], row["size"]))
        if old is None or row["size"] > SMALL_MAX:
            continue
        new = row[placement]
        lines.append(
            f"#   {row['algorithm']:>7} {human_bytes(row['size']):>8}: "
            f"p50 {old['p50_us']:.2f} -> {new['p50_us']:.2f} "
            f"({ratio_text(new['p50_us'] / old['p50_us'])}), "
            f"p99 {old['p99_us']:.2f} -> {new['p99_us']:.2f} "
            f"({ratio_text(new['p99_us'] / old['p99_us'])})"
        )
    return lines


def write_json(path: str, meta: Dict[str, Any], rows: List[Row]) -> None:
    """Writes then renames, so a reader (or a run killed mid-write) never sees half a file."""
    with open(path + ".tmp", "w") as out:
        json.dump({"meta": meta, "rows": rows}, out, indent=1)
        out.write("\n")
    os.replace(path + ".tmp", path)


def plot(path: str, meta: Dict[str, Any], rows: List[Row]) -> None:
    """busbw against size, log-log, one line per algorithm and the baseline (in-place, or
    out-of-place for an op without in-place)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib: pip install matplotlib (or drop --plot)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    placement = summary_placement(meta)
    fig, axes = plt.subplots(figsize=(8, 5))
    for algorithm in meta["algorithms"] + ([meta["baseline"]] if meta["baseline"] else []):
        ok = _ok(rows, placement)
        mine = [r for r in ok if r["algorithm"] == algorithm and r[placement]["busbw"] > 0]
        if mine:
            style = "k--o" if algorithm == meta["baseline"] else "-o"
            sizes = [r["size"] for r in mine]
            busbw = [r[placement]["busbw"] for r in mine]
            axes.plot(sizes, busbw, style, ms=3, label=algorithm)
    ceiling = meta["memcpy"]["best_gbps"]
    axes.axhline(ceiling, color="grey", ls=":", label=f"memcpy {ceiling:.1f} GB/s")
    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: human_bytes(x)))
    axes.set_yscale("log")
    axes.set_xlabel("size (bytes)")
    axes.set_ylabel("busbw (GB/s)")
    axes.set_title(
        f"{meta['op']} {placement.replace('_', '-')} {meta['dtype']} {meta['redop']}, "
        f"{meta['world_size']} ranks, "
        f"{meta['device']}, {meta['buffers']} buffers\n{meta['machine']['cpu']}, "
        f"{meta['machine']['cpus']} cpus, load {meta['machine']['load_average'][0]}, "
        f"{meta['date']}",
        fontsize=9,
    )
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
