"""Hierarchical CPU collectives across hosts (design decisions 4 and 14).

Inside a host the ranks use shared memory (:class:`~dist_kernels.comm.shm.ShmBackend`);
between hosts the data travels on Gloo, or on MPI where the job runs under an MPI launcher
(:mod:`~dist_kernels.comm.inter_host`). What is ours is the composition (MVAPICH2's
multi-leader design): every local rank carries 1/R of the inter-host leg on its own group
``cross[l]`` (:mod:`~dist_kernels.comm.host_layout`), all R at once, and large messages go
in chunks whose host and network stages overlap (:mod:`~dist_kernels.comm.stage_pipeline`)::

    all_reduce (multi_leader), per chunk:
        reduce-scatter on the host      (shm: local rank l holds the host's sum of slice l)
        all-reduce of slice l on cross[l]   (every local rank at once, one slice each)
        all-gather on the host          (shm)
    all_reduce (replicated), small messages: all-reduce on the host, then every local rank
        all-reduces the whole (tiny) buffer on its cross[l]: one network latency, no final
        host step; every cross group computes on identical inputs, so identical bits
    reduce_scatter: reorder the input local-major, reduce-scatter on the host, then across
        hosts on cross[l];  all_gather: the same steps backwards
    broadcast: on src's host a host broadcast, then each local rank broadcasts its slice on
        cross[l], then an all-gather on the other hosts (small: the whole buffer per group)
    all_to_all: on the host, local rank l collects every block bound for local rank l of any
        host; across hosts, cross[l] exchanges them (one message per host pair and group)
    flat: one Gloo collective over every rank (what a plain gloo process group runs)

``algorithm="auto"`` picks flat / replicated / multi_leader, the chunk count and the engine by
the fitted cost model (:mod:`~dist_kernels.comm.cost_model`); ``DK_INTER_HOST_ALGO`` and
``DK_INTER_HOST`` force them (as ``NCCL_ALGO`` does), read by rank 0 and shared. An explicit
"ring" / "tree" / "one_shot" applies to the shared-memory steps. Hosts with unequal rank
counts fall back to one leader per host. Every result reaches every rank through the same
copies, so results are bitwise identical; FP16 and BF16 cross hosts in FP32; AVG sums and
divides once, after the last sum.

Collectives and point-to-point calls run in issue order (:mod:`~.call_queue`): synchronously
on the caller's thread, or queued with ``async_op=True`` (a real :class:`Work`). A failure of
the inter-host leg (a host killed, a timeout) raises :class:`~dist_kernels.CommError` naming
the host, fails the host's shared memory (so the local peers raise too) and leaves the
communicator failed.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..dtypes import DTYPE_CODES, ReduceOp
from ..errors import CommError
from . import cost_model
from .call_queue import CallQueue
from .host_layout import HostLayout, split_even
from .inter_host import GlooLeg, MpiLeg, mpi_world
from .stage_pipeline import Stage, run_stages

_UINT8 = DTYPE_CODES[torch.uint8]
_HALF = (torch.float16, torch.bfloat16)


class _LegHandle:
    """A started inter-host call: a failed wait fails the communicator and raises CommError
    naming the host (``lost(engine, hosts, cause)`` builds it). ``wait(None)`` ends at the
    engine's own timeout: Gloo's group has the communicator's (a wait with a timeout polls:
    measured 2x slower at 8 B); MPI has none, and its job ends when a rank dies."""

    def __init__(
        self,
        handle,
        engine: str,
        suspects: Callable[[str], List[str]],
        lost: Callable[..., CommError],
    ) -> None:
        self.handle, self.engine, self.suspects, self.lost = handle, engine, suspects, lost

    def wait(self, timeout: Optional[float] = None) -> None:
        try:
            self.handle.wait(timeout)
        except RuntimeError as e:  # gloo's errors and mpi4py's MPI.Exception both are
            raise self.lost(self.engine, self.suspects(str(e)), e) from e

    def is_completed(self) -> bool:
        return self.handle.is_completed()


def _divide(t: torch.Tensor, n: int) -> None:
    if t.is_floating_point():
        t.div_(n)
    else:
        t.copy_(torch.div(t, n, rounding_mode="trunc"))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


def _offsets(counts: Sequence[int]) -> List[int]:
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out


def _gather_segments(src: torch.Tensor, segments: Sequence[Tuple[int, int]]) -> torch.Tensor:
    """The ``(offset, length)`` pieces of ``src``, back to back (one copy)."""
    pieces = [src[o : o + n] for o, n in segments if n]
    return torch.cat(pieces) if pieces else src[:0].clone()


class HierarchicalBackend:
    """Shared memory inside each host, Gloo or MPI between hosts; see the module docstring."""

    def __init__(
        self,
        comm,
        local,
        layout: HostLayout,
        legs: Dict[str, Any],
        peers: GlooLeg,
        settings: cost_model.HierarchySettings,
        addresses: Sequence[str],
    ) -> None:
        self.comm = comm
        self.local = local
        self.layout = layout
        self.rank, self.world_size = comm.rank, comm.world_size
        self.legs = legs  # engine -> this rank's cross group (empty if it is in none)
        self.peers = peers  # every rank: point-to-point between hosts, and flat collectives
        self.settings = settings
        self.addresses = list(addresses)
        self.hosts_n, self.local_n = layout.num_hosts, layout.local_size
        self.cross_index = layout.my_cross
        self._queue = CallQueue(f"dk-hierarchical-{self.rank}")
        self._failure: Optional[str] = None
        self._what = ""  # the call running now: what a lost host's error names
        self._choices: Dict[Tuple[str, int], cost_model.Choice] = {}
        self._scratch: Dict[torch.dtype, torch.Tensor] = {}

    # -- plumbing ------------------------------------------------------------------------------

    def _run(self, what: str, fn: Callable[[], Any], async_op: bool):
        def guarded():
            if self._failure is not None:
                raise CommError(self._failure)
            self._what = what
            try:
                return fn()
            except CommError as e:
                raise self._fail(str(e)) from e

        return self._queue.call(guarded, f"[rank {self.rank}] {what}", async_op)

    def _lost(self, what: str) -> Callable[..., CommError]:
        def lost(engine: str, hosts: List[str], cause: BaseException) -> CommError:
            named = ", ".join(
                f"{h} (ranks {', '.join(map(str, self._ranks_of_host(h)))})" for h in hosts
            )
            return self._fail(
                f"[rank {self.rank}] {what}: lost contact with host {named} over the "
                f"inter-host {engine} leg: {cause}"
            )

        return lost

    def _ranks_of_host(self, host: str) -> List[int]:
        return [r for r in range(self.world_size) if self.layout.hosts[r] == host]

    def _fail(self, reason: str) -> CommError:
        """Fails the communicator (the local peers raise at their next wait step); returns
        the error of the first failure."""
        if self._failure is None:
            self._failure = reason
            self.local.abort(reason)
            for leg in self._all_legs():
                leg.abort()
        return CommError(self._failure)

    def _all_legs(self) -> List[Any]:
        return [*self.legs.values(), self.peers]

    def _suspects(self, members: Sequence[int]) -> Callable[[str], List[str]]:
        """Hosts a failed call on ``members`` may have lost: those whose address the engine's
        message names, else every other host of the group."""
        mine = self.layout.hosts[self.rank]
        others = list(dict.fromkeys(self.layout.hosts[r] for r in members))
        others = [h for h in others if h != mine]

        def suspects(message: str) -> List[str]:
            named = [
                self.layout.hosts[r]
                for r in members
                if self.addresses[r] and f"[{self.addresses[r]}]" in message
            ]
            return list(dict.fromkeys(h for h in named if h != mine)) or others

        return suspects

    def _cross(self, engine: str, call: str, *args) -> Optional[_LegHandle]:
        """Starts ``call`` on this rank's cross group (None if it has none)."""
        leg = self.legs.get(engine)
        if leg is None:
            return None
        members = self.layout.cross_groups[self.cross_index]
        return self._start(leg, engine, call, args, self._suspects(members))

    def _flat(self, call: str, *args) -> _LegHandle:
        return self._start(self.peers, "gloo", call, args, self._suspects(range(self.world_size)))

    def _start(self, leg, engine: str, call: str, args, suspects) -> _LegHandle:
        """``leg.call(*args)`` as a _LegHandle; a group that already failed (a peer lost
        during an earlier call) may raise when the call is posted: that is the same loss."""
        lost = self._lost(self._what)
        try:
            handle = getattr(leg, call)(*args)
        except RuntimeError as e:  # gloo's errors and mpi4py's MPI.Exception both are
            raise lost(engine, suspects(str(e)), e) from e
        return _LegHandle(handle, engine, suspects, lost)

    def _local_call(self, call: str, *tensors, args=()) -> None:
        """Runs a shared-memory collective on the host, on this thread (nothing to do when the
        host has one rank). Synchronous on purpose: the inter-host calls started before it
        keep running on the engine's own threads, so a chunk's host stage overlaps its
        neighbours' network stage without handing every host stage to another thread
        (measured on the loaded 2-core VM: handing them to the shared-memory queue's thread
        cost more than the overlap gained)."""
        if self.local_n > 1:
            getattr(self.local, call)(*tensors, DTYPE_CODES[tensors[0].dtype], *args, False)

    def _choice(self, op: str, nbytes: int) -> cost_model.Choice:
        """The cost model's choice, once per (collective, size): it is the same every call."""
        key = (op, nbytes)
        choice = self._choices.get(key)
        if choice is None:
            engines = sorted(self.legs)
            choice = self.settings.choose(op, self.hosts_n, self.local_n, nbytes, engines)
            self._choices[key] = choice
        return choice

    def _scratch_for(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """``numel`` elements of a buffer kept across calls (the largest asked for, per dtype).
        Safe to share: collectives run one at a time on the call queue, each to its end. A
        fresh buffer per call pays its page faults on first touch: measured on the loaded
        2-core VM, a 64 MiB all-reduce's 32 MiB slice buffer cost a quarter of its time."""
        buf = self._scratch.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype)
            self._scratch[dtype] = buf
        return buf[:numel]

    def _stages_run(self, plan: List[List[Stage]]) -> None:
        run_stages(plan)  # every handle ends at its engine's timeout (see _LegHandle)

    # -- all_reduce ----------------------------------------------------------------------------

    def all_reduce(self, t: torch.Tensor, code: int, op: int, algo: int, async_op: bool):
        op = ReduceOp(op)
        return self._run("all_reduce", lambda: self._all_reduce(t, op, algo), async_op)

    def _all_reduce(self, t: torch.Tensor, op: ReduceOp, algo: int) -> None:
        choice = self._choice("all_reduce", t.numel() * t.element_size())
        flat = t.view(-1)
        if choice.kind == "flat":
            return self._flat_reduction(flat, op, "all_reduce", flat)
        if not self.layout.uniform:
            return self._stages_run([self._leader_stages(flat, op, algo)])
        if choice.kind == "replicated" or self.local_n == 1:
            pieces = split_even(flat.numel(), choice.chunks)
            plan = [
                self._replicated_stages(flat[o : o + n], op, algo, choice.engine) for o, n in pieces
            ]
            return self._stages_run(plan)
        r = self.local_n
        main = flat.numel() // r * r
        slices = self._scratch_for(t.dtype, main // r)
        plan = [
            self._multi_leader_stages(
                flat[o : o + n], slices[o // r : (o + n) // r], op, algo, choice.engine
            )
            for o, n in split_even(main, choice.chunks, granule=r)
        ]
        if main < flat.numel():  # fewer than R elements left: they go whole, replicated
            plan.append(self._replicated_stages(flat[main:], op, algo, choice.engine))
        self._stages_run(plan)

    @staticmethod
    def _sum_if_avg(op: ReduceOp) -> ReduceOp:
        return ReduceOp.SUM if op == ReduceOp.AVG else op

    def _widened(self, t: torch.Tensor) -> torch.Tensor:
        """What crosses hosts for a reduction: ``t`` itself, or an FP32 copy of FP16 / BF16."""
        return t.float() if t.dtype in _HALF else t

    def _finish(self, t: torch.Tensor, wide: torch.Tensor, op: ReduceOp) -> None:
        """AVG divides once, after the last sum; a widened copy goes back to ``t``."""
        if op == ReduceOp.AVG:
            _divide(wide, self.world_size)
        if wide is not t:
            t.copy_(wide)

    def _multi_leader_stages(self, piece, slice_, op, algo, engine) -> List[Stage]:
        """Reduce-scatter on the host, all-reduce of this rank's slice across, all-gather."""
        box: Dict[str, torch.Tensor] = {}
        sum_op = self._sum_if_avg(op)

        def across():
            box["wide"] = self._widened(slice_)
            return self._cross(engine, "all_reduce", box["wide"], sum_op)

        def gather():
            self._finish(slice_, box["wide"], op)
            return self._local_call("all_gather", piece, slice_, args=(self._gs(algo),))

        def reduce():
            args = (int(sum_op), self._gs(algo))
            return self._local_call("reduce_scatter", slice_, piece, args=args)

        return [reduce, across, gather]

    def _replicated_stages(self, piece, op, algo, engine) -> List[Stage]:
        """All-reduce on the host, then each local rank all-reduces the whole piece across."""
        box: Dict[str, torch.Tensor] = {}
        sum_op = self._sum_if_avg(op)

        def across():
            box["wide"] = self._widened(piece)
            return self._cross(engine, "all_reduce", box["wide"], sum_op)

        def finish():
            self._finish(piece, box["wide"], op)

        def reduce():
            return self._local_call("all_reduce", piece, args=(int(sum_op), algo))

        return [reduce, across, finish]

    def _leader_stages(self, piece, op, algo) -> List[Stage]:
        """Unequal hosts: all-reduce on the host, the leaders across, broadcast on the host."""
        box: Dict[str, torch.Tensor] = {}
        sum_op = self._sum_if_avg(op)

        def across():
            box["wide"] = self._widened(piece)
            return self._cross("gloo", "all_reduce", box["wide"], sum_op)

        def spread():
            if self.cross_index == 0:
                self._finish(piece, box["wide"], op)
            return self._local_call("broadcast", piece, args=(0,))

        def reduce():
            return self._local_call("all_reduce", piece, args=(int(sum_op), algo))

        return [reduce, across, spread]

    @staticmethod
    def _gs(algo: int) -> int:
        """The shared-memory algorithm code for reduce-scatter / all-gather (no tree: auto)."""
        return 0 if algo == 2 else algo

    def _flat_reduction(self, target, op: ReduceOp, call: str, *tensors) -> None:
        """One Gloo collective over every rank (``call`` on ``tensors``; ``target`` reduced)."""
        wide = [self._widened(t) for t in tensors]
        self._flat(call, *wide, self._sum_if_avg(op)).wait()
        self._finish(target, wide[0], op)

    # -- reduce_scatter / all_gather -----------------------------------------------------------

    def reduce_scatter(self, out, inp, code: int, op: int, algo: int, async_op: bool):
        op = ReduceOp(op)
        return self._run(
            "reduce_scatter", lambda: self._reduce_scatter(out, inp, op, algo), async_op
        )

    def _reduce_scatter(self, out, inp, op: ReduceOp, algo: int) -> None:
        choice = self._choice("reduce_scatter", inp.numel() * inp.element_size())
        if choice.kind == "flat":
            wide_out, wide_in = self._widened(out.view(-1)), self._widened(inp.view(-1))
            self._flat("reduce_scatter", wide_out, wide_in, self._sum_if_avg(op)).wait()
            return self._finish(out.view(-1), wide_out, op)
        if not self.layout.uniform:  # unequal hosts: an all-reduce of a copy, then the chunk
            full = inp.view(-1).clone()
            self._stages_run([self._leader_stages(full, op, algo)])
            n = out.numel()
            out.view(-1).copy_(full[self.rank * n : (self.rank + 1) * n])
            return None
        c = out.numel()
        rows = inp.view(self.world_size, c)
        order = self._local_major_index()
        plan = [
            self._reduce_scatter_stages(
                rows, order, out.view(-1)[a : a + n], a, op, algo, choice.engine
            )
            for a, n in split_even(c, choice.chunks)
        ]
        self._stages_run(plan)

    def _local_major_index(self) -> Optional[torch.Tensor]:
        order = self.layout.local_major_order()
        return None if order == list(range(self.world_size)) else torch.tensor(order)

    def _reduce_scatter_stages(self, rows, order, dst, a, op, algo, engine) -> List[Stage]:
        """Columns [a, a + len(dst)) of every rank's chunk: reorder, reduce on the host, across."""
        n = dst.numel()
        box: Dict[str, torch.Tensor] = {}
        sum_op = self._sum_if_avg(op)

        def reduce():
            part = rows[:, a : a + n]
            src = (part[order] if order is not None else part.contiguous()).view(-1)
            box["mid"] = src if self.local_n == 1 else src.new_empty(self.hosts_n * n)
            return self._local_call(
                "reduce_scatter", box["mid"], src, args=(int(sum_op), self._gs(algo))
            )

        def across():
            box["wide"], wide_mid = self._widened(dst), self._widened(box["mid"])
            return self._cross(engine, "reduce_scatter", box["wide"], wide_mid, sum_op)

        return [reduce, across, lambda: self._finish(dst, box["wide"], op)]

    def all_gather(self, out, inp, code: int, algo: int, async_op: bool):
        return self._run("all_gather", lambda: self._all_gather(out, inp, algo), async_op)

    def _all_gather(self, out, inp, algo: int) -> None:
        src, dst = _bytes(inp), _bytes(out)
        choice = self._choice("all_gather", dst.numel())
        if choice.kind == "flat":
            return self._flat("all_gather", dst, src).wait()
        if not self.layout.uniform:
            return self._all_gather_via_leaders(dst, src, algo)
        c = src.numel()
        rows = dst.view(self.world_size, c)
        order = self._local_major_index()
        plan = [
            self._all_gather_stages(src[a : a + n], rows, order, a, algo, choice.engine)
            for a, n in split_even(c, choice.chunks)
        ]
        self._stages_run(plan)

    def _all_gather_stages(self, piece, rows, order, a, algo, engine) -> List[Stage]:
        """Bytes [a, a + len(piece)) of every rank's input: across hosts, on the host, placed."""
        n = piece.numel()
        mid = piece.new_empty(self.hosts_n * n)
        gathered = mid if self.local_n == 1 else piece.new_empty(self.world_size * n)

        def place():
            block = gathered.view(self.world_size, n)
            if order is None:
                rows[:, a : a + n].copy_(block)
            else:
                rows[:, a : a + n].index_copy_(0, order, block)

        return [
            lambda: self._cross(engine, "all_gather", mid, piece),
            lambda: self._local_call("all_gather", gathered, mid, args=(self._gs(algo),)),
            place,
        ]

    def _all_gather_via_leaders(self, dst, src, algo) -> None:
        """Unequal hosts: gather on the host, the leaders exchange padded host blocks, and
        each leader's host gets the whole output by a host broadcast."""
        layout, c = self.layout, src.numel()
        block = src.new_empty(self.local_n * c)
        self._local_call("all_gather", block, src, args=(self._gs(algo),))
        if self.local_n == 1:
            block.copy_(src)
        widest = max(len(layout.ranks_on(h)) for h in range(self.hosts_n))
        if self.cross_index == 0:
            padded = src.new_zeros(widest * c)
            padded[: block.numel()].copy_(block)
            everything = src.new_empty(self.hosts_n * widest * c)
            self._cross("gloo", "all_gather", everything, padded).wait()
            rows, pieces = dst.view(self.world_size, c), everything.view(-1, c)
            for h in range(self.hosts_n):
                for i, r in enumerate(layout.ranks_on(h)):
                    rows[r].copy_(pieces[h * widest + i])
        self._local_call("broadcast", dst, args=(0,))

    # -- broadcast -----------------------------------------------------------------------------

    def broadcast(self, t, code: int, src: int, async_op: bool):
        return self._run("broadcast", lambda: self._broadcast(_bytes(t), src), async_op)

    def _broadcast(self, data: torch.Tensor, src: int) -> None:
        layout = self.layout
        src_host, src_local = layout.host_index(src), layout.local_rank_of(src)
        choice = self._choice("broadcast", data.numel())
        if choice.kind == "flat":
            return self._flat("broadcast", data, src).wait()
        if not layout.uniform:
            return self._broadcast_via_leaders(data, src_host, src_local)
        on_src_host = layout.my_host == src_host
        r = self.local_n
        if choice.kind == "replicated" or r == 1:
            main = 0
        else:
            main = data.numel() // r * r
        plan = [
            self._broadcast_slice_stages(
                data[o : o + n], on_src_host, src_host, src_local, choice.engine
            )
            for o, n in split_even(main, choice.chunks, granule=r)
        ]
        if main < data.numel():
            plan.append(
                self._broadcast_whole_stages(
                    data[main:], on_src_host, src_host, src_local, choice.engine
                )
            )
        self._stages_run(plan)

    def _broadcast_slice_stages(self, piece, on_src_host, src_host, src_local, engine):
        """src's host spreads the piece, each local rank sends its slice across, the other
        hosts put the slices together."""
        n = piece.numel() // self.local_n
        mine = piece[self.layout.local_rank * n : (self.layout.local_rank + 1) * n]
        slice_ = mine if on_src_host else piece.new_empty(n)

        def spread():
            return self._local_call("broadcast", piece, args=(src_local,)) if on_src_host else None

        def assemble():
            return None if on_src_host else self._local_call("all_gather", piece, slice_, args=(0,))

        return [spread, lambda: self._cross(engine, "broadcast", slice_, src_host), assemble]

    def _broadcast_whole_stages(self, piece, on_src_host, src_host, src_local, engine):
        def spread():
            return self._local_call("broadcast", piece, args=(src_local,)) if on_src_host else None

        return [spread, lambda: self._cross(engine, "broadcast", piece, src_host), lambda: None]

    def _broadcast_via_leaders(self, data, src_host, src_local) -> None:
        if self.layout.my_host == src_host:
            self._local_call("broadcast", data, args=(src_local,))
        if self.cross_index == 0:
            self._cross("gloo", "broadcast", data, src_host).wait()
        if self.layout.my_host != src_host:
            self._local_call("broadcast", data, args=(0,))

    # -- all_to_all ----------------------------------------------------------------------------

    def all_to_all(self, out, inp, sends, recvs, code: int, async_op: bool):
        size = inp.element_size()
        sends_b, recvs_b = [s * size for s in sends], [r * size for r in recvs]
        fn = (
            (lambda: self._all_to_all(_bytes(out), _bytes(inp), sends_b, recvs_b))
            if self.layout.uniform
            else (lambda: self._all_to_all_pairwise(_bytes(out), _bytes(inp), sends_b, recvs_b))
        )
        return self._run("all_to_all", fn, async_op)

    def _host_send_counts(self, sends: Sequence[int]) -> torch.Tensor:
        """``[local rank, peer]``: the byte counts every rank of this host sends every peer."""
        mine = torch.tensor(sends, dtype=torch.int64)
        if self.local_n == 1:
            return mine.view(1, -1)
        counts = mine.new_empty(self.local_n * mine.numel())
        self._local_call("all_gather", counts, mine, args=(0,))
        return counts.view(self.local_n, -1)

    def _all_to_all(self, out, inp, sends, recvs) -> None:
        """Two exchanges: on the host, to local rank l every block bound for local rank l of
        any host; across hosts on cross[l], one message per host (see the module docstring)."""
        layout, hosts, r, me = self.layout, self.hosts_n, self.local_n, self.layout.local_rank
        at = layout.rank_at
        host_sends = self._host_send_counts(sends).tolist()
        send_at = _offsets(sends)
        # 1. on the host: blocks for (h, l) grouped by l, then h
        outgoing = _gather_segments(
            inp, [(send_at[at(h, lr)], sends[at(h, lr)]) for lr in range(r) for h in range(hosts)]
        )
        to_local = [sum(sends[at(h, lr)] for h in range(hosts)) for lr in range(r)]
        sizes = [[host_sends[lr][at(h, me)] for h in range(hosts)] for lr in range(r)]
        from_local = [sum(row) for row in sizes]
        collected = inp.new_empty(sum(from_local))
        if r == 1:
            collected.copy_(outgoing)
        else:
            self.local.all_to_all(collected, outgoing, to_local, from_local, _UINT8, False)
        # 2. across hosts: to host h the blocks for (h, me) from every local rank, l order
        at_collected = _offsets([n for row in sizes for n in row])
        regroup = [
            (at_collected[lr * hosts + h], sizes[lr][h]) for h in range(hosts) for lr in range(r)
        ]
        to_host = [sum(sizes[lr][h] for lr in range(r)) for h in range(hosts)]
        from_host = [sum(recvs[at(h, lr)] for lr in range(r)) for h in range(hosts)]
        arrived = inp.new_empty(sum(from_host))
        self._cross(
            "gloo", "all_to_all", arrived, _gather_segments(collected, regroup), from_host, to_host
        ).wait()
        # 3. into place by source rank
        recv_at = _offsets(recvs)
        sources = [at(h, lr) for h in range(hosts) for lr in range(r)]
        offset = 0
        for s in sources:
            out[recv_at[s] : recv_at[s] + recvs[s]].copy_(arrived[offset : offset + recvs[s]])
            offset += recvs[s]

    def _all_to_all_pairwise(self, out, inp, sends, recvs) -> None:
        """Unequal hosts: point-to-point with every peer (shared memory on the host)."""
        send_at, recv_at, me = _offsets(sends), _offsets(recvs), self.rank
        out[recv_at[me] : recv_at[me] + recvs[me]].copy_(inp[send_at[me] : send_at[me] + sends[me]])
        handles = []
        for p in range(self.world_size):
            if p != me and recvs[p]:
                handles.append(self._post("recv", out[recv_at[p] : recv_at[p] + recvs[p]], p))
            if p != me and sends[p]:
                handles.append(self._post("send", inp[send_at[p] : send_at[p] + sends[p]], p))
        for h in handles:
            h.wait()

    # -- point-to-point, barrier, memory -------------------------------------------------------

    def _post(self, what: str, t: torch.Tensor, peer: int, tag: int):
        """Starts a send or receive: shared memory on this host, Gloo across hosts (both
        match receives by tag)."""
        layout = self.layout
        if layout.host_index(peer) == layout.my_host:
            code = DTYPE_CODES[t.dtype]
            return getattr(self.local, what)(t, code, layout.local_rank_of(peer), True, tag)
        return self._flat(what, t, peer, tag)

    def _check_cross_host_tag(self, what: str, peer: int, tag: int) -> None:
        if tag < 0 and self.layout.host_index(peer) != self.layout.my_host:
            raise ValueError(
                f"[rank {self.rank}] {what}: tag={tag} to rank {peer} on another host: gloo "
                f"carries messages between hosts and takes nonnegative tags only"
            )

    def send(self, t, code: int, dst: int, async_op: bool, tag: int = 0):
        self._check_cross_host_tag("send", dst, tag)
        return self._run("send", lambda: self._post("send", t, dst, tag), async_op)

    def recv(self, t, code: int, src: int, async_op: bool, tag: int = 0):
        self._check_cross_host_tag("recv", src, tag)
        return self._run("recv", lambda: self._post("recv", t, src, tag), async_op)

    def barrier(self, async_op: bool):
        def barrier():
            if self.local_n > 1:
                self.local.barrier(False)
            if self.cross_index == 0:
                self._cross("gloo", "barrier").wait()
            if self.local_n > 1:
                self.local.barrier(False)

        return self._run("barrier", barrier, async_op)

    def empty(self, shape, dtype):
        return self.local.empty(shape, dtype)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """Shared memory's and our Gloo legs' (MPI has no timeout of its own to set)."""
        self.local.set_timeout(timeout)
        for leg in (*self.legs.values(), self.peers):
            if isinstance(leg, GlooLeg):
                leg.pg._set_default_timeout(timeout)

    def abort(self, reason: str) -> None:
        self._fail(reason)

    def close(self) -> None:
        self._queue.close(wait=self._failure is None)
        self._scratch.clear()
        self.local.close()
        for leg in self._all_legs():
            leg.close()


# -- setup ------------------------------------------------------------------------------------


def _address() -> str:
    """This host's address as peers see it (how the engines' errors name a peer)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return ""


def connect(comm, local, hosts: Sequence[str], store) -> HierarchicalBackend:
    """The hierarchical backend of ``comm``: its inter-host groups, made from ``store``.

    Collective over the communicator's ranks: every rank makes the Gloo group over all ranks
    (point-to-point and flat collectives) and its own cross group (and the MPI one where the
    job runs under MPI); rank 0 shares the cost model and the DK_INTER_HOST* settings.
    """
    from .shm import usable_cores, wait_keys

    layout = HostLayout.of(hosts, comm.rank)
    rendezvous = max(comm.timeout, store.timeout)
    oversubscribed = layout.local_size > usable_cores()
    settings = cost_model.shared_settings(store, comm.rank, rendezvous, oversubscribed)
    store.set(f"addr/{comm.rank}", _address())
    world = mpi_world() if settings.engine in ("auto", "mpi") else None
    store.set(f"mpi/{comm.rank}", str(world.Get_rank() if world is not None else -1))
    keys = [f"{k}/{r}" for k in ("addr", "mpi") for r in range(comm.world_size)]
    wait_keys(store, keys, rendezvous)
    addresses = [store.get(f"addr/{r}").decode() for r in range(comm.world_size)]
    mpi_ranks = [int(store.get(f"mpi/{r}")) for r in range(comm.world_size)]
    if settings.engine == "mpi" and min(mpi_ranks) < 0:
        raise RuntimeError(
            f"[rank {comm.rank}] Communicator: DK_INTER_HOST=mpi, but ranks "
            f"{[r for r, m in enumerate(mpi_ranks) if m < 0]} run under no MPI launcher"
        )
    legs: Dict[str, Any] = {}
    index = layout.my_cross
    if index >= 0:
        members = layout.cross_groups[index]
        prefix = dist.PrefixStore(f"gloo/cross{index}/", store)
        legs["gloo"] = GlooLeg(prefix, members.index(comm.rank), len(members), comm.timeout)
        if world is not None and min(mpi_ranks) >= 0:
            legs["mpi"] = MpiLeg(world, [mpi_ranks[r] for r in members], tag=index)
    if settings.engine == "mpi":
        legs.pop("gloo", None)
    peers = GlooLeg(
        dist.PrefixStore("gloo/peers/", store), comm.rank, comm.world_size, comm.timeout
    )
    return HierarchicalBackend(comm, local, layout, legs, peers, settings, addresses)
