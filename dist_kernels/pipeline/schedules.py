"""Pipeline schedules as data: per-rank action lists, built, simulated and printed.

A schedule is planned before a byte moves (style habit 9). Each rank gets an ordered list of
:class:`Action` s: compute (``F``, ``B``) and point-to-point transfers (``SA``/``RA`` send and
receive an activation, ``SG``/``RG`` send and receive a gradient), each for one stage and one
micro-batch. The runtime executes its rank's list in order and nothing else.

Transfers are blocking on both ends (rendezvous: a send may wait until the receiver arrives), so
the order of transfers inside each list decides whether the pipeline deadlocks. The builder
therefore does not insert transfers by a local rule; it runs a discrete-event simulation of all
ranks (unit cost per forward, per backward) and records each send / receive pair at the moment
the receiver needs it. Any list produced from one complete global execution in which every pair
happens at once cannot deadlock: ranks are sequential and every channel is FIFO, so every
execution replays that one. :func:`simulate` checks it again independently and measures bubble
fraction and peak live activations.

Stage placement: GPipe and 1F1B put stage ``s`` on rank ``s``. Interleaved 1F1B splits the model
into ``n_ranks * stages_per_rank`` virtual stages and loops them over the ranks (stage ``s`` on
rank ``s % n_ranks``), Megatron-LM style::

    rank 0: stages 0, 4        F and B of one micro-batch visit ranks 0 1 2 3 0 1 2 3,
    rank 1: stages 1, 5        so the warm-up bubble shrinks by the number of stages per rank
    rank 2: stages 2, 6
    rank 3: stages 3, 7
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple, Union

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
DEFAULT_STAGES_PER_RANK = 2  # interleaved 1F1B, as in Megatron-LM's usual setting


class Kind(str, enum.Enum):
    """What an action does; the value is its printed code."""

    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACT = "SA"  # send the stage's output to the next stage's rank
    RECV_ACT = "RA"  # receive the stage's input from the previous stage's rank
    SEND_GRAD = "SG"  # send the gradient of the stage's input to the previous stage's rank
    RECV_GRAD = "RG"  # receive the gradient of the stage's output from the next stage's rank

    @property
    def is_compute(self) -> bool:
        return self in (Kind.FORWARD, Kind.BACKWARD)


DESCRIPTIONS = {
    Kind.FORWARD: "forward",
    Kind.BACKWARD: "backward",
    Kind.SEND_ACT: "send-activation",
    Kind.RECV_ACT: "recv-activation",
    Kind.SEND_GRAD: "send-grad",
    Kind.RECV_GRAD: "recv-grad",
}


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` for ``stage`` and ``microbatch``; ``peer`` for transfers."""

    kind: Kind
    stage: int
    microbatch: int
    peer: Optional[int] = None

    def __str__(self) -> str:
        return f"{self.kind.value}{self.microbatch}"

    def label(self, show_stage: bool) -> str:
        """Short form, ``F3``; with ``show_stage`` the stage leads, ``2F3`` (interleaved)."""
        return f"{self.stage}{self}" if show_stage else str(self)

    def describe(self) -> str:
        """Long form for error messages: ``recv-grad of stage 2, micro-batch 3 from rank 1``."""
        text = f"{DESCRIPTIONS[self.kind]} of stage {self.stage}, micro-batch {self.microbatch}"
        if self.peer is not None:
            direction = "to" if self.kind in (Kind.SEND_ACT, Kind.SEND_GRAD) else "from"
            text += f" {direction} rank {self.peer}"
        return text


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists for one training step."""

    name: str
    n_ranks: int
    n_stages: int  # total (virtual) stages
    n_microbatches: int
    actions: Tuple[Tuple[Action, ...], ...]  # actions[rank]

    def rank_of(self, stage: int) -> int:
        """The rank that runs ``stage`` (looped placement)."""
        return stage % self.n_ranks

    def stages_of(self, rank: int) -> List[int]:
        """The stages that ``rank`` runs, in order."""
        return list(range(rank, self.n_stages, self.n_ranks))

    @property
    def stages_per_rank(self) -> int:
        return self.n_stages // self.n_ranks

    def format_rank(self, rank: int) -> str:
        """Every action of ``rank`` in order, transfers included: ``F0 SA0 F1 RG0 ...``."""
        show = self.stages_per_rank > 1
        return " ".join(a.label(show) for a in self.actions[rank])


# ----------------------------------------------------------------------------- compute orders


def _gpipe_order(rank: int, n_ranks: int, n_mb: int) -> List[Tuple[Kind, int, int]]:
    """All forwards, then all backwards, in micro-batch order."""
    forwards = [(Kind.FORWARD, rank, m) for m in range(n_mb)]
    return forwards + [(Kind.BACKWARD, rank, m) for m in range(n_mb)]


def _one_f_one_b_order(rank: int, n_ranks: int, n_mb: int) -> List[Tuple[Kind, int, int]]:
    """Warm-up forwards (``n_ranks - rank - 1``), then alternate F and B, then drain the Bs.

    A rank never holds more than ``n_ranks - rank`` micro-batches' activations.
    """
    warmup = min(n_ranks - rank - 1, n_mb)
    order = [(Kind.FORWARD, rank, m) for m in range(warmup)]
    for i in range(n_mb - warmup):
        order += [(Kind.FORWARD, rank, warmup + i), (Kind.BACKWARD, rank, i)]
    order += [(Kind.BACKWARD, rank, m) for m in range(n_mb - warmup, n_mb)]
    return order


def _interleaved_units(n_ranks: int, n_chunks: int, n_mb: int, backward: bool) -> List[tuple]:
    """(chunk, micro-batch) in the order a rank runs them: rounds of ``n_ranks`` micro-batches,
    each round through every chunk (reversed for backward) before the next round starts::

        p=2, 2 chunks, 4 micro-batches, forward: (0,0) (0,1) (1,0) (1,1) (0,2) (0,3) (1,2) (1,3)
    """
    chunks = range(n_chunks - 1, -1, -1) if backward else range(n_chunks)
    units = []
    for first in range(0, n_mb, n_ranks):
        round_mbs = range(first, min(first + n_ranks, n_mb))
        units += [(c, m) for c in chunks for m in round_mbs]
    return units


def _interleaved_order(
    rank: int, n_ranks: int, n_mb: int, n_chunks: int
) -> List[Tuple[Kind, int, int]]:
    """Megatron-LM's interleaved 1F1B: deeper warm-up, then one F and one B alternately."""
    total = n_chunks * n_mb
    forwards = _interleaved_units(n_ranks, n_chunks, n_mb, backward=False)
    backwards = _interleaved_units(n_ranks, n_chunks, n_mb, backward=True)
    fwd = [(Kind.FORWARD, c * n_ranks + rank, m) for c, m in forwards]
    bwd = [(Kind.BACKWARD, c * n_ranks + rank, m) for c, m in backwards]
    warmup = min((n_ranks - rank - 1) * 2 + (n_chunks - 1) * n_ranks, total)
    order = fwd[:warmup]
    for i in range(total - warmup):
        order += [fwd[warmup + i], bwd[i]]
    return order + bwd[total - warmup :]


