"""Compute orders: the forward and backward steps each rank runs, in order, per schedule.

Pure and transfer-free: :mod:`.schedules` turns these orders into action lists with their
sends and receives. A step is ``(kind, stage, micro-batch)`` with the kinds of torch's
pipelining: ``F`` forward, ``B`` full backward, ``I`` the input-gradient half of a backward
and ``W`` its weight-gradient half (the zero-bubble split: ``I`` is on the critical path, sent
upstream at once, and ``W`` waits to fill a bubble).

Each function returns one order per rank. Loop placement puts stage ``s`` on rank
``s % p``; V placement (ZB-V, DualPipeV) puts stages ``r`` and ``2p - 1 - r`` on rank ``r``, so
a micro-batch runs down the ranks and back up, and the loss is on rank 0::

    p = 4, V:  rank 0: stages 0, 7    rank 1: 1, 6    rank 2: 2, 5    rank 3: 3, 4

Bubbles at equal times (one slot per F, I, W; p ranks, m micro-batches), as the paper counts
them (idle time inside a rank's own span over its compute; the table in docs/pipeline.md):
1F1B (p-1)/m, ZB-H1 (p-1)/(3m) (m >= p), ZB-H2 and ZB-V 0 (m >= 2p - 1).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Tuple

from .actions import Kind

Step = Tuple[Kind, int, int]
Orders = List[List[Step]]

F, B, I, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT  # noqa: E741


class _Counter:
    """Appends steps to one rank's order, numbering micro-batches per (kind, stage)."""

    def __init__(self) -> None:
        self.order: List[Step] = []
        self.count: Dict[Tuple[Kind, int], int] = {}
        self.owed: Dict[int, Deque[Tuple[int, int]]] = {}  # stage -> (seq, mb): I done, no W

    def __getitem__(self, key: Tuple[Kind, int]) -> int:
        return self.count.get(key, 0)

    @property
    def owes_w(self) -> bool:
        return any(self.owed.values())

    def add(self, kind: Kind, stage: int) -> None:
        """The next micro-batch of ``kind`` on ``stage`` (a full B counts as an I and a W)."""
        key = (I if kind is B else kind, stage)
        mb = self[key]
        self.count[key] = mb + 1
        if kind is B:
            self.count[(W, stage)] = self[(W, stage)] + 1
        if kind is I:
            self.owed.setdefault(stage, deque()).append((len(self.order), mb))
        self.order.append((kind, stage, mb))

    def add_owed_w(self, stage: Optional[int] = None) -> None:
        """The oldest weight gradient still owed (of ``stage``, if given), if any."""
        heads = [(q[0][0], s) for s, q in self.owed.items() if q and stage in (None, s)]
        if heads:
            _, s = min(heads)
            _, mb = self.owed[s].popleft()
            self.count[(W, s)] = self[(W, s)] + 1
            self.order.append((W, s, mb))


# ----------------------------------------------------------------------------- one stage per rank


def gpipe(n_ranks: int, n_mb: int, _chunks: int = 1) -> Orders:
    """All forwards, then all backwards, in micro-batch order."""
    return [
        [(F, r, m) for m in range(n_mb)] + [(B, r, m) for m in range(n_mb)] for r in range(n_ranks)
    ]


def one_f_one_b(n_ranks: int, n_mb: int, _chunks: int = 1) -> Orders:
    """Warm-up forwards (``p - r - 1``), then alternate F and B, then drain the Bs.

    A rank never holds more than ``p - r`` micro-batches' activations.
    """
    orders = []
    for r in range(n_ranks):
        warmup = min(n_ranks - r - 1, n_mb)
        order = [(F, r, m) for m in range(warmup)]
        for i in range(n_mb - warmup):
            order += [(F, r, warmup + i), (B, r, i)]
        orders.append(order + [(B, r, m) for m in range(n_mb - warmup, n_mb)])
    return orders


def zb_h1(n_ranks: int, n_mb: int, _chunks: int = 1) -> Orders:
    """ZB-H1 (the paper's ZB1P handcrafted): 1F1B's memory, a third of its bubble.

    Rank ``r`` runs 1F1B's warm-up, then ``r`` rounds of F I whose Ws it owes, then F I W
    rounds, then I W, and pays the ``r`` owed Ws at the end, where 1F1B idles::

        p = 2, m = 4:   rank 0 | F0 F1 I0 W0 F2 I1 W1 F3 I2 W2 I3 W3
                        rank 1 | .  F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3

    Every rank holds at most ``p`` micro-batches' activations (from F to W), 1F1B's peak.
    """
    orders = []
    for r in range(n_ranks):
        c = _Counter()
        for _ in range(min(n_ranks - r - 1, n_mb)):  # warm-up, as 1F1B
            c.add(F, r)
        for _ in range(min(r, n_mb - c[(F, r)])):  # F I: the W is owed
            c.add(F, r)
            c.add(I, r)
        while c[(F, r)] < n_mb:  # steady state: F I W, paying the oldest owed W
            c.add(F, r)
            c.add(I, r)
            c.add_owed_w()
        while c[(I, r)] < n_mb:  # cool-down
            c.add(I, r)
            c.add_owed_w()
        while c.owes_w:  # the owed Ws fill 1F1B's tail bubble
            c.add_owed_w()
        orders.append(c.order)
    return orders


