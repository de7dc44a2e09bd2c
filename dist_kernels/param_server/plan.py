"""Pure planning for the parameter server: shards of the flat parameter buffer and the rule of
each consistency mode. No I/O; tested without ranks.

Shards are contiguous byte ranges of the flat buffer, cut on element boundaries, as even as
the element count allows (the first ``numel % servers`` shards get one element more):

    flat buffer  |<---- server 0 ---->|<---- server 1 ---->|<--- server 2 --->|
                 0                    b1                   b2                 numel * elsize
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

MODES = ("sync", "bounded", "async")


@dataclass(frozen=True)
class Shard:
    """Elements ``[start, stop)`` of the flat buffer, held by rank ``server``."""

    server: int
    start: int
    stop: int
    element_size: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def byte_range(self) -> tuple:
        return (self.start * self.element_size, self.stop * self.element_size)


def shard_ranges(numel: int, element_size: int, servers: Sequence[int]) -> List[Shard]:
    """Cuts ``numel`` elements into one contiguous shard per server rank, in ``servers`` order."""
    if not servers:
        raise ValueError("shard_ranges: need at least one server rank")
    if numel < len(servers):
        raise ValueError(
            f"shard_ranges: {numel} elements cannot be cut into {len(servers)} non-empty shards"
        )
    base, extra = divmod(numel, len(servers))
    shards, start = [], 0
    for i, server in enumerate(servers):
        stop = start + base + (1 if i < extra else 0)
        shards.append(Shard(server, start, stop, element_size))
        start = stop
    return shards


@dataclass(frozen=True)
class Consistency:
    """When a server answers a pull, and how it applies pushes.

    Attributes:
        mode: ``"sync"`` (BSP: a round's pushes are averaged and applied once, every worker
            waits for the round), ``"bounded"`` (SSP: each push applied on arrival, a worker
            more than ``max_staleness`` clocks ahead of the slowest live worker waits) or
            ``"async"`` (each push applied on arrival, nobody waits).
        max_staleness: s for ``"bounded"``; 0 elsewhere.
    """

    mode: str = "sync"
    max_staleness: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"ParameterServer: mode must be one of {MODES}, got {self.mode!r}")
        s = self.max_staleness
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise ValueError(f"ParameterServer: max_staleness must be an int >= 0, got {s!r}")
        if self.mode != "bounded" and s != 0:
            raise ValueError(
                f"ParameterServer: max_staleness={s} only applies to mode='bounded', "
                f"not {self.mode!r}"
            )

    def may_answer(self, clock: int, slowest_clock: int) -> bool:
        """May a worker that has pushed ``clock`` times read, given the slowest live worker's
        clock? (``slowest_clock`` counts rounds applied in sync mode.)"""
        if self.mode == "async":
            return True
        if self.mode == "sync":
            return slowest_clock >= clock
        return clock - slowest_clock <= self.max_staleness
