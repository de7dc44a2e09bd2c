"""Chrome traces of our calls, from the flight recorders: per rank, merged, and added to
torch.profiler's.

- :func:`trace` (``with dk.debug.trace("trace.json"):``) writes this rank's calls made inside
  the block, one row per communicator, each call a span from when it started to when it
  completed (its time queued behind earlier calls in the arguments): no torch.profiler needed.
- :func:`merge` puts ranks' traces (ours, or torch.profiler's) into one file, one process row
  per rank, on the wall clock they share; Perfetto (ui.perfetto.dev) and chrome://tracing open
  it.
- :func:`trace_handler` is an ``on_trace_ready`` for ``torch.profiler.profile``: it exports
  torch's trace and adds the same spans to it (torch's own ``record_param_comms`` events span
  only the call on the caller's thread; an asynchronous call runs later, on our threads).

Timestamps are microseconds since ``baseTimeNanoseconds`` (wall clock), as Kineto writes them
(its base is the start of the current 7889238-second interval, so both kinds line up).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence

from . import profiler
from .flight_recorder import Source, global_rank, set_trace_window, sources

#: Entries every recorder keeps while a trace is taken (the ring would drop older ones).
DEFAULT_TRACE_EVENTS = 100_000
_KINETO_INTERVAL_S = 7889238
_DTYPE_NAMES = ("Float", "Double", "Half", "BFloat16", "Int", "Long", "Char", "Byte")


def base_time_ns() -> int:
    """The base Kineto uses: the start of the current 7889238-second interval, in ns."""
    return (int(time.time()) // _KINETO_INTERVAL_S) * _KINETO_INTERVAL_S * 1_000_000_000


def _args(source: Source, entry: Dict[str, Any]) -> Dict[str, Any]:
    """torch's record_param_comms keys, and what the recorder adds."""
    dtype = entry["dtype"]
    args = {
        "Collective name": profiler.TORCH_NAMES.get(entry["op"], entry["op"]),
        "In msg nelems": entry["in_count"],
        "Out msg nelems": entry["out_count"],
        "dtype": _DTYPE_NAMES[dtype] if 0 <= dtype < len(_DTYPE_NAMES) else "Byte",
        "Group size": source.world_size,
        "Process Group Name": source.name,
        "Process Group Description": source.desc,
        "Process Group Ranks": str(source.ranks),
        "Rank": source.ranks[source.rank],
        "Seq": entry["p2p_seq_id"] if entry["is_p2p"] else entry["collective_seq_id"],
        "state": entry["state"],
        "algorithm": entry["algorithm"],
    }
    if entry["is_p2p"]:
        peer = source.ranks[entry["peer"]] if 0 <= entry["peer"] < source.world_size else -1
        args["Src Rank" if entry["op"] == "recv" else "Dst Rank"] = peer
    if entry["started_ns"]:
        args["queued us"] = (entry["started_ns"] - entry["created_ns"]) / 1e3
    return args


def span_events(
    start_ns: int, end_ns: int, base_ns: int, pid: Any, first_tid: int = 0
) -> List[Dict[str, Any]]:
    """Chrome trace events ("X" spans and thread names) of the calls created in
    ``[start_ns, end_ns]``, one thread row per communicator, from ``first_tid`` on."""
    events: List[Dict[str, Any]] = []
    for index, source in enumerate(sources()):
        tid = first_tid + index
        events.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
             "args": {"name": f"dk {source.name}"}}
        )  # fmt: skip
        for entry in source.entries():
            if not start_ns <= entry["created_ns"] <= end_ns:
                continue
            begin = entry["started_ns"] or entry["created_ns"]
            finish = entry["completed_ns"] or end_ns
            events.append(
                {"ph": "X", "cat": "dk_comm", "name": entry["op"], "pid": pid, "tid": tid,
                 "ts": (begin - base_ns) / 1e3, "dur": max(finish - begin, 0) / 1e3,
                 "args": _args(source, entry)}
            )  # fmt: skip
    return events


def _open(path: str, mode: str):
    return gzip.open(path, mode + "t") if path.endswith(".gz") else open(path, mode)


