"""The two communicators a parameter server talks over, and the messages they carry.

    requests   worker -> server   a server receives from any source: one loop hears every
                                  worker, whichever speaks first
    replies    server -> worker   a worker receives from the server it asked

Two, not one: a rank that is a server and a worker at once receives on both (its server loop
from any worker, its worker from the other servers), and a receive from any source would take
a reply meant for the worker. Whatever the number of servers and workers, that is all: no
communicator per pair.

Messages (worker -> server): a header ``[kind, clock, version_read]`` (int64), then for PUSH
the gradient shard. Reply to PULL (server -> worker): a header ``[version, 0, 0]``, then the
shard.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import CommError

PUSH, PULL, DONE = 1, 2, 3
HEADER = 3


def header(kind: int, clock: int, version: int) -> torch.Tensor:
    return torch.tensor([kind, clock, version], dtype=torch.int64)


class Channels:
    """The requests and replies communicators over ``comm``'s group (collective: every rank
    of the group creates them, in the same order as its other communicators)."""

    def __init__(self, comm, timeout) -> None:
        from ..comm import Communicator

        self.rank = comm.rank
        self.requests = Communicator(group=comm.group, device=comm.device, timeout=timeout)
        self.replies = Communicator(group=comm.group, device=comm.device, timeout=timeout)

    def call(self, what: str, role: str, peer: int, fn: Callable[[], object]):
        """Runs one send or receive with ``peer``; errors name it (``server rank 2``)."""
        try:
            return fn()
        except (CommError, RuntimeError) as e:
            raise CommError(
                f"[rank {self.rank}] ParameterServer.{what}: {role} rank {peer} failed: {e}"
            ) from e

    def close(self) -> None:
        self.requests.close()
        self.replies.close()