def zb_h2(n_ranks: int, n_mb: int, _chunks: int = 1) -> Orders:
    """ZB-H2: a zero bubble inside each rank's span for ``2p - 1`` micro-batches of memory.

    A greedy list schedule at unit times (one slot per F, I, W): whenever a rank is free it runs
    the earliest-startable of its next I (critical path first), its next F (while fewer than
    ``2p - 1`` micro-batches hold activations), its oldest owed W; ties go I, F, W. The extra
    warm-up forwards fill the bubble before the first I, and the owed Ws fill the tail, so the
    trapezoid of 1F1B becomes the paper's parallelogram.
    """
    return _greedy(n_ranks, n_mb, limit=2 * n_ranks - 1)


def _greedy(n_ranks: int, n_mb: int, limit: int) -> Orders:
    finish: Dict[Step, int] = {}  # (kind, stage, micro-batch) -> end time
    clock = [0] * n_ranks
    counters = [_Counter() for _ in range(n_ranks)]
    # Per rank its best next step (start, rank, preference, kind), or None: a rank's options
    # change only when it or a neighbour (the stages it exchanges with) runs a step.
    best = [_best(r, counters[r], finish, 0, n_ranks, n_mb, limit) for r in range(n_ranks)]
    for _ in range(3 * n_ranks * n_mb):
        start, r, _, kind = min(b for b in best if b is not None)
        c = counters[r]
        if kind is W:
            c.add_owed_w()
        else:
            c.add(kind, r)
        clock[r] = start + 1
        finish[c.order[-1]] = clock[r]
        for q in range(max(r - 1, 0), min(r + 2, n_ranks)):
            best[q] = _best(q, counters[q], finish, clock[q], n_ranks, n_mb, limit)
    return [c.order for c in counters]


def _best(r: int, c: _Counter, finish, now: int, n_ranks: int, n_mb: int, limit: int):
    """(earliest start, rank, preference, kind) of the step rank ``r`` should run next."""
    options = []
    mb = c[(I, r)]
    if mb < c[(F, r)]:
        needs = [(F, r, mb)] + ([(I, r + 1, mb)] if r < n_ranks - 1 else [])
        if all(n in finish for n in needs):
            options.append((max([now] + [finish[n] for n in needs]), r, 0, I))
    mb = c[(F, r)]
    if mb < n_mb and mb - c[(W, r)] < limit:
        needs = [(F, r - 1, mb)] if r > 0 else []
        if all(n in finish for n in needs):
            options.append((max([now] + [finish[n] for n in needs]), r, 1, F))
    if c.owes_w:
        options.append((now, r, 2, W))
    return min(options, default=None)


# ----------------------------------------------------------------------------- several per rank


def interleaved_1f1b(n_ranks: int, n_mb: int, chunks: int) -> Orders:
    """Megatron-LM's interleaved 1F1B: deeper warm-up, then one F and one B alternately."""
    orders = []
    total = chunks * n_mb
    for r in range(n_ranks):
        fwd = [(F, c * n_ranks + r, m) for c, m in _rounds(n_ranks, chunks, n_mb, False)]
        bwd = [(B, c * n_ranks + r, m) for c, m in _rounds(n_ranks, chunks, n_mb, True)]
        warmup = min((n_ranks - r - 1) * 2 + (chunks - 1) * n_ranks, total)
        order = fwd[:warmup]
        for i in range(total - warmup):
            order += [fwd[warmup + i], bwd[i]]
        orders.append(order + bwd[total - warmup :])
    return orders


def _rounds(n_ranks: int, chunks: int, n_mb: int, backward: bool) -> List[Tuple[int, int]]:
    """(chunk, micro-batch) in the order a rank runs them: rounds of ``n_ranks`` micro-batches,
    each round through every chunk (reversed for backward) before the next round starts::

        p=2, 2 chunks, 4 micro-batches, forward: (0,0) (0,1) (1,0) (1,1) (0,2) (0,3) (1,2) (1,3)
    """
    order = range(chunks - 1, -1, -1) if backward else range(chunks)
    units = []
    for first in range(0, n_mb, n_ranks):
        round_mbs = range(first, min(first + n_ranks, n_mb))
        units += [(c, m) for c in order for m in round_mbs]
    return units