def _write(path: str, trace: Dict[str, Any]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with _open(tmp, "w") as f:
        json.dump(trace, f)
    os.replace(tmp, path)


def _read(path: str) -> Dict[str, Any]:
    with _open(path, "r") as f:
        return json.load(f)


def _distributed_info() -> Dict[str, Any]:
    import torch.distributed as dist

    size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return {"backend": "dk", "rank": global_rank(), "world_size": size}


@contextlib.contextmanager
def trace(path: str, max_events: int = DEFAULT_TRACE_EVENTS) -> Iterator[None]:
    """Writes this rank's calls made inside the block to the Chrome trace ``path``.

    ``{rank}`` in ``path`` becomes the global rank (each rank needs a file of its own). Every
    recorder keeps at least ``max_events`` entries meanwhile: a block with more calls than that
    per communicator loses its oldest ones.
    """
    path = path.format(rank=global_rank())
    previous = set_trace_window(max_events)
    start_ns = time.time_ns()
    try:
        yield
    finally:
        end_ns = time.time_ns()
        base, rank = base_time_ns(), global_rank()
        events = [
            {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}}
        ]
        events += span_events(start_ns, end_ns, base, rank)
        info = _distributed_info()
        _write(path, {"traceEvents": events, "baseTimeNanoseconds": base, "distributedInfo": info})
        set_trace_window(previous)


def _rank_of(trace: Dict[str, Any], fallback: int) -> int:
    info = trace.get("distributedInfo") or {}
    return int(info.get("rank", fallback))


def merge(paths: Sequence[str], output: str) -> str:
    """One trace of several ranks' traces (ours or torch.profiler's): process row r is rank r
    (from each trace's ``distributedInfo``, else its position in ``paths``)."""
    traces = [_read(p) for p in paths]
    bases = [int(t.get("baseTimeNanoseconds", 0)) for t in traces]
    base = min(bases) if bases else 0
    merged: List[Dict[str, Any]] = []
    for index, (trace, own_base) in enumerate(zip(traces, bases)):
        rank = _rank_of(trace, index)
        merged += list(_as_rank(trace.get("traceEvents", []), rank, (own_base - base) / 1e3))
    _write(output, {"traceEvents": merged, "baseTimeNanoseconds": base, "displayTimeUnit": "ms"})
    return output


def _as_rank(events: Iterable[Dict[str, Any]], rank: int, shift_us: float):
    """The events of one rank's trace on process row ``rank``, shifted to the merged base."""
    yield {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}}
    yield {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}}
    for event in events:
        if event.get("ph") == "M" and event.get("name") in ("process_name", "process_sort_index"):
            continue
        event = dict(event, pid=rank)
        if "ts" in event:
            event["ts"] = float(event["ts"]) + shift_us
        yield event


def trace_handler(directory: str, name: Optional[str] = None):
    """An ``on_trace_ready`` for ``torch.profiler.profile``: writes
    ``<directory>/<name or rank<r>>.pt.trace.json`` with our calls' spans added."""

    def handle(prof: Any) -> None:
        path = os.path.join(directory, f"{name or f'rank{global_rank()}'}.pt.trace.json")
        os.makedirs(directory, exist_ok=True)
        prof.export_chrome_trace(path)
        add_spans(path)

    return handle


def add_spans(path: str) -> None:
    """Adds our calls' spans to the torch.profiler trace ``path``, for the profiled window."""
    trace = _read(path)
    base = int(trace.get("baseTimeNanoseconds", 0))
    timed = [e for e in trace.get("traceEvents", []) if "ts" in e and e.get("ph") == "X"]
    if not timed:
        return
    start = base + int(min(float(e["ts"]) for e in timed) * 1e3)
    end = base + int(max(float(e["ts"]) + float(e.get("dur", 0)) for e in timed) * 1e3)
    pid = timed[0]["pid"]
    trace["traceEvents"] += span_events(start, end, base, pid, first_tid=_DK_TID_BASE)
    _write(path, trace)


#: Thread ids of our rows in a torch trace: far above any OS thread id, so they never collide.
_DK_TID_BASE = 1 << 40
