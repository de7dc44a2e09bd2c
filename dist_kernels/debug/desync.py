"""The desync report: from every rank's footprint, which ranks never joined which collective,
which joined and did not finish, and where ranks called different things.

A footprint is what one rank's flight recorder says about its group: the last collective it
scheduled, started and completed (sequence numbers counted from 1 on every rank alike), and
what the unfinished ones were. Ranks publish theirs in the group's Store (every few seconds
while they run, and at once when a failure is detected: dist_kernels/debug/monitor.py); the
report itself is pure: :func:`report` reads footprints and writes lines, in the manner of
torch's desync report for NCCL (``TORCH_NCCL_DESYNC_DEBUG``)::

    [rank 0] desync report for group 'dk:0' (3 ranks) after: <the failure>
      - rank 1 finished collective #1, but didn't join collective #2
      - ranks [0, 2] joined but didn't finish collective #2
      - collective #2 differs: ranks [0] called all_reduce(...); ranks [2] called broadcast(...)
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

#: Descriptions kept per footprint of the collectives after the last completed one (a rank
#: can have queued many asynchronous ones; the first unfinished is the one that matters).
MAX_DESCRIBED = 8
#: How many of the newest entries a footprint looks through for those descriptions.
LOOK_BACK = 64

_SNAPSHOT_INDENT = "\t     "
_RED_OPS = ("sum", "prod", "max", "min", "avg")
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8")


def describe(entry: Mapping[str, Any]) -> str:
    """``all_reduce(count=4, float32, sum)``: a recorder entry as the report names it."""
    parts = [f"count={entry['in_count']}"]
    dtype = entry["dtype"]
    parts.append(_DTYPES[dtype] if 0 <= dtype < len(_DTYPES) else f"dtype {dtype}")
    if 0 <= entry["red_op"] < len(_RED_OPS):
        parts.append(_RED_OPS[entry["red_op"]])
    if entry["op"] == "broadcast":
        parts.append(f"root={entry['peer']}")
    elif entry["is_p2p"]:
        parts.append(f"peer={entry['peer']}")
    return f"{entry['op']}({', '.join(parts)})"


def footprint(source: Any, final: bool) -> Dict[str, Any]:
    """This rank's footprint from a recorder's ``Source``; ``final``: published after the
    failure."""
    f = source.footprint()
    first, last = f["last_completed"], min(f["last_scheduled"], f["last_completed"] + MAX_DESCRIBED)
    ops = {
        str(e["collective_seq_id"]): describe(e)
        for e in source.entries(LOOK_BACK)
        if not e["is_p2p"] and first <= e["collective_seq_id"] <= last
    }
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time_ns": time.time_ns(),
        "final": final,
        "last_scheduled": f["last_scheduled"],
        "last_started": f["last_started"],
        "last_completed": f["last_completed"],
        "p2p_pending": f["last_p2p_scheduled"] - f["last_p2p_completed"],
        "failure": f["failure"],
        "ops": ops,
    }


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


def _lagging(prints: Mapping[int, Mapping[str, Any]], ranks: Sequence[int]) -> List[str]:
    """The first collective some rank has not completed, and who stands where."""
    behind = min(p["last_completed"] for p in prints.values()) + 1
    never = [m for m, p in prints.items() if p["last_scheduled"] < behind]
    stuck = [m for m, p in prints.items() if p["last_scheduled"] >= behind > p["last_completed"]]
    if len(never) == len(prints):
        return [f"every rank finished collective #{behind - 1} and scheduled no other"]
    lines = []
    for member in never:
        done = prints[member]["last_completed"]
        lines.append(
            f"rank {ranks[member]} finished collective #{done}, but didn't join collective "
            f"#{behind} (count from 1)"
        )
    if stuck:
        lines.append(
            f"{_ranks([ranks[m] for m in stuck])} joined but didn't finish collective #{behind}"
        )
    lines += _differences(prints, ranks, behind)
    return lines


def _differences(prints: Mapping[int, Mapping[str, Any]], ranks: Sequence[int], seq: int):
    """A line naming who called what as collective ``seq``, when ranks called different ones."""
    callers: Dict[str, List[int]] = {}
    for member, p in prints.items():
        what = p["ops"].get(str(seq))
        if what is not None:
            callers.setdefault(what, []).append(ranks[member])
    if len(callers) < 2:
        return []
    said = "; ".join(f"{_ranks(who)} called {what}" for what, who in callers.items())
    return [f"collective #{seq} differs: {said}"]


def _snapshot(prints: Mapping[int, Mapping[str, Any]], ranks: Sequence[int]) -> List[str]:
    lines = ["snapshot of ranks' latest states:"]
    for member in sorted(prints):
        p = prints[member]
        seq = p["last_scheduled"]
        what = p["ops"].get(str(seq), "")
        line = (
            f"{_SNAPSHOT_INDENT}rank {ranks[member]} ({p['host']}, pid {p['pid']}): scheduled "
            f"#{seq} {what}, started #{p['last_started']}, completed #{p['last_completed']}"
        )
        if p["p2p_pending"]:
            line += f", {p['p2p_pending']} send/recv unfinished"
        if p["failure"]:
            line += ", failed"
        if not p["final"]:
            line += " (its footprint from before the failure: no answer since)"
        lines.append(line)
    return lines


def report(
    group: str,
    me: int,
    ranks: Sequence[int],
    prints: Mapping[int, Optional[Mapping[str, Any]]],
    cause: str,
) -> str:
    """The report rank ``ranks[me]`` prints for ``group``.

    Args:
        group: the group's name (as in the flight-recorder dump).
        me: this rank's index among the members.
        ranks: global ranks of the members, in member order.
        prints: member index -> footprint, or None for a member that published none.
        cause: what this rank saw fail.
    """
    found = {m: p for m, p in prints.items() if p is not None}
    silent = [ranks[m] for m in range(len(ranks)) if prints.get(m) is None]
    lines = []
    if silent:
        lines.append(
            f"{_ranks(silent)} published no footprint: dead, or never created this "
            f"communicator, or hung without releasing Python's GIL"
        )
    if found:
        lines += _lagging(found, ranks)
        lines += _snapshot(found, ranks)
    head = (
        f"[rank {ranks[me]}] desync report for group {group!r} ({len(ranks)} ranks) after: {cause}"
    )
    body = [line if line.startswith(_SNAPSHOT_INDENT) else f"\t - {line}" for line in lines]
    return "\n".join([head] + body)
