"""The schedule checker: every rank's list run on a fake runtime that behaves as dk.Pipeline.

``dk.Pipeline`` runs a rank's list on one thread in :func:`runtime_order`: compute steps and
sends in list order (a send is an ``isend``: it never waits for the receiver; the builder
puts it right behind the step producing its tensor), and the receives from each peer in list
order, taken only when a
compute step needs a tensor from that peer that has not arrived (it waits in the peer's FIFO
until then; messages from one peer come in the order it sent them, and a peer's late message
never holds up another's). The fake runtime
does exactly that with bookkeeping in place of tensors, and raises :class:`ScheduleError`,
naming the rank and the action, for:

* a deadlock: no rank can move (each waits for a message nobody will send); the error lists
  what every rank waits for;
* use before produce: a step before its input arrived or was computed (a forward before the
  previous stage's, a backward before its forward or before its output gradient, a W before
  its I), a send before the step that makes its tensor, a receive that gets another tensor
  than it expects on that channel;
* double frees: a stage's activations for a micro-batch are allocated by F and freed by the
  step that last needs them (B, or W after I); freeing them again, or a step that runs twice;
* anything left over: a step that never runs, an output never sent, a message never received.

With costs it is also the simulator's engine (:mod:`.simulator`): every action gets a start
and an end, from each rank's clock and each message's arrival. A send costs ``send`` on the
sender's thread and its message arrives ``p2p`` after that; a receive taken costs ``recv`` on
the receiver's. The times depend only on the lists, not on the order in which the
fake runtime visits the ranks: sends never block, so each step's start is fixed by the steps
it waits for.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple

from .actions import Action, Kind, Schedule
from .schedules import Item, delivers, inputs_of, outputs_of

__all__ = ["ScheduleError", "check_schedule", "runtime_order"]


class ScheduleError(ValueError):
    """A schedule that cannot run: a step out of order, an unmatched transfer, a deadlock."""


def runtime_order(actions: Sequence[Action]) -> List[Action]:
    """A rank's compute steps and sends in the order the runtime runs them: list order, the
    receives apart (each is taken when a step needs it, :func:`receives_by_peer`). The builder
    puts each send right behind the step producing its tensor."""
    return [a for a in actions if not a.kind.is_recv]


def receives_by_peer(actions: Sequence[Action]) -> Dict[int, Deque[Action]]:
    """A rank's receives, per peer, in list order: the order each peer's messages come in."""
    out: Dict[int, Deque[Action]] = {}
    for a in actions:
        if a.kind.is_recv:
            out.setdefault(a.peer, deque()).append(a)
    return out


def check_schedule(schedule: Schedule) -> None:
    """Runs ``schedule`` on the fake runtime; raises :class:`ScheduleError` if it cannot run."""
    FakeRuntime(schedule, lambda a: 1.0).run()


@dataclass
class _Message:
    item: Item  # (SEND_*, stage, micro-batch) as sent
    arrives: float


@dataclass
class _Rank:
    order: List[Action]  # computes and sends, as the runtime runs them
    receives: Dict[int, Deque[Action]]  # per peer, in list order
    pos: int = 0
    clock: float = 0.0
    busy: float = 0.0
    first: Optional[float] = None  # start of its first compute step
    have: Set[Item] = field(default_factory=set)  # received or handed over: (RECV_*, s, m)
    outbox: Set[Item] = field(default_factory=set)  # produced, not sent yet: (SEND_*, s, m)
    timeline: List[Tuple[float, float, Action]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.pos >= len(self.order)


class FakeRuntime:
    """Executes a schedule as the runtime would (module docstring), checking every step.

    ``cost(action)`` is the duration of a compute action. After :meth:`run`: per rank
    ``ranks[r].clock`` (end), ``busy``, ``first`` and ``timeline``; :attr:`peak_live` (per
    stage, the most micro-batches whose activations were allocated and not yet freed) and
    :attr:`peak_rank_live` (per rank, the most at once over its stages, each weighted
    ``1 / stages_per_rank``: a whole rank's layers is 1).
    """

    def __init__(
        self,
        schedule: Schedule,
        cost: Callable[[Action], float],
        *,
        send: float = 0.0,
        recv: float = 0.0,
        p2p: float = 0.0,
    ) -> None:
        self.s, self.cost = schedule, cost
        self.send_cost, self.recv_cost, self.p2p = send, recv, p2p
        self.ranks = [
            _Rank(runtime_order(acts), receives_by_peer(acts)) for acts in schedule.actions
        ]
        self.channels: Dict[Tuple[int, int], Deque[_Message]] = {}
        self.done: Dict[Tuple[Kind, int, int], Action] = {}  # compute steps finished
        self.live: Dict[int, Set[int]] = {s: set() for s in range(schedule.n_stages)}
        self.freed: Dict[Tuple[int, int], Action] = {}  # (stage, mb) -> the step that freed it
        self.peak_live = {s: 0 for s in range(schedule.n_stages)}
        self.peak_rank_live = [0.0] * schedule.n_ranks
        self.stages_of = [schedule.stages_of(r) for r in range(schedule.n_ranks)]

    def fail(self, rank: int, action: Action, why: str) -> None:
        raise ScheduleError(f"{self.s.name}: rank {rank}, {action.describe()}: {why}")

    def run(self) -> FakeRuntime:
        while True:
            moved = False
            for r in range(self.s.n_ranks):
                while self._step(r):
                    moved = True
            if all(rank.finished for rank in self.ranks):
                self._check_complete()
                return self
            if not moved:
                raise ScheduleError(f"{self.s.name}: deadlock; " + "; ".join(self._waiting()))

    def _waiting(self) -> List[str]:
        out = []
        for r, rank in enumerate(self.ranks):
            if rank.finished:
                continue
            a = rank.order[rank.pos]
            waits = [q[0].describe() for q in rank.receives.values() if q]
            out.append(f"rank {r}: {a.describe()} waits ({', '.join(waits) or 'nothing left'})")
        return out

    # ----------------------------------------------------------------- one step

    def _step(self, r: int) -> bool:
        rank = self.ranks[r]
        if rank.finished:
            return False
        a = rank.order[rank.pos]
        self._check_place(r, a)
        if a.kind.is_send:
            self._send(r, a)
        elif not self._compute(r, a):
            return False
        rank.pos += 1
        return True

    def _check_place(self, r: int, a: Action) -> None:
        if not 0 <= a.stage < self.s.n_stages:
            self.fail(r, a, f"no such stage (n_stages={self.s.n_stages})")
        if not 0 <= a.microbatch < self.s.n_microbatches:
            self.fail(r, a, f"no such micro-batch (n_microbatches={self.s.n_microbatches})")
        if self.s.rank_of(a.stage) != r:
            self.fail(r, a, f"stage {a.stage} belongs to rank {self.s.rank_of(a.stage)}")

    def _send(self, r: int, a: Action) -> None:
        rank = self.ranks[r]
        if a.key not in rank.outbox:
            self.fail(r, a, "sends before the step that produces it (or sends it twice)")
        peer = self.s.rank_of(delivers(a.key)[1])
        if a.peer != peer or peer == r:
            self.fail(r, a, f"stage {delivers(a.key)[1]} is on rank {peer}")
        rank.outbox.discard(a.key)
        rank.clock += self.send_cost
        self.channels.setdefault((r, peer), deque()).append(_Message(a.key, rank.clock + self.p2p))

    def _compute(self, r: int, a: Action) -> bool:
        """Runs compute step ``a`` if its inputs can be had; False while a message is missing."""
        self._check_order(r, a)
        for need in inputs_of(a.kind, a.stage, a.microbatch, self.s.n_stages):
            if not self._obtain(r, a, need):
                return False
        rank = self.ranks[r]
        start = rank.clock
        rank.clock += self.cost(a)
        rank.busy += rank.clock - start
        rank.first = start if rank.first is None else rank.first
        rank.timeline.append((start, rank.clock, a))
        self.done[a.key] = a
        self._account_memory(r, a)
        for item in outputs_of(a.kind, a.stage, a.microbatch, self.s.n_stages):
            if self.s.rank_of(delivers(item)[1]) == r:  # the next stage is here: in memory
                rank.have.add(delivers(item))
            else:
                rank.outbox.add(item)
        return True

    def _obtain(self, r: int, a: Action, need: Item) -> bool:
        """Takes the source's receives in order until ``need`` is here (False: a message is
        missing)."""
        rank = self.ranks[r]
        source = need[1] - 1 if need[0] is Kind.RECV_ACT else need[1] + 1
        peer = self.s.rank_of(source)
        if peer == r and need not in rank.have:
            self.fail(r, a, f"its input from stage {source} (this rank) is not computed yet")
        while need not in rank.have:
            queue = rank.receives.get(peer)
            if not queue:
                self.fail(r, a, f"its input never arrives: no receive from rank {peer} left")
            if not self._receive(r, queue[0]):
                return False
            queue.popleft()
        return True

    def _receive(self, r: int, a: Action) -> bool:
        queue = self.channels.get((a.peer, r))
        if not queue:
            return False  # the peer has not sent it yet
        sent = queue[0].item
        if delivers(sent) != a.key:
            theirs = Action(sent[0], sent[1], sent[2], r)
            self.fail(r, a, f"but rank {a.peer} sends {theirs.describe()} on that channel")
        rank = self.ranks[r]
        rank.clock = max(rank.clock, queue.popleft().arrives) + self.recv_cost
        rank.have.add(a.key)
        return True

    def _check_order(self, r: int, a: Action) -> None:
        """Use before produce and steps that run twice, on this rank's own steps."""
        forward = (Kind.FORWARD, a.stage, a.microbatch)
        first_half = (Kind.BACKWARD_INPUT, a.stage, a.microbatch)
        full = (Kind.BACKWARD, a.stage, a.microbatch)
        if a.key in self.done:
            self.fail(r, a, "runs twice")
        if a.kind is not Kind.FORWARD and forward not in self.done:
            self.fail(r, a, "backward before its forward")
        if a.kind is Kind.BACKWARD_WEIGHT and first_half not in self.done:
            why = "its backward ran in full already" if full in self.done else "before its I"
            self.fail(r, a, f"weight gradient {why}")
        if a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT) and (
            full in self.done or first_half in self.done
        ):
            self.fail(r, a, "the input gradient of this micro-batch was computed already")

    def _account_memory(self, r: int, a: Action) -> None:
        """F allocates the micro-batch's activations on its stage; B or W frees them."""
        held = self.live[a.stage]
        if a.kind is Kind.FORWARD:
            held.add(a.microbatch)
            self.peak_live[a.stage] = max(self.peak_live[a.stage], len(held))
            total = sum(len(self.live[s]) for s in self.stages_of[r])
            self.peak_rank_live[r] = max(self.peak_rank_live[r], total / self.s.stages_per_rank)
        elif a.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
            if a.microbatch not in held:
                earlier = self.freed[(a.stage, a.microbatch)]
                self.fail(r, a, f"frees activations already freed by {earlier.describe()}")
            held.discard(a.microbatch)
            self.freed[(a.stage, a.microbatch)] = a

    def _check_complete(self) -> None:
        for stage in range(self.s.n_stages):
            for mb in range(self.s.n_microbatches):
                missing = None
                if (Kind.FORWARD, stage, mb) not in self.done:
                    missing = Kind.FORWARD
                elif (Kind.BACKWARD, stage, mb) not in self.done and (
                    Kind.BACKWARD_INPUT,
                    stage,
                    mb,
                ) not in self.done:
                    missing = Kind.BACKWARD
                elif mb in self.live[stage]:
                    missing = Kind.BACKWARD_WEIGHT
                if missing is not None:
                    what = Action(missing, stage, mb).describe()
                    raise ScheduleError(f"{self.s.name}: {what} never runs")
        for r, rank in enumerate(self.ranks):
            for item in sorted(rank.outbox):
                raise ScheduleError(
                    f"{self.s.name}: rank {r} never sends {Action(*item).describe()}"
                )
            for queue in rank.receives.values():
                if queue:
                    raise ScheduleError(
                        f"{self.s.name}: rank {r}, {queue[0].describe()}: never needed"
                    )
