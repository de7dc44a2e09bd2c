"""A schedule as data: per-rank lists of :class:`Action` s, with a printable form.

Compute actions use torch.distributed.pipelining's codes: ``F`` forward, ``B`` full backward,
``I`` the input-gradient half of a backward (sent upstream at once), ``W`` its weight-gradient
half. Transfers: ``SA``/``RA`` send and receive an activation, ``SG``/``RG`` a gradient. Each
action is for one stage and one micro-batch; the runtime executes its rank's list and nothing
else.

Placement of stages on ranks: ``"loop"`` puts stage ``s`` on rank ``s % p`` (GPipe, 1F1B and
the zero-bubble H schedules with one stage per rank; interleaved 1F1B with several); ``"v"`` puts
stages ``r`` and ``2p - 1 - r`` on rank ``r`` (ZB-V, DualPipeV), so the first and last stages
share rank 0.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Optional, Tuple

PLACEMENTS = ("loop", "v")


class Kind(str, enum.Enum):
    """What an action does; the value is its printed code."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients in one pass
    BACKWARD_INPUT = "I"  # the input gradient only; the weight gradient waits for W
    BACKWARD_WEIGHT = "W"  # the weight gradient of an earlier I
    SEND_ACT = "SA"  # send the stage's output to the next stage's rank
    RECV_ACT = "RA"  # receive the stage's input from the previous stage's rank
    SEND_GRAD = "SG"  # send the gradient of the stage's input to the previous stage's rank
    RECV_GRAD = "RG"  # receive the gradient of the stage's output from the next stage's rank

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_ACT, Kind.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self in (Kind.RECV_ACT, Kind.RECV_GRAD)


COMPUTE = (Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)

DESCRIPTIONS = {
    Kind.FORWARD: "forward",
    Kind.BACKWARD: "backward",
    Kind.BACKWARD_INPUT: "input-gradient backward",
    Kind.BACKWARD_WEIGHT: "weight-gradient backward",
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

    @property
    def key(self) -> Tuple[Kind, int, int]:
        return (self.kind, self.stage, self.microbatch)

    def label(self, show_stage: bool) -> str:
        """Short form, ``F3``; with ``show_stage`` the stage leads, ``2F3`` (several per rank)."""
        return f"{self.stage}{self}" if show_stage else str(self)

    def describe(self) -> str:
        """Long form for error messages: ``recv-grad of stage 2, micro-batch 3 from rank 1``."""
        text = f"{DESCRIPTIONS[self.kind]} of stage {self.stage}, micro-batch {self.microbatch}"
        if self.peer is not None:
            text += f" {'to' if self.kind.is_send else 'from'} rank {self.peer}"
        return text


def rank_of_stage(stage: int, n_ranks: int, placement: str) -> int:
    """The rank that runs ``stage``: looped, or zig-zag for ``"v"`` (down, up, down...)."""
    rank = stage % n_ranks
    if placement == "v" and (stage // n_ranks) % 2:
        return n_ranks - 1 - rank
    return rank


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists for one training step."""

    name: str
    n_ranks: int
    n_stages: int  # total (virtual) stages
    n_microbatches: int
    actions: Tuple[Tuple[Action, ...], ...]  # actions[rank]
    placement: str = "loop"

    def rank_of(self, stage: int) -> int:
        """The rank that runs ``stage``."""
        return rank_of_stage(stage, self.n_ranks, self.placement)

    def stages_of(self, rank: int) -> List[int]:
        """The stages that ``rank`` runs, in order."""
        return [s for s in range(self.n_stages) if self.rank_of(s) == rank]

    @property
    def stages_per_rank(self) -> int:
        return self.n_stages // self.n_ranks

    @property
    def splits_backward(self) -> bool:
        """Whether some backward runs as separate I and W actions."""
        return any(a.kind is Kind.BACKWARD_WEIGHT for acts in self.actions for a in acts)

    def format_rank(self, rank: int) -> str:
        """Every action of ``rank`` in order, transfers included: ``F0 SA0 F1 RG0 ...``."""
        show = self.stages_per_rank > 1
        return " ".join(a.label(show) for a in self.actions[rank])
