"""Shared-memory rendezvous and the single-host backend of :class:`Communicator`.

The local leader (lowest rank of the host) creates a segment with a random name, formats it
and publishes the name through the torch.distributed Store; every local rank maps it, says so
in the store, and the leader unlinks the name once all have mapped it. From then on the
segment lives exactly as long as the mappings: a crash leaks nothing in /dev/shm.
"""

from __future__ import annotations

import datetime
import os
from typing import List, Optional, Sequence

import torch
from torch.autograd import profiler as _torch_profiler

from .. import _C
from ..debug import flight_recorder
from ..debug.profiler import ProfiledCalls
from .cost_model import load_model


def wait_keys(store, keys: Sequence[str], timeout: datetime.timedelta) -> None:
    """Blocks until every key exists in ``store`` (raises on the store's timeout)."""
    if keys:
        store.wait(list(keys), timeout)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class ShmBackend:
    """The ranks of one host over one shared segment (``_C.CpuCommunicator``).

    Args:
        store: a store private to this communicator instance and host.
        local_rank: this rank's index among the host's ranks.
        local_size: number of ranks on this host.
        timeout: per-collective timeout.
        rendezvous_timeout: how long setup and :meth:`empty` wait for peers in the store.
        label: the rank number used in error messages (the group rank).
        debug_group: (name, description, global ranks of the host's members) of the group in
            flight-recorder dumps and profiler events.

    Calls are recorded by the C++ flight recorder (``DK_TRACE_BUFFER_SIZE``); while a torch
    profiler runs they go through :class:`~dist_kernels.debug.profiler.ProfiledCalls`, which
    wraps each in a ``record_param_comms`` event.
    """

    def __init__(
        self,
        store,
        local_rank: int,
        local_size: int,
        timeout: datetime.timedelta,
        rendezvous_timeout: datetime.timedelta,
        label: int,
        debug_group: Optional[tuple] = None,
    ) -> None:
        self.store = store
        self.local_rank = local_rank
        self.local_size = local_size
        self.timeout = timeout
        self.rendezvous_timeout = rendezvous_timeout
        self._next_buffer = 0
        segment_bytes = _C.shm_segment_bytes(local_size)
        segment = None
        try:
            # Local rank 0 decides what every rank must agree on (auto's algorithm choice
            # depends on `oversubscribed` and the fitted cost model): its affinity mask,
            # environment or files may differ.
            if local_rank == 0:
                segment = _C.ShmSegment.create(segment_bytes)
                _C.shm_format(segment, local_size)
                oversubscribed = local_size > usable_cores()
                checks = os.environ.get("DK_CHECK_DESCRIPTORS", "1") != "0"
                fitted = load_model().fitted_costs(local_size)
                costs = ",".join(repr(x) for x in fitted) or "-"
                store.set("segment", f"{segment.name} {int(oversubscribed)} {int(checks)} {costs}")
            else:
                wait_keys(store, ["segment"], rendezvous_timeout)
                name, over, chk, costs = store.get("segment").decode().split()
                oversubscribed, checks = over == "1", chk == "1"
                fitted = [] if costs == "-" else [float(x) for x in costs.split(",")]
                segment = _C.ShmSegment.open(name, segment_bytes)
            recorder = flight_recorder.new_recorder()
            self.impl = _C.CpuCommunicator(
                segment,
                local_rank,
                timeout.total_seconds(),
                oversubscribed,
                os.environ.get("DK_DEBUG", "0") not in ("", "0"),
                label,
                check_descriptors=checks,
                recorder=recorder,
                fitted_costs=fitted,
            )
        finally:
            self._mapped_then_unlink(segment, "segment", creator=local_rank == 0)
        name, desc, ranks = debug_group or (f"dk:{label}", "undefined", list(range(local_size)))
        self.debug_source = flight_recorder.Source(
            recorder, name, desc, ranks, local_rank, store, timeout.total_seconds()
        )
        if recorder is not None:
            flight_recorder.register(self, self.debug_source)
        self._profiled = ProfiledCalls(self.impl, self.debug_source)

    def _mapped_then_unlink(self, segment, what: str, creator: bool) -> None:
        """Store barrier: every rank says it mapped ``what``; its creator then unlinks it."""
        if segment is not None:
            self.store.set(f"{what}/mapped/{self.local_rank}", "1")
        if not creator:
            return
        try:
            keys = [f"{what}/mapped/{r}" for r in range(self.local_size)]
            wait_keys(self.store, keys, self.rendezvous_timeout)
        finally:
            if segment is not None:
                segment.unlink()

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor in a fresh registered segment (collective over the host's ranks)."""
        return self.empty_symmetric(shape, dtype)[self.local_rank]

    def empty_symmetric(self, shape: Sequence[int], dtype: torch.dtype) -> List[torch.Tensor]:
        """One fresh registered segment per rank (collective): entry r is local rank r's,
        mapped into this process, so a rank may write straight into a peer's memory."""
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        segments = self._register_segments(nbytes, tuple(shape), dtype)
        if nbytes == 0:
            return [torch.empty(tuple(shape), dtype=dtype) for _ in segments]
        return [
            torch.frombuffer(seg, dtype=torch.uint8, count=nbytes).view(dtype).view(tuple(shape))
            for seg in segments
        ]

    def _register_segments(self, nbytes: int, shape: tuple, dtype: torch.dtype) -> List:
        """Creates this rank's segment of ``nbytes``, maps every peer's and registers them
        with the C++ communicator (so collectives on them skip the copy-in)."""
        buffer_id = self._next_buffer
        self._next_buffer += 1
        what = f"buffer{buffer_id}"
        own = _C.ShmSegment.create(nbytes)
        try:
            self.store.set(f"{what}/name/{self.local_rank}", f"{own.name} {nbytes}")
            segments: List = []
            for r in range(self.local_size):
                if r == self.local_rank:
                    segments.append(own)
                    continue
                wait_keys(self.store, [f"{what}/name/{r}"], self.rendezvous_timeout)
                name, theirs = self.store.get(f"{what}/name/{r}").decode().split()
                if int(theirs) != nbytes:
                    raise ValueError(
                        f"empty: ranks disagree on the buffer size: local rank {r} asked for "
                        f"{theirs} bytes, local rank {self.local_rank} for {nbytes} "
                        f"(shape {shape}, {dtype})"
                    )
                segments.append(_C.ShmSegment.open(name, nbytes))
            self.impl.register_buffer(buffer_id, own, segments)
        finally:
            self._mapped_then_unlink(own, what, creator=True)
        return segments

    # Collectives: tensors were checked by the Communicator; the C++ core takes pointers.

    def all_reduce(self, t: torch.Tensor, code: int, op: int, algo: int, async_op: bool):
        impl = self._profiled if _torch_profiler._is_profiler_enabled else self.impl
        return impl.all_reduce(t.data_ptr(), t.numel(), code, op, algo, async_op)

    def reduce_scatter(self, out, inp, code: int, op: int, algo: int, async_op: bool):
        impl = self._profiled if _torch_profiler._is_profiler_enabled else self.impl
        return impl.reduce_scatter(
            out.data_ptr(), inp.data_ptr(), out.numel(), code, op, algo, async_op
        )

    def all_gather(self, out, inp, code: int, algo: int, async_op: bool):
        impl = self._profiled if _torch_profiler._is_profiler_enabled else self.impl
        return impl.all_gather(out.data_ptr(), inp.data_ptr(), inp.numel(), code, algo, async_op)

    def all_to_all(self, out, inp, sends, recvs, code: int, async_op: bool):
        impl = self._profiled if _torch_profiler._is_profiler_enabled else self.impl
        return impl.all_to_all(out.data_ptr(), inp.data_ptr(), sends, recvs, code, async_op)

    def broadcast(self, t, code: int, src: int, async_op: bool):
        impl = self._profiled if _torch_profiler._is_profiler_enabled else self.impl
        return impl.broadcast(t.data_ptr(), t.numel(), code, src, async_op)

    def send(self, t, code: int, dst: int, async_op: bool, tag: int = 0):
        impl = self._profiled if _torch_profiler._is_profiler_enabled else self.impl
        return impl.send(t.data_ptr(), t.numel(), code, dst, async_op, tag)

    def recv(self, t, code: int, src: int, async_op: bool, tag: int = 0):
        impl = self._profiled if _torch_profiler._is_profiler_enabled else self.impl
        return impl.recv(t.data_ptr(), t.numel(), code, src, async_op, tag)

    def recv_any(self, t, code: int, async_op: bool, tag: int = 0):
        return self.impl.recv_any(t.data_ptr(), t.numel(), code, async_op, tag)

    def barrier(self, async_op: bool):
        impl = self._profiled if _torch_profiler._is_profiler_enabled else self.impl
        return impl.barrier(async_op)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.timeout = timeout
        self.impl.set_timeout(timeout.total_seconds())

    def dead_peers(self) -> List[int]:
        """Local ranks found dead (translated to the communicator's ranks by the caller on
        one host: the local ranks are the communicator's)."""
        return list(self.impl.dead_peers())

    def abort(self, reason: str) -> None:
        """Fails the communicator on every rank (queued calls end at once)."""
        self.impl.abort(reason)

    def close(self) -> None:
        self.debug_source.closed = True
        self.impl.close()


def group_timeout(group) -> Optional[datetime.timedelta]:
    """The timeout a torch ProcessGroup was created with, if torch exposes it."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - private API; fall back to torch's default
        return None