# ----------------------------------------------------------------------------- builder


@dataclass
class _RankState:
    order: List[Tuple[Kind, int, int]]
    actions: List[Action]
    stages_per_rank: int = 1
    clock: float = 0.0
    next: int = 0
    have: Set[Tuple[Kind, int, int]] = field(default_factory=set)  # inputs here: (RECV_*, s, m)
    outbox: Set[Tuple[Kind, int, int]] = field(default_factory=set)  # produced, unsent: (SEND_*)


def _inputs_of(kind: Kind, stage: int, mb: int, n_stages: int) -> List[Tuple[Kind, int, int]]:
    """What a compute step needs besides its own rank's earlier steps."""
    if kind is Kind.FORWARD:
        return [(Kind.RECV_ACT, stage, mb)] if stage > 0 else []
    return [(Kind.RECV_GRAD, stage, mb)] if stage < n_stages - 1 else []


def _outputs_of(kind: Kind, stage: int, mb: int, n_stages: int) -> List[Tuple[Kind, int, int]]:
    if kind is Kind.FORWARD:
        return [(Kind.SEND_ACT, stage, mb)] if stage < n_stages - 1 else []
    return [(Kind.SEND_GRAD, stage, mb)] if stage > 0 else []


def _delivers(item: Tuple[Kind, int, int]) -> Tuple[Kind, int, int]:
    """The receive that a send item satisfies."""
    kind, stage, mb = item
    if kind is Kind.SEND_ACT:
        return (Kind.RECV_ACT, stage + 1, mb)
    return (Kind.RECV_GRAD, stage - 1, mb)


