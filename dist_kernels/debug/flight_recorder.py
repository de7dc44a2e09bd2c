"""The flight recorders of this process, and their dump in torch's Flight Recorder format.

Each communicator owns a ``_C.FlightRecorder`` (csrc/comm/flight_recorder.h: the last
``DK_TRACE_BUFFER_SIZE`` calls, recorded in C++) and registers it here as a :class:`Source`,
with the names torch's analyzer shows for its group. :func:`dump` writes every source of the
rank into one file, ``<DK_TRACE_FILE><global rank>``, as the pickle torch's NCCL process group
writes (``FlightRecorder::dump``, format version 2.10), so that

    torchfrtrace --prefix dk_trace_rank_ /tmp

reads the ranks' dumps unchanged. Two deliberate departures, both forced by the analyzer:
``profiling_name`` must start with a torch backend's name (2.13 accepts nccl, gloo, xccl, ...
and rejects others), so CPU calls read ``gloo:all_reduce`` and CUDA calls ``nccl:all_reduce``;
``comm_lib_version`` says that dist_kernels ran them.

Record ids: torch numbers entries process-wide, and its analyzer aligns the ranks' dumps by
record id (it drops every entry older than the newest first entry of any rank). Ranks that made
different numbers of calls on other communicators before would then lose the entries that
matter, so ``record_id`` here counts the calls of the entry's own communicator (from 0): the
members of a group number the same calls alike. Entries are in the order they were created.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

DEFAULT_BUFFER_SIZE = 2000
DEFAULT_TRACE_FILE = "/tmp/dk_trace_rank_"
#: The dump format's version: torch 2.13's (FlightRecorder.hpp, ``version_val``).
FORMAT_VERSION = "2.10"

#: C++ DType code -> c10's name of the scalar type (what torch's dumps list as dtypes).
_DTYPE_NAMES = ("Float", "Double", "Half", "BFloat16", "Int", "Long", "Char", "Byte")

RanksLike = Union[Sequence[int], Callable[[], Sequence[int]]]


def buffer_size() -> int:
    """Entries kept per communicator: ``DK_TRACE_BUFFER_SIZE`` (default 2000; 0 turns the
    recorder off)."""
    text = os.environ.get("DK_TRACE_BUFFER_SIZE", str(DEFAULT_BUFFER_SIZE))
    try:
        size = int(text)
    except ValueError:
        raise ValueError(f"DK_TRACE_BUFFER_SIZE must be an integer >= 0, got {text!r}") from None
    if size < 0:
        raise ValueError(f"DK_TRACE_BUFFER_SIZE must be an integer >= 0, got {text!r}")
    return size


def trace_file_prefix() -> str:
    """``DK_TRACE_FILE``: dumps go to ``<prefix><global rank>`` (default /tmp/dk_trace_rank_)."""
    return os.environ.get("DK_TRACE_FILE", DEFAULT_TRACE_FILE)


def new_recorder():
    """A recorder for a new communicator, or None when ``DK_TRACE_BUFFER_SIZE=0``."""
    from .. import _C

    size = buffer_size()
    if size == 0:
        return None
    stacks = os.environ.get("DK_TRACE_PYTHON_STACK", "0") not in ("", "0")
    return _C.FlightRecorder(max(size, _trace_window), stacks)


class Source:
    """One communicator's recorder and how its group is named.

    Args:
        recorder: its ``_C.FlightRecorder``.
        name, desc: the group's name and description in the dump (torch's ``pg_config``).
        ranks: global ranks of the members in member order, or a function returning them
            (a "dk" process group learns them after torch registered it).
        rank: this rank's index among the members.
        store: a Store every member shares (failures and footprints are exchanged there),
            or None.
        timeout_s: the communicator's timeout.
        backend: what ``profiling_name`` starts with ("gloo" on CPU, "nccl" on CUDA).
        refresh: called before the recorder is read (a CUDA communicator marks the calls whose
            events completed: :class:`~dist_kernels.debug.stream_recorder.StreamRecorder`).
    """

    def __init__(
        self,
        recorder: Any,
        name: str,
        desc: str,
        ranks: RanksLike,
        rank: int,
        store: Any,
        timeout_s: float,
        backend: str = "gloo",
        refresh: Optional[Callable[[], None]] = None,
    ) -> None:
        self.recorder = recorder
        self.name, self.desc, self._ranks = name, desc, ranks
        self.rank, self.store, self.timeout_s, self.backend = rank, store, timeout_s, backend
        self.closed = False  # set by the owner's close(): the monitor then leaves it alone
        self._refresh = refresh

    def entries(self, last: Optional[int] = None) -> List[Dict[str, Any]]:
        """The recorder's entries (the newest ``last`` of them), oldest first."""
        if self._refresh is not None:
            self._refresh()
        return self.recorder.entries(last)

    def footprint(self) -> Dict[str, Any]:
        """The recorder's footprint (``_C.FlightRecorder.footprint``)."""
        if self._refresh is not None:
            self._refresh()
        return self.recorder.footprint()

    @property
    def ranks(self) -> List[int]:
        ranks = self._ranks() if callable(self._ranks) else self._ranks
        return [int(r) for r in ranks]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def rename(
        self,
        name: Optional[str] = None,
        desc: Optional[str] = None,
        ranks: Optional[RanksLike] = None,
    ) -> None:
        """Renames the group in later dumps (the "dk" backend's groups take torch's names)."""
        if name is not None:
            self.name = name
        if desc is not None:
            self.desc = desc
        if ranks is not None:
            self._ranks = ranks

    def __repr__(self) -> str:
        return f"Source({self.name!r}, rank {self.rank} of {self.world_size})"


