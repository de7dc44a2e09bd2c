"""Pipeline schedules as data: compute orders turned into per-rank action lists.

A schedule is planned before a byte moves (style habit 9). :mod:`.orders` gives each rank's
compute steps (``F``, ``B``, ``I``, ``W``) for every named schedule; this module places the
point-to-point transfers between them (``SA``/``RA``, ``SG``/``RG``) and returns a
:class:`~.actions.Schedule`. :mod:`.checker` then runs it on a fake runtime before anything
real does, and :mod:`.simulator` times it.

The builder does not insert transfers by a local rule; it runs a discrete-event simulation of
all ranks (unit cost per step) with blocking transfers on both ends and records each send /
receive pair at the moment the receiver needs it. Any list produced from one complete global
execution in which every pair happens at once cannot deadlock: ranks are sequential and every
channel is FIFO, so every execution replays that one (and the runtime's asynchronous sends
only relax it; the checker replays each list as the runtime runs it).

Stage placement (:mod:`.actions`): GPipe, 1F1B, ZB-H1 and ZB-H2 put stage ``s`` on rank ``s``.
Interleaved 1F1B splits the model into ``n_ranks * stages_per_rank`` virtual stages and loops
them over the ranks (stage ``s`` on rank ``s % n_ranks``), Megatron-LM style; ZB-V and
DualPipeV put two stages on each rank in a V::

    interleaved, p = 4, v = 2            V, p = 4
    rank 0: stages 0, 4                  rank 0: stages 0, 7
    rank 1: stages 1, 5                  rank 1: stages 1, 6
    rank 2: stages 2, 6                  rank 2: stages 2, 5
    rank 3: stages 3, 7                  rank 3: stages 3, 4
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Dict, List, Optional, Tuple

from .actions import Action, Kind, Schedule, rank_of_stage
from .orders import ORDERS, Step

SCHEDULES = tuple(ORDERS)
DEFAULT_STAGES_PER_RANK = 2  # interleaved 1F1B, as in Megatron-LM's usual setting
V_STAGES_PER_RANK = 2  # ZB-V and DualPipeV: one stage down, one up
#: Unit costs the builder plans transfers with: the paper's equal times (F = I = W).
PLANNING_COST = {Kind.FORWARD: 1, Kind.BACKWARD: 2, Kind.BACKWARD_INPUT: 1, Kind.BACKWARD_WEIGHT: 1}

Item = Tuple[Kind, int, int]  # (transfer kind, stage, micro-batch)


def inputs_of(kind: Kind, stage: int, mb: int, n_stages: int) -> List[Item]:
    """What a compute step needs from another stage (a receive, or a hand-over in memory)."""
    if kind is Kind.FORWARD:
        return [(Kind.RECV_ACT, stage, mb)] if stage > 0 else []
    if kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
        return [(Kind.RECV_GRAD, stage, mb)] if stage < n_stages - 1 else []
    return []  # W: only its own stage's I


def outputs_of(kind: Kind, stage: int, mb: int, n_stages: int) -> List[Item]:
    """What a compute step produces for another stage (a send, or a hand-over in memory)."""
    if kind is Kind.FORWARD:
        return [(Kind.SEND_ACT, stage, mb)] if stage < n_stages - 1 else []
    if kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
        return [(Kind.SEND_GRAD, stage, mb)] if stage > 0 else []
    return []


def delivers(item: Item) -> Item:
    """The receive that a send item satisfies."""
    kind, stage, mb = item
    if kind is Kind.SEND_ACT:
        return (Kind.RECV_ACT, stage + 1, mb)
    return (Kind.RECV_GRAD, stage - 1, mb)


# ----------------------------------------------------------------------------- builder


def place_transfers(
    orders: List[List[Step]], n_stages: int, rank_of: Callable[[int], int]
) -> List[List[Action]]:
    """Compute orders with their transfers placed: each action list of one global execution.

    Runs the orders as a dataflow at unit costs (:data:`PLANNING_COST`; a step starts when its
    rank is free and its inputs exist), records each transfer as one event at the moment its
    tensor is produced, and sorts every event by time: sends and receives come before the
    compute steps that start at the same moment. Each rank's list is its share of that one
    sorted sequence, so the lists replay even with blocking transfers (every send met by its
    receive at once), and a peer's messages are received in the order it sends them.
    """
    events: List[Tuple[float, int, int, int, Action]] = []  # (time, class, seq, rank, action)

    def record(time: float, rank: int, action: Action, transfer: bool) -> None:
        events.append((time, 0 if transfer else 1, len(events), rank, action))

    ready: Dict[Item, float] = {}  # (RECV_*, stage, mb) -> when the input exists
    waiting: Dict[Item, List[int]] = {}  # input not produced yet -> ranks stopped on it
    pos, clock = [0] * len(orders), [0.0] * len(orders)
    work = deque(range(len(orders)))
    while work:
        r = work.popleft()
        while pos[r] < len(orders[r]):
            kind, stage, mb = orders[r][pos[r]]
            needs = inputs_of(kind, stage, mb, n_stages)
            missing = [x for x in needs if x not in ready]
            if missing:
                waiting.setdefault(missing[0], []).append(r)
                break
            start = max([clock[r]] + [ready[x] for x in needs])
            record(start, r, Action(kind, stage, mb), transfer=False)
            clock[r] = start + PLANNING_COST[kind]
            for item in outputs_of(kind, stage, mb, n_stages):
                need = delivers(item)
                ready[need] = clock[r]
                peer = rank_of(need[1])
                if peer != r:  # else the next stage is here: handed over in memory
                    record(clock[r], r, Action(*item, peer=peer), transfer=True)
                    record(clock[r], peer, Action(*need, peer=r), transfer=True)
                work.extend(waiting.pop(need, []))
            pos[r] += 1
    stuck = {r: order[pos[r]] for r, order in enumerate(orders) if pos[r] < len(order)}
    if stuck:
        raise AssertionError(f"compute orders deadlock; waiting: {stuck}")
    lists: List[List[Action]] = [[] for _ in orders]
    events.sort()  # by time, then transfers first, then as recorded (seq is unique)
    for *_, rank, action in events:
        lists[rank].append(action)
    return lists


# ----------------------------------------------------------------------------- the entry point


def build_schedule(
    name: str, n_ranks: int, n_microbatches: int, stages_per_rank: Optional[int] = None
) -> Schedule:
    """Plans one training step.

    Args:
        name: one of :data:`SCHEDULES`: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``,
            ``"zb-h1"``, ``"zb-h2"``, ``"zb-v"``, ``"dualpipe-v"``.
        n_ranks: pipeline ranks (physical stages).
        n_microbatches: micro-batches per step.
        stages_per_rank: virtual stages per rank: interleaved 1F1B (default 2); ZB-V and
            DualPipeV have 2, the others 1.
    """
    _check_positive(n_ranks=n_ranks, n_microbatches=n_microbatches)
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {name!r}")
    chunks = _stages_per_rank(name, stages_per_rank)
    _check_microbatches(name, n_ranks, n_microbatches)
    make_orders, placement = ORDERS[name]
    n_stages = n_ranks * chunks
    orders = make_orders(n_ranks, n_microbatches, chunks)
    rank_of = lambda s: rank_of_stage(s, n_ranks, placement)  # noqa: E731
    lists = place_transfers(orders, n_stages, rank_of)
    actions = tuple(tuple(a) for a in lists)
    return Schedule(name, n_ranks, n_stages, n_microbatches, actions, placement)


def _stages_per_rank(name: str, given: Optional[int]) -> int:
    if name == "interleaved-1f1b":
        chunks = DEFAULT_STAGES_PER_RANK if given is None else given
        _check_positive(stages_per_rank=chunks)
        return chunks
    fixed = V_STAGES_PER_RANK if ORDERS[name][1] == "v" else 1
    if given not in (None, fixed):
        raise ValueError(
            f"stages_per_rank={given}: {name} has {fixed} stage(s) per rank; only "
            "interleaved-1f1b takes another number"
        )
    return fixed


def _check_microbatches(name: str, n_ranks: int, n_mb: int) -> None:
    if name == "interleaved-1f1b" and n_mb % n_ranks:
        # Megatron-LM's rule too: the rounds of micro-batches must fill every rank, or the
        # warm-up count is wrong and the compute orders deadlock (seen for 12 on 8 ranks).
        raise ValueError(
            f"interleaved-1f1b needs n_microbatches ({n_mb}) to be a multiple of the pipeline "
            f"ranks ({n_ranks})"
        )
    if name == "dualpipe-v" and n_mb < 2 * n_ranks:
        # DeepSeek's and torch's rule: its phases need a micro-batch per stage in flight.
        raise ValueError(
            f"dualpipe-v needs n_microbatches ({n_mb}) >= 2 x the pipeline ranks "
            f"({2 * n_ranks} stages)"
        )


def _check_positive(**values: int) -> None:
    for arg, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{arg} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{arg} must be >= 1, got {value}")