def _build_lists(order_of, n_ranks: int, n_stages: int, cost) -> List[List[Action]]:
    """Discrete-event simulation that turns compute orders into deadlock-free action lists.

    The rank with the earliest clock moves first: it sends one of its outputs when
    :func:`_worth_sending` says so, else runs its next compute step if the inputs are there,
    else it waits. A send and its receive are recorded together at
    ``max(sender clock, receiver clock)``.
    """
    ranks = [_RankState(order_of(r), [], n_stages // n_ranks) for r in range(n_ranks)]
    while True:
        live = [r for r, st in enumerate(ranks) if st.next < len(st.order) or st.outbox]
        if not live:
            return [st.actions for st in ranks]
        for r in sorted(live, key=lambda r: (ranks[r].clock, r)):
            if _try_send(ranks, r, n_stages, cost) or _try_compute(ranks[r], r, n_stages, cost):
                break
        else:
            stuck = {r: ranks[r].order[ranks[r].next :][:1] for r in live}
            raise AssertionError(f"schedule builder deadlocked; waiting: {stuck}")


def _waiting_for(state: _RankState, n_stages: int) -> List[Tuple[Kind, int, int]]:
    if state.next >= len(state.order):
        return []
    return [x for x in _inputs_of(*state.order[state.next], n_stages) if x not in state.have]


def _worth_sending(sender: _RankState, receiver: _RankState, need, n_stages: int, cost) -> bool:
    """Whether to pair this transfer now rather than after the sender's next compute step.

    Blocking transfers make one side idle while the other is busy. If the receiver's next step
    needs the item, pick the smaller idle time: the sender waiting for the receiver now, or the
    receiver waiting for the sender's next step. If the receiver is stuck on another input,
    receiving early costs nobody anything once it is free.
    """
    blocked_on = _waiting_for(receiver, n_stages)
    if need in blocked_on:
        if sender.next >= len(sender.order) or _waiting_for(sender, n_stages):
            return True  # the sender has nothing else to do
        sender_waits = receiver.clock - sender.clock
        receiver_waits = sender.clock + cost[sender.order[sender.next][0]] - receiver.clock
        return sender_waits <= receiver_waits
    return bool(blocked_on) and receiver.clock <= sender.clock


def _try_send(ranks: List[_RankState], r: int, n_stages: int, cost) -> bool:
    """Pairs one of rank ``r``'s pending sends with its receiver, earliest receiver first."""
    sender = ranks[r]
    candidates = []
    for item in sender.outbox:
        need = _delivers(item)
        peer = need[1] % len(ranks)
        if _worth_sending(sender, ranks[peer], need, n_stages, cost):
            candidates.append((ranks[peer].clock, peer, item[1], item[2], item))
    if not candidates:
        return False
    *_, item = min(candidates, key=lambda c: c[:4])
    need = _delivers(item)
    peer = need[1] % len(ranks)
    receiver = ranks[peer]
    receiver.clock = sender.clock = max(sender.clock, receiver.clock)
    sender.actions.append(Action(item[0], item[1], item[2], peer))
    receiver.actions.append(Action(need[0], need[1], need[2], r))
    sender.outbox.discard(item)
    receiver.have.add(need)
    return True


def _try_compute(state: _RankState, r: int, n_stages: int, cost) -> bool:
    if state.next >= len(state.order) or _waiting_for(state, n_stages):
        return False
    kind, stage, mb = state.order[state.next]
    state.next += 1
    state.actions.append(Action(kind, stage, mb))
    state.clock += cost[kind]
    for item in _outputs_of(kind, stage, mb, n_stages):
        n_ranks = n_stages // state.stages_per_rank
        if _delivers(item)[1] % n_ranks == r:  # next stage on this rank: handed over in memory
            state.have.add(_delivers(item))
        else:
            state.outbox.add(item)
    return True


def build_schedule(
    name: str, n_ranks: int, n_microbatches: int, stages_per_rank: Optional[int] = None
) -> Schedule:
    """Plans one training step.

    Args:
        name: ``"gpipe"``, ``"1f1b"`` or ``"interleaved-1f1b"``.
        n_ranks: pipeline ranks (physical stages).
        n_microbatches: micro-batches per step.
        stages_per_rank: virtual stages per rank, interleaved only (default 2).
    """
    _check_positive(n_ranks=n_ranks, n_microbatches=n_microbatches)
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {name!r}")
    if name != "interleaved-1f1b":
        if stages_per_rank not in (None, 1):
            raise ValueError(f"stages_per_rank={stages_per_rank} needs interleaved-1f1b")
        chunks = 1
        maker = _gpipe_order if name == "gpipe" else _one_f_one_b_order
        order_of = lambda r: maker(r, n_ranks, n_microbatches)  # noqa: E731
    else:
        chunks = DEFAULT_STAGES_PER_RANK if stages_per_rank is None else stages_per_rank
        _check_positive(stages_per_rank=chunks)
        if n_microbatches % n_ranks:
            # Megatron-LM's rule too: the rounds of micro-batches must fill every rank, or the
            # warm-up count is wrong and the compute orders deadlock (seen for 12 on 8 ranks).
            raise ValueError(
                f"interleaved-1f1b needs n_microbatches ({n_microbatches}) to be a multiple of "
                f"the pipeline ranks ({n_ranks})"
            )
        order_of = lambda r: _interleaved_order(r, n_ranks, n_microbatches, chunks)  # noqa: E731
    n_stages = n_ranks * chunks
    lists = _build_lists(order_of, n_ranks, n_stages, {Kind.FORWARD: 1, Kind.BACKWARD: 1})
    return Schedule(name, n_ranks, n_stages, n_microbatches, tuple(tuple(a) for a in lists))


def _check_positive(**values: int) -> None:
    for arg, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{arg} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{arg} must be >= 1, got {value}")


# ----------------------------------------------------------------------------- validator


class ScheduleError(ValueError):
    """A schedule that cannot run: a step out of order, an unmatched transfer, a deadlock."""


@dataclass
class ScheduleReport:
    """What :func:`simulate` measured.

    Attributes:
        makespan: time of the step, in units of one stage's forward (``forward_cost``).
        bubble_fraction: idle share of ``n_ranks * makespan``.
        peak_live_activations: per stage, the most micro-batches whose forward has run and whose
            backward has not, at any point (each holds that stage's saved activations).
        timeline: per rank, ``(start, end, action)`` of every compute step.
    """

    makespan: float
    bubble_fraction: float
    peak_live_activations: Dict[int, int]
    timeline: List[List[Tuple[float, float, Action]]]


class _Sim:
    """Executes every rank's list with blocking transfers, checking each step."""

    def __init__(self, schedule: Schedule, cost: Dict[Kind, float]) -> None:
        self.s = schedule
        self.cost = cost
        n = schedule.n_ranks
        self.pos = [0] * n
        self.clock = [0.0] * n
        self.busy = [0.0] * n
        self.done: Set[Tuple[Kind, int, int]] = set()  # compute steps finished anywhere
        self.have: List[Set[Tuple[Kind, int, int]]] = [set() for _ in range(n)]
        self.live: Dict[int, int] = {st: 0 for st in range(schedule.n_stages)}
        self.peak: Dict[int, int] = dict(self.live)
        self.timeline: List[List[tuple]] = [[] for _ in range(n)]

    def fail(self, rank: int, action: Action, why: str) -> None:
        raise ScheduleError(f"{self.s.name}: rank {rank}, {action.describe()}: {why}")

    def current(self, rank: int) -> Optional[Action]:
        acts = self.s.actions[rank]
        return acts[self.pos[rank]] if self.pos[rank] < len(acts) else None

    def run(self) -> None:
        while True:
            progressed = False
            for rank in range(self.s.n_ranks):
                while self._step(rank):
                    progressed = True
            if all(self.current(r) is None for r in range(self.s.n_ranks)):
                return
            if not progressed:
                waiting = [
                    f"rank {r}: {self.current(r).describe()}"
                    for r in range(self.s.n_ranks)
                    if self.current(r) is not None
                ]
                raise ScheduleError(f"{self.s.name}: deadlock; " + "; ".join(waiting))

    def _step(self, rank: int) -> bool:
        action = self.current(rank)
        if action is None:
            return False
        if action.stage < 0 or action.stage >= self.s.n_stages:
            self.fail(rank, action, f"no such stage (n_stages={self.s.n_stages})")
        if action.microbatch < 0 or action.microbatch >= self.s.n_microbatches:
            self.fail(rank, action, f"no such micro-batch (n_microbatches={self.s.n_microbatches})")
        if action.kind.is_compute:
            self._compute(rank, action)
            return True
        if action.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
            return self._transfer(rank, action)
        return False  # a receive moves only when its sender arrives

    def _compute(self, rank: int, a: Action) -> None:
        key = (a.kind, a.stage, a.microbatch)
        if self.s.rank_of(a.stage) != rank:
            self.fail(rank, a, f"stage {a.stage} belongs to rank {self.s.rank_of(a.stage)}")
        if key in self.done:
            self.fail(rank, a, "runs twice")
        for need in _inputs_of(a.kind, a.stage, a.microbatch, self.s.n_stages):
            if need not in self.have[rank] and not self._local(rank, need):
                self.fail(rank, a, "its input has not arrived")
        if a.kind is Kind.BACKWARD and (Kind.FORWARD, a.stage, a.microbatch) not in self.done:
            self.fail(rank, a, "backward before its forward")
        self.done.add(key)
        self.live[a.stage] += 1 if a.kind is Kind.FORWARD else -1
        self.peak[a.stage] = max(self.peak[a.stage], self.live[a.stage])
        start = self.clock[rank]
        self.clock[rank] += self.cost[a.kind]
        self.busy[rank] += self.cost[a.kind]
        self.timeline[rank].append((start, self.clock[rank], a))
        self.pos[rank] += 1

    def _local(self, rank: int, need: Tuple[Kind, int, int]) -> bool:
        """Whether ``need`` was produced on ``rank`` itself (adjacent stages on one rank)."""
        kind, stage, mb = need
        source = stage - 1 if kind is Kind.RECV_ACT else stage + 1
        produced = Kind.FORWARD if kind is Kind.RECV_ACT else Kind.BACKWARD
        return self.s.rank_of(source) == rank and (produced, source, mb) in self.done

    def _transfer(self, rank: int, a: Action) -> bool:
        produced = Kind.FORWARD if a.kind is Kind.SEND_ACT else Kind.BACKWARD
        if (produced, a.stage, a.microbatch) not in self.done:
            self.fail(rank, a, "sends before the step that produces it")
        need = _delivers((a.kind, a.stage, a.microbatch))
        peer = self.s.rank_of(need[1])
        if a.peer != peer or peer == rank:
            self.fail(rank, a, f"stage {need[1]} is on rank {peer}")
        theirs = self.current(peer)
        if theirs is None or theirs.kind not in (Kind.RECV_ACT, Kind.RECV_GRAD):
            return False  # the peer is busy or sending: this send waits
        got = (theirs.kind, theirs.stage, theirs.microbatch)
        if theirs.peer == rank and got != need:
            self.fail(peer, theirs, f"but rank {rank} sends {a.describe()} on that channel")
        if theirs.peer != rank:
            return False
        self.have[peer].add(need)
        self.clock[rank] = self.clock[peer] = max(self.clock[rank], self.clock[peer])
        self.pos[rank] += 1
        self.pos[peer] += 1
        return True

    def check_complete(self) -> None:
        for kind in (Kind.FORWARD, Kind.BACKWARD):
            for stage in range(self.s.n_stages):
                for mb in range(self.s.n_microbatches):
                    if (kind, stage, mb) not in self.done:
                        a = Action(kind, stage, mb)
                        raise ScheduleError(f"{self.s.name}: {a.describe()} never runs")


def simulate(
    schedule: Schedule, forward_cost: float = 1.0, backward_cost: float = 1.0
) -> ScheduleReport:
    """Runs ``schedule`` on paper and measures it; raises :class:`ScheduleError` if invalid.

    Checks that every forward and backward of every (stage, micro-batch) runs exactly once on the
    stage's rank, each backward after its forward, each step after its input arrived, every send
    matched in order by the receive its peer expects, and that blocking transfers do not
    deadlock. Compute costs are per virtual stage; transfers are free.
    """
    sim = _Sim(schedule, {Kind.FORWARD: forward_cost, Kind.BACKWARD: backward_cost})
    sim.run()
    sim.check_complete()
    makespan = max(sim.clock)
    total = makespan * schedule.n_ranks
    bubble = 1.0 - sum(sim.busy) / total if total > 0 else 0.0
    return ScheduleReport(makespan, bubble, sim.peak, sim.timeline)


# ----------------------------------------------------------------------------- table


def schedule_table(
    schedule: Union[str, Schedule],
    n_stages: Optional[int] = None,
    n_microbatches: Optional[int] = None,
    *,
    stages_per_rank: Optional[int] = None,
) -> str:
    """A printable per-rank grid of compute steps in time (``.`` = idle), plus the measures.

    ``schedule`` is a name (then ``n_stages`` = pipeline ranks and ``n_microbatches`` are
    required) or a built :class:`Schedule`. Forward and backward take one time slot each.
    Interleaved labels lead with the virtual stage (``2F3`` = stage 2, forward, micro-batch 3)::

        gpipe: 2 ranks, 2 stages, 3 micro-batches; bubble 25.0%, peak live activations 3
        rank 0 | F0 F1 F2 .  .  B0 B1 B2
        rank 1 | .  F0 F1 F2 B0 B1 B2 .
    """
    if isinstance(schedule, str):
        if n_stages is None or n_microbatches is None:
            raise ValueError("schedule_table needs n_stages and n_microbatches with a name")
        schedule = build_schedule(schedule, n_stages, n_microbatches, stages_per_rank)
    report = simulate(schedule)
    show = schedule.stages_per_rank > 1
    width = max(len(a.label(show)) for acts in schedule.actions for a in acts if a.kind.is_compute)
    rows = []
    for rank, steps in enumerate(report.timeline):
        cells = ["." * 1] * int(round(report.makespan))
        for start, _, action in steps:
            cells[int(round(start))] = action.label(show)
        rows.append(f"rank {rank} | " + " ".join(c.ljust(width) for c in cells).rstrip())
    head = (
        f"{schedule.name}: {schedule.n_ranks} ranks, {schedule.n_stages} stages, "
        f"{schedule.n_microbatches} micro-batches; bubble {100 * report.bubble_fraction:.1f}%, "
        f"peak live activations {max(report.peak_live_activations.values())}"
    )
    return "\n".join([head, *rows])


def bubble_formula(n_ranks: int, n_microbatches: int) -> float:
    """GPipe's and 1F1B's bubble with equal stages: ``(p - 1) / (m + p - 1)``."""
    return (n_ranks - 1) / (n_microbatches + n_ranks - 1)


__all__ = [
    "SCHEDULES",
    "Action",
    "Kind",
    "Schedule",
    "ScheduleError",
    "ScheduleReport",
    "build_schedule",
    "bubble_formula",
    "schedule_table",
    "simulate",
]
