"""The debug monitor: one daemon thread per process, started with its first communicator.

It sleeps on the C++ wake-up pipe (csrc/common/debug_wakeup.h) and every second looks at the
communicators' Stores, like the heartbeat monitor of torch's NCCL process group:

- SIGUSR1 (``kill -USR1 <pid>``): dumps this rank's flight recorders (no other effect: the
  running collectives do not notice).
- A communicator of this rank fails (timeout, dead peer, ranks that disagree, ...): the dump
  is written first (it needs nothing but this process), then the failure is announced in the
  group's Store, the rank's final footprint published there, the other ranks' footprints
  gathered (for at most ``GRACE_S``) and the desync report printed on stderr.
- Another rank announced a failure in a Store this rank shares: the same, so that a rank
  which is not inside a collective (the one that skipped it, say) dumps and reports too.

While nothing fails, each communicator's footprint is refreshed in its Store every
``PUBLISH_S`` when it changed: a rank that died leaves its last one there.

A failure detected while the interpreter exits (an uncaught CommError) is still handled: an
``atexit`` hook finishes the handling before the communicators are torn down.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import sys
import threading
import time
from typing import Any, Dict, List, Optional

from . import desync
from .flight_recorder import Source, dump, global_rank, sources

POLL_S = 1.0  # how often the Stores are asked whether a peer failed
PUBLISH_S = 2.0  # footprints refreshed at most this often, when they changed
GRACE_S = 2.0  # how long a reporter waits for the other ranks' final footprints
EXIT_WAIT_S = 5.0  # how long an exiting rank waits for its group's reports (see finish)
FAILURE_KEY = "dk_debug/failure"
FINAL_KEY = "dk_debug/final"  # ranks that published their final footprint
REPORTED_KEY = "dk_debug/reported"  # ranks that printed their report


def _footprint_key(member: int) -> str:
    return f"dk_debug/footprint/{member}"


class _Watch:
    """What the monitor remembers about one source."""

    def __init__(self) -> None:
        self.handled = False  # its failure (local or a peer's) was handled
        self.published: Optional[tuple] = None  # the progress last published
        self.published_at = 0.0


class Monitor:
    """The thread, and what it found: :attr:`reports`."""

    def __init__(self) -> None:
        from .. import _C

        self._C = _C
        self._fd = _C.debug_wakeup_fd()
        self.sigusr1 = os.environ.get("DK_DUMP_ON_SIGUSR1", "1") != "0" and (
            _C.debug_handle_sigusr1()
        )
        self._lock = threading.Lock()  # watches and workers
        self._workers: List[threading.Thread] = []
        self._reported: List[Source] = []  # sources whose failure this rank reported
        self.reports: List[Dict[str, Any]] = []
        self._last_poll = 0.0
        self._stopping = False
        self._pid = os.getpid()  # a forked child inherits this object (and the exit hook)
        self._thread = threading.Thread(target=self._loop, name="dk-debug-monitor", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stopping:
            ready, _, _ = select.select([self._fd], [], [], POLL_S)
            reasons = os.read(self._fd, 4096) if ready else b""
            if self._stopping:
                break
            if b"U" in reasons:
                self._dump_now("SIGUSR1")
            try:
                self.check(poll_stores=time.monotonic() - self._last_poll >= POLL_S)
            except Exception as error:  # noqa: BLE001 - the monitor must outlive a bad Store
                print(f"[dk debug monitor] {error!r}", file=sys.stderr, flush=True)

    def _dump_now(self, why: str) -> Optional[str]:
        rank = global_rank()
        try:
            path = dump()
        except OSError as error:
            print(f"[rank {rank}] flight recorder dump failed ({why}): {error}", file=sys.stderr)
            return None
        print(f"[rank {rank}] flight recorder dumped to {path} ({why})", file=sys.stderr)
        return path

    @staticmethod
    def _watch(source: Source) -> _Watch:
        watch = getattr(source, "_monitor_watch", None)
        if watch is None:
            watch = source._monitor_watch = _Watch()
        return watch

    def check(self, poll_stores: bool) -> None:
        """Handles new failures (this rank's; a peer's when ``poll_stores``) and refreshes
        footprints; called by the thread and by the exit hook. Store calls happen outside the
        lock (a slow Store delays this thread, never another)."""
        if poll_stores:
            self._last_poll = time.monotonic()
        failed = []
        for source in sources():
            watch = self._watch(source)
            if watch.handled or source.closed:
                continue
            failure = self._failure(source, poll_stores)
            if failure is None:
                if poll_stores:
                    self._publish(source, watch, final=False)
                continue
            with self._lock:
                if watch.handled:
                    continue
                watch.handled = True
            failed.append((source, failure))
        if not failed:
            return
        self._dump_now("communicator failure")  # first: it needs nothing but this process
        for source, failure in failed:
            worker = threading.Thread(target=self._report, args=(source, failure), daemon=True)
            with self._lock:
                self._workers.append(worker)
            worker.start()

    def _failure(self, source: Source, poll_store: bool) -> Optional[tuple]:
        """(cause, detected ns, local) if ``source`` failed here or a member announced a
        failure in its Store."""
        footprint = source.footprint()
        if footprint["failed_op_id"]:
            return footprint["failure"], footprint["failed_ns"], True
        if poll_store and source.store is not None and source.store.check([FAILURE_KEY]):
            return source.store.get(FAILURE_KEY).decode(), time.time_ns(), False
        return None

    def _publish(self, source: Source, watch: _Watch, final: bool) -> None:
        if source.store is None:
            return
        now = time.monotonic()
        if not final and now - watch.published_at < PUBLISH_S:
            return
        progress = _progress(source.footprint())  # cheap: the entries only when it moved
        if not final and progress == watch.published:
            return
        footprint = desync.footprint(source, final)
        source.store.set(_footprint_key(source.rank), json.dumps(footprint))
        watch.published, watch.published_at = progress, now

    def _report(self, source: Source, failure: tuple) -> None:
        cause, detected_ns, local = failure
        store = source.store
        try:
            if store is not None:
                if local:
                    store.set(FAILURE_KEY, f"rank {source.ranks[source.rank]} saw: {cause}")
                self._publish(source, self._watch(source), final=True)
                store.add(FINAL_KEY, 1)
                prints = _gather(store, source.world_size)
            else:
                prints = {source.rank: desync.footprint(source, final=True)}
            text = desync.report(source.name, source.rank, source.ranks, prints, cause)
        except Exception as error:  # noqa: BLE001 - a report is best effort, never a new failure
            text = f"[rank {global_rank()}] desync report for {source.name!r} failed: {error!r}"
        print(text, file=sys.stderr, flush=True)
        report = {"group": source.name, "text": text, "detected_ns": detected_ns}
        self.reports.append(dict(report, time_ns=time.time_ns()))
        if store is not None:
            try:
                store.add(REPORTED_KEY, 1)
                self._reported.append(source)
            except Exception:  # noqa: BLE001 - the Store may be gone with its host rank
                pass

    def finish(self) -> None:
        """At interpreter exit: handles what failed just now, waits for this rank's reports and
        (at most EXIT_WAIT_S) for the other ranks' (a launcher such as torchrun kills the whole
        group once the first rank exits, which would cut their reports short), then stops the
        thread, so that no thread of ours is inside a C++ call when the interpreter goes."""
        if os.getpid() != self._pid:
            return
        deadline = time.monotonic() + EXIT_WAIT_S + GRACE_S
        # The thread first: it may be handling a failure right now (dumping, then starting the
        # report), and the list of reports is complete once it has stopped.
        self._stopping = True
        self._C.debug_notify("S")
        self._thread.join(max(0.0, deadline - time.monotonic()))
        try:
            self.check(poll_stores=False)  # what failed after its last look
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
        with self._lock:
            workers = list(self._workers)
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        for source in self._reported:
            _wait_for(source.store, REPORTED_KEY, source.world_size, deadline)


def _wait_for(store: Any, key: str, count: int, deadline: float) -> None:
    """Until the counter ``key`` reaches ``count`` or ``deadline`` passes."""
    try:
        while int(store.add(key, 0)) < count and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - a Store that went away ends the wait
        pass


def _progress(footprint: Dict[str, Any]) -> tuple:
    """What a published footprint would say, from the recorder's own (no entries read)."""
    keys = ("last_scheduled", "last_started", "last_completed", "last_p2p_scheduled")
    return tuple(footprint[k] for k in keys) + (
        footprint["last_p2p_completed"],
        footprint["failure"],
    )


def _gather(store: Any, world_size: int) -> Dict[int, Optional[Dict[str, Any]]]:
    """Every member's footprint: waits up to GRACE_S for all final ones, then takes what is
    there (a rank that never answered leaves its last periodic one, or none)."""
    _wait_for(store, FINAL_KEY, world_size, time.monotonic() + GRACE_S)
    prints: Dict[int, Optional[Dict[str, Any]]] = {}
    for member in range(world_size):
        key = _footprint_key(member)
        prints[member] = json.loads(store.get(key)) if store.check([key]) else None
    return prints


_monitor: Optional[Monitor] = None
_start_lock = threading.Lock()


def ensure_started() -> Monitor:
    """The process's monitor (started on first use, by the first communicator)."""
    global _monitor
    with _start_lock:
        if _monitor is None:
            _monitor = Monitor()
            atexit.register(_monitor.finish)
    return _monitor


def _forget_in_child() -> None:
    """A forked child starts its own monitor with its first communicator."""
    global _monitor
    _monitor = None


os.register_at_fork(after_in_child=_forget_in_child)


def reports() -> List[Dict[str, Any]]:
    """The desync reports this process printed: group, text, detection and print times (ns)."""
    return list(_monitor.reports) if _monitor is not None else []