def zb_v(n_ranks: int, n_mb: int, _chunks: int = 2) -> Orders:
    """ZB-V (the paper's section 6): two stages per rank in a V, zero bubble at F = I = W.

    Rank ``r`` holds the down stage ``d = r`` and the up stage ``u = 2p - 1 - r``. Phases:
    ``2(p - r) - 1`` forwards of ``d``; ``r`` pairs F(u) F(d); ``p - r`` rounds F I W of ``u``;
    steady rounds F I W of ``d`` then of ``u``; cool-down ``r`` pairs I(d) I(u), ``p - r``
    rounds I W of ``d``; the owed Ws of ``u``, then of ``d``. Planned for
    ``max(m, 2p - 1)`` micro-batches (the shape needs that many) and cut to ``m``.
    """
    planned = max(n_mb, 2 * n_ranks - 1)
    orders = []
    for r in range(n_ranks):
        down, up, c = r, 2 * n_ranks - 1 - r, _Counter()
        for _ in range(2 * (n_ranks - r) - 1):
            c.add(F, down)
        for _ in range(r):
            c.add(F, up)
            c.add(F, down)
        for _ in range(n_ranks - r):
            _fiw(c, up)
        while c[(F, up)] < c[(F, down)] or c[(F, down)] < planned:
            if c[(F, down)] < planned:
                c.add(F, down)
            c.add(I, down)
            c.add_owed_w()
            _fiw(c, up)
        for _ in range(r):
            c.add(I, down)
            c.add(I, up)
        for _ in range(n_ranks - r):
            c.add(I, down)
            c.add_owed_w(down)
        for stage in (up, down):  # the owed Ws, the up stage's first
            while c[(W, stage)] < c[(I, stage)]:
                c.add_owed_w(stage)
        orders.append([step for step in c.order if step[2] < n_mb])
    return orders


def _fiw(c: _Counter, stage: int) -> None:
    c.add(F, stage)
    c.add(I, stage)
    c.add_owed_w()


def dualpipe_v(n_ranks: int, n_mb: int, _chunks: int = 2) -> Orders:
    """DualPipeV (DeepSeek's DualPipe cut in half, V placement); needs ``m >= 2p``.

    DeepSeek's phases, with each overlapped forward-and-backward pair of chunks run one after
    the other (the overlap hides expert-parallel all-to-alls on GPUs; a CPU rank runs them in
    turn)::

        1  2(p - r - 1) x F(d)            5  p - r - 1 x B(u), F(u) B(d)
        2  r + 1 x F(d) F(u)              6  r + 1 x B(u) B(d), split into I from halfway
        3  p - r - 1 x I(u) W F(u)        7  p - r - 1 x W, I/B(d)
        4  m - 2p + r + 1 x F(d) B(u), F(u) B(d)     8  r + 1 x W (the owed ones)
    """
    orders = []
    for r in range(n_ranks):
        down, up, c = r, 2 * n_ranks - 1 - r, _Counter()
        for _ in range(2 * (n_ranks - r - 1)):
            c.add(F, down)
        for _ in range(r + 1):
            c.add(F, down)
            c.add(F, up)
        for _ in range(n_ranks - r - 1):
            c.add(I, up)
            c.add_owed_w()
            c.add(F, up)
        for _ in range(n_mb - 2 * n_ranks + r + 1):
            for forward, backward in ((down, up), (up, down)):
                c.add(F, forward)
                c.add(B, backward)
        for _ in range(n_ranks - r - 1):
            c.add(B, up)
            c.add(F, up)
            c.add(B, down)
        split = _dualpipe_cooldown(c, r, down, up)
        for _ in range(n_ranks - r - 1):
            c.add_owed_w()
            c.add(I if split else B, down)
        while c.owes_w:
            c.add_owed_w()
        orders.append(c.order)
    return orders


def _dualpipe_cooldown(c: _Counter, r: int, down: int, up: int) -> bool:
    """Phase 6: ``r + 1`` rounds of backward on both stages, split into I from halfway (odd
    ranks split the up stage first). Returns whether the split is on at the end."""
    split = False
    rounds = r + 1
    for i in range(rounds):
        if i == rounds // 2 and r % 2 == 1:
            split = True
        c.add(I if split else B, up)
        if i == rounds // 2 and r % 2 == 0:
            split = True
        c.add(I if split else B, down)
    return split


#: name -> (orders(n_ranks, n_microbatches, stages_per_rank), placement)
ORDERS: Dict[str, Tuple[Callable[[int, int, int], Orders], str]] = {
    "gpipe": (gpipe, "loop"),
    "1f1b": (one_f_one_b, "loop"),
    "interleaved-1f1b": (interleaved_1f1b, "loop"),
    "zb-h1": (zb_h1, "loop"),
    "zb-h2": (zb_h2, "loop"),
    "zb-v": (zb_v, "v"),
    "dualpipe-v": (dualpipe_v, "v"),
}
