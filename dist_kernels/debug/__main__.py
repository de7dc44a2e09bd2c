"""``python -m dist_kernels.debug merge trace_rank*.json -o merged.json``: one trace for Perfetto
from ranks' Chrome traces (dk.debug.trace's or torch.profiler's)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .trace import merge


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dist_kernels.debug")
    commands = parser.add_subparsers(dest="command", required=True)
    merging = commands.add_parser("merge", help="merge ranks' Chrome traces into one")
    merging.add_argument("traces", nargs="+", help="one trace per rank (.json or .json.gz)")
    merging.add_argument("-o", "--output", required=True, help="the merged trace")
    args = parser.parse_args(argv)
    print(merge(args.traces, args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