_sources: List[Tuple[weakref.ref, Source]] = []  # (its owner, the source)
_lock = threading.Lock()
_trace_window = 0  # dk.debug.trace raises every recorder's capacity to this while it runs


def register(owner: Any, source: Source) -> Source:
    """Makes ``source`` part of this rank's dumps while ``owner`` (its communicator) lives."""
    with _lock:
        _sources.append((weakref.ref(owner), source))
    from . import monitor

    monitor.ensure_started()
    return source


def sources() -> List[Source]:
    """The registered sources of live communicators, in registration order."""
    with _lock:
        _sources[:] = [(owner, source) for owner, source in _sources if owner() is not None]
        return [source for _, source in _sources]


def global_rank() -> int:
    """This process's rank in the default group (the dump's file name)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    found = sources()
    return found[0].ranks[found[0].rank] if found else 0


def _sizes(count: int) -> List[List[int]]:
    return [[int(count)]]


def _profiling_name(source: Source, entry: Dict[str, Any]) -> str:
    op = entry["op"]
    if op == "send":
        op = f"send {source.rank}->{entry['peer']}"
    elif op == "recv":
        op = f"recv {source.rank}<-{entry['peer']}"
    return f"{source.backend}:{op}"


def torch_entry(source: Source, pg_id: int, entry: Dict[str, Any]) -> Dict[str, Any]:
    """One recorder entry in the keys and types of torch's ``getCollectiveTrace``."""
    dtype = _DTYPE_NAMES[entry["dtype"]] if 0 <= entry["dtype"] < len(_DTYPE_NAMES) else "Byte"
    started, completed = entry["started_ns"] or None, entry["completed_ns"] or None
    out = {
        "record_id": entry["op_id"] - 1,  # per communicator: see the module docstring
        "pg_id": pg_id,
        "process_group": (source.name, source.desc),
        "thread_name": "",
        "thread_id": "",
        "collective_seq_id": entry["collective_seq_id"],
        "p2p_seq_id": entry["p2p_seq_id"],
        "op_id": entry["op_id"],
        "profiling_name": _profiling_name(source, entry),
        "time_created_ns": entry["created_ns"],
        "input_sizes": _sizes(entry["in_count"]),
        "input_dtypes": [dtype],
        "output_sizes": _sizes(entry["out_count"]),
        "output_dtypes": [dtype],
        "state": entry["state"],
        "time_discovered_started_ns": started,
        "time_discovered_completed_ns": completed,
        "retired": completed is not None,
        "timeout_ms": int(source.timeout_s * 1000),
        "is_p2p": entry["is_p2p"],
    }
    if completed is not None and started is not None:
        out["duration_ms"] = (completed - started) / 1e6
    if entry["frames"]:
        out["frames"] = entry["frames"]
    return out


def dump_dict(found: Optional[Sequence[Source]] = None) -> Dict[str, Any]:
    """This rank's dump as torch's ``FlightRecorder::dump`` builds it (before pickling)."""
    from .._version import __version__

    found = [s for s in sources() if not s.closed] if found is None else found
    entries, pg_config, pg_status = [], {}, {}
    for pg_id, source in enumerate(found):
        pg_config[source.name] = {
            "name": source.name,
            "desc": source.desc,
            "ranks": str(source.ranks),
        }
        footprint = source.footprint()
        pg_status[str(pg_id)] = {
            "last_enqueued_collective": footprint["last_scheduled"],
            "last_started_collective": footprint["last_started"],
            "last_completed_collective": footprint["last_completed"],
        }
        entries += [torch_entry(source, pg_id, e) for e in source.entries()]
    entries.sort(key=lambda e: e["time_created_ns"])
    return {
        "version": FORMAT_VERSION,
        "pg_config": pg_config,
        "comm_lib_version": f"dist_kernels {__version__}",
        "pg_status": pg_status,
        "entries": entries,
    }


def dump(path: Optional[str] = None, communicators: Optional[Sequence[Any]] = None) -> str:
    """Writes this rank's flight recorders now; returns the file written.

    ``path`` defaults to ``DK_TRACE_FILE`` + this process's global rank. ``communicators``:
    only these (``dk.Communicator`` objects; default every open one of the rank). The file
    appears whole or not at all (written beside it, then renamed), so an analyzer never reads
    half of one.
    """
    path = path if path is not None else f"{trace_file_prefix()}{global_rank()}"
    found = None
    if communicators is not None:
        found = [c._debug_source for c in communicators if c._debug_source.recorder is not None]
    data = pickle.dumps(dump_dict(found))
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".dk_dump_", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def set_trace_window(entries: int) -> int:
    """Every recorder (and every one made from now on) keeps at least ``entries`` entries;
    returns the previous window. dk.debug.trace uses it so that its window is not cut."""
    global _trace_window
    previous, _trace_window = _trace_window, entries
    for source in sources():
        source.recorder.capacity = max(buffer_size(), entries)
    return previous
