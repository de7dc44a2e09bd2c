"""BucketReducer: the one object that owns an engine's gradient buckets through backward.

DistributedDataParallel holds one as ``ddp.reducer``, ShardedOptimizer as ``opt.reducer``. It
holds the bucket plan (which parameter pieces each bucket holds), one backward's readiness
(which gradients arrived, how many pieces each bucket still waits for), the launch order, the
collectives in flight, and the end: launch the rest, wait, unpack. What moving one bucket means
(its memory, how gradients get in, which collective runs, where the result goes) is the
*collective* it was built with, and only the reducer calls it:

    owner (hook, schedule)      BucketReducer                      collective
    begin()  ---------------->  a new pass              -------->  begin(...)
    grad_ready(i)  ---------->  each piece of parameter i -------->  deliver(bucket, slot)
                                bucket complete, and every
                                earlier one launched    -------->  launch(bucket, ...) -> handle
    launch_rest(status)  ---->  every bucket not launched yet
    wait()  ----------------->                          -------->  wait(handles, ...) -> status
    unpack(...)  ------------>                          -------->  unpack(...)

Collectives: ``all_reduce.AllReduce`` (DDP: registered buckets, all-reduce, ``.grad`` views),
``comm_hook.CommHook`` (DDP with a communication hook), ``all_reduce.InPlace`` (DDP on one rank:
nothing to send), ``reduce_scatter.ReduceScatter`` (ZeRO: into each rank's gradient shard).

Invariants, the same on every rank:

* buckets launch strictly in plan order, so every rank issues the same collectives in the same
  order however its gradients arrive;
* ``window`` (if set) lets only the buckets ``[next launch, next launch + window)`` take
  gradients, and completes bucket ``b - window`` before bucket ``b`` takes its first one: their
  memory is reused (ZeRO's staging buffers);
* ``grad_ready`` is a plain call, not an autograd hook: engines call it from their hooks, a
  schedule may call it when it computes a weight gradient, and ``groups`` may name a different
  Communicator per bucket (the collective reduces bucket ``b`` over ``groups[b]``).

The reducer never reads its owner's attributes: what it needs comes in at construction or in
these calls.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .plan import STATUS_OK, Bucket, BucketPlan, rebuilt_order

__all__ = ["BucketReducer"]


class _Pass:
    """Bookkeeping of one backward (or of a joined rank's stand-in for one)."""

    def __init__(self, buckets: Sequence[Bucket], num_params: int) -> None:
        self.pending = [len(b.slots) for b in buckets]  # pieces still to deliver, per bucket
        self.ready = [False] * num_params
        self.used = [False] * num_params
        self.ready_order: List[int] = []  # parameters with a gradient, in arrival order
        self.deferred: List[Tuple[int, int]] = []  # (bucket, slot): beyond the window
        self.taken = [False] * len(buckets)  # whether the bucket has taken a piece yet
        self.next_launch = 0
        self.handles: Dict[int, Any] = {}  # in flight, by bucket, in launch order
        self.status = STATUS_OK  # the worst status a bucket was launched with


class BucketReducer:
    """Readiness, launch order, waiting and unpacking of a set of gradient buckets.

    Args:
        collective: what moving one bucket means (module docstring); it lays out and
            allocates the buckets' memory for each plan.
        plan: the bucket plan (``BucketPlan`` or a sequence of buckets); slot indices are this
            reducer's parameter indices ``0 .. num_params - 1``.
        num_params: parameters the owner reports with :meth:`grad_ready`.
        comm: the Communicator every rank of the engine shares (the rebuilt order is
            broadcast on it).
        window: at most this many buckets take gradients at once (None: all).
        groups: per bucket, the Communicator to reduce it over (None: the collective's);
            for a fixed plan (without ``planner``, whose plans would not know them).
        group_comms: ``{Bucket.group: Communicator}``: every plan's bucket of group g is
            reduced over ``group_comms[g]`` (groups absent: the collective's); with a planner
            too, as each rebuilt plan's buckets carry their group (MoE experts).
        planner: ``order -> BucketPlan`` for :meth:`rebuild` (None: the plan is fixed).
    """

    def __init__(
        self,
        collective: Any,
        plan: Any,
        num_params: int,
        *,
        comm: Any = None,
        window: Optional[int] = None,
        groups: Optional[Sequence[Any]] = None,
        planner: Optional[Callable[[Sequence[int]], BucketPlan]] = None,
        group_comms: Optional[Dict[int, Any]] = None,
    ) -> None:
        if groups is not None and planner is not None:
            raise ValueError("BucketReducer: groups need a fixed plan (planner=None)")
        if groups is not None and group_comms is not None:
            raise ValueError("BucketReducer: groups or group_comms, not both")
        self._group_comms = dict(group_comms or {})
        self.collective = collective
        self.num_params = num_params
        self._comm = comm
        self._window = window
        self._planner = planner
        self._rebuilt = planner is None
        self._pass: Optional[_Pass] = None
        #: Bucket collectives launched since construction (the fingerprint sequence number).
        self.launched = 0
        self.set_plan(plan, groups)

    @property
    def device(self) -> torch.device:
        """Where the buckets live."""
        return self.collective.device

    def set_collective(self, collective: Any) -> None:
        """Moves the buckets a different way from now on (DDP's ``register_comm_hook``: a hook
        route over the same bucket memory)."""
        if self._pass is not None:
            raise RuntimeError("BucketReducer.set_collective: a backward is in flight")
        self.collective = collective

    # ----------------------------------------------------------------- the plan

    def set_plan(self, plan: Any, groups: Optional[Sequence[Any]] = None) -> None:
        """Installs a plan; the collective allocates its memory (collective on every rank)."""
        if self._pass is not None:
            raise RuntimeError("BucketReducer.set_plan: a backward is in flight")
        #: The plan as given (printable); :attr:`buckets` is what the collective allocated.
        self.plan = plan
        given = plan.buckets if isinstance(plan, BucketPlan) else plan
        self.buckets: List[Bucket] = list(self.collective.allocate(list(given)))
        if groups is not None and len(groups) != len(self.buckets):
            raise ValueError(f"groups: {len(groups)} for {len(self.buckets)} buckets")
        if groups is None:
            groups = [self._group_comms.get(b.group) for b in self.buckets]
        self._groups = list(groups)
        self._pieces: List[List[Tuple[int, int]]] = [[] for _ in range(self.num_params)]
        for b, bucket in enumerate(self.buckets):
            for k, slot in enumerate(bucket.slots):
                self._pieces[slot.index].append((b, k))

    def buckets_of(self, index: int) -> List[int]:
        """The buckets holding a piece of parameter ``index``."""
        return [b for b, _ in self._pieces[index]]

    def planned_order(self) -> List[int]:
        return [s.index for b in self.buckets for s in b.slots]

    def rebuild(self, ready_order: Sequence[int]) -> None:
        """Once: re-plans in the order rank 0's gradients became ready (collective: the order
        is broadcast, so every rank plans alike), if it differs from the current one."""
        if self._rebuilt:
            return
        self._rebuilt = True
        order = rebuilt_order(ready_order, self.num_params)
        if self._comm is not None and self._comm.world_size > 1 and order:
            agreed = torch.tensor(order, dtype=torch.int64, device=self.device)
            self._comm.broadcast(agreed, 0)
            order = agreed.tolist()
        if order != self.planned_order():
            self.set_plan(self._planner(order))

    # ----------------------------------------------------------------- one backward

    @property
    def in_pass(self) -> bool:
        return self._pass is not None

    def begin(self, *, shadow: bool = False, **options: Any) -> None:
        """Starts a pass; ``options`` go to the collective's ``begin`` (e.g. the loss scale).

        ``shadow``: a joined rank's stand-in for the others' backward (its buckets carry zeros).
        """
        if self._pass is not None:
            raise RuntimeError("BucketReducer.begin: a backward is already in flight")
        self._pass = _Pass(self.buckets, self.num_params)
        self.collective.begin(shadow=shadow, **options)

    def is_ready(self, index: int) -> bool:
        return self._pass is not None and self._pass.ready[index]

    def unready(self) -> List[int]:
        """Parameters not reported ready in this pass (all of them outside a pass)."""
        if self._pass is None:
            return list(range(self.num_params))
        return [i for i, ready in enumerate(self._pass.ready) if not ready]

    @property
    def ready_order(self) -> List[int]:
        """This pass's parameters with a gradient, in the order they were reported."""
        return list(self._pass.ready_order) if self._pass is not None else []

    def grad_ready(self, index: int, used: bool = True) -> None:
        """Parameter ``index`` has its gradient (``used=False``: it has none this pass, and
        counts as zeros); launches every bucket that is complete, in plan order."""
        state = self._in_flight("grad_ready")
        if state.ready[index]:
            raise RuntimeError(f"BucketReducer.grad_ready: parameter {index} is ready already")
        state.ready[index] = True
        state.used[index] = used
        if used:
            state.ready_order.append(index)
        for b, k in self._pieces[index]:
            self._deliver(state, b, k)
        self._launch_complete(state)

    def launch_rest(self, status: int = STATUS_OK) -> None:
        """Launches every bucket not launched yet, in order, with ``status`` in its status
        slots, whatever it holds: pieces never reported count as zeros (a shadow pass sends
        zeros throughout)."""
        state = self._in_flight("launch_rest")
        while state.next_launch < len(self.buckets):
            self._launch(state, state.next_launch, status)
            state.next_launch += 1
            self._retry_deferred(state)

    def wait(self, *, used_mask: bool = False) -> Any:
        """Waits for every collective of the pass; returns the collective's status (DDP: the
        status slots every rank summed). ``used_mask``: the collective also learns which
        parameters had a gradient on some rank."""
        state = self._in_flight("wait")
        handles, state.handles = state.handles, {}
        used = state.used if used_mask else None
        return self.collective.wait(handles, status=state.status, used=used)

    def unpack(self, *args: Any, **kwargs: Any) -> Any:
        """The reduced buckets back where the gradients live (the collective's ``unpack``)."""
        return self.collective.unpack(*args, **kwargs)

    def end(self) -> None:
        """Forgets the pass (after :meth:`wait`, or to drop one that never launched)."""
        self._pass = None

    def finish(self, status: int = STATUS_OK) -> Any:
        """Reports every parameter not reported yet (with the gradient it holds; none counts
        as zeros), launches the rest, waits and ends the pass (ZeRO's end of backward)."""
        state = self._in_flight("finish")
        try:
            for index in range(self.num_params):
                if not state.ready[index]:
                    self.grad_ready(index, used=False)
            self.launch_rest(status)
            return self.wait()
        finally:
            self.end()

    # ----------------------------------------------------------------- internals

    def _in_flight(self, call: str) -> _Pass:
        if self._pass is None:
            raise RuntimeError(f"BucketReducer.{call}: no backward in flight (call begin first)")
        return self._pass

    def _deliver(self, state: _Pass, b: int, k: int) -> None:
        if self._window is not None and b >= state.next_launch + self._window:
            state.deferred.append((b, k))
            return
        if not state.taken[b]:
            state.taken[b] = True
            self._complete_reused(state, b)
        self.collective.deliver(b, self.buckets[b].slots[k])
        state.pending[b] -= 1

    def _complete_reused(self, state: _Pass, b: int) -> None:
        """Bucket ``b - window`` used the memory ``b`` takes now: complete it first."""
        earlier = b - self._window if self._window is not None else -1
        handle = state.handles.pop(earlier, None)
        if handle is not None:
            self.collective.complete(earlier, handle)

    def _launch_complete(self, state: _Pass) -> None:
        while state.next_launch < len(self.buckets) and state.pending[state.next_launch] == 0:
            self._launch(state, state.next_launch, STATUS_OK)
            state.next_launch += 1
            self._retry_deferred(state)

    def _retry_deferred(self, state: _Pass) -> None:
        """The window moved on: the pieces it held back may go in now."""
        deferred, state.deferred = state.deferred, []
        for b, k in deferred:
            self._deliver(state, b, k)

    def _launch(self, state: _Pass, b: int, status: int) -> None:
        if not state.taken[b]:
            state.taken[b] = True
            self._complete_reused(state, b)
        state.status = max(state.status, status)
        group = self._groups[b]
        state.handles[b] = self.collective.launch(b, status, self.launched, group)
        self.launched += 1
