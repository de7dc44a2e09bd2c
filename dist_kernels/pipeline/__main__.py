"""``python -m dist_kernels.pipeline``: every schedule simulated for 4 to 64 stages.

    python -m dist_kernels.pipeline                                  # F = B = W, free transfers
    python -m dist_kernels.pipeline --times F=1,B=1.1,W=0.8 --p2p 0.05 --stages 4,8

One row per pipeline size and schedule: the predicted step time (in units of ``times``; one
rank's share of the model per action), the speed-up over 1F1B, the bubble as the share of the
step and as the paper counts it (idle inside a rank's span over its compute), and the most
activations a rank holds (micro-batches of its whole share of the model).
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Optional

from .schedules import SCHEDULES
from .simulator import TIME_KEYS, simulate


def _times(text: str) -> Dict[str, float]:
    out = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key not in TIME_KEYS or not value:
            raise argparse.ArgumentTypeError(f"expected KEY=SECONDS with KEY in {TIME_KEYS}")
        out[key] = float(value)
    return out


def _ints(text: str) -> List[int]:
    return [int(v) for v in text.split(",")]


def table(
    stages: List[int], per_stage: int, times: Dict[str, float], p2p: float, names: List[str]
) -> List[str]:
    """The rows of the table, header first."""
    lines = [
        f"{'stages':>6} {'m':>4} {'schedule':>17} {'step':>8} {'vs 1f1b':>7} {'bubble':>7} "
        f"{'rate':>6} {'peak act.':>9}"
    ]
    for p in stages:
        m = per_stage * p
        base = simulate("1f1b", p, m, times=times, p2p=p2p).step_time
        for name in names:
            sim = simulate(name, p, m, times=times, p2p=p2p)
            lines.append(
                f"{p:>6} {m:>4} {name:>17} {sim.step_time:>8.1f} {base / sim.step_time:>6.2f}x "
                f"{100 * sim.bubble_fraction:>6.1f}% {sim.bubble_rate:>6.3f} "
                f"{max(sim.peak_memory):>9.1f}"
            )
    return lines


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dist_kernels.pipeline", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--stages", type=_ints, default=[4, 8, 16, 32, 64], help="pipeline ranks")
    parser.add_argument(
        "--microbatches-per-stage", type=int, default=2, help="micro-batches = this x stages"
    )
    parser.add_argument("--times", type=_times, default={}, help="e.g. F=1,B=1,W=1,send=0.01")
    parser.add_argument("--p2p", type=float, default=0.0, help="transfer latency")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    args = parser.parse_args(argv)
    names = args.schedules.split(",")
    unknown = sorted(set(names) - set(SCHEDULES))
    if unknown:
        parser.error(f"unknown schedule(s) {unknown}; choose from {', '.join(SCHEDULES)}")
    times = {"F": 1.0, "B": 1.0, "W": 1.0, **args.times}
    print(f"times {times}, p2p {args.p2p}, micro-batches = {args.microbatches_per_stage} x stages")
    for line in table(args.stages, args.microbatches_per_stage, times, args.p2p, names):
        print(line, flush=True)


if __name__ == "__main__":
    main()
