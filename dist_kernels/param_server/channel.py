"""One Communicator per (server, worker) pair, and the messages they exchange.

Why pairs: a Communicator runs its receives one after the other, so a server waiting on one
worker's next push could not hear another's. A two-rank Communicator per pair gives every pair
its own lanes; a server thread per worker then blocks on that worker alone.

Messages (worker -> server): a header ``[kind, clock, version_read]`` (int64), then for PUSH the
gradient shard. Reply to PULL (server -> worker): a header ``[version, 0, 0]``, then the shard.
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch
import torch.distributed as dist

from ..errors import CommError

PUSH, PULL, DONE = 1, 2, 3
HEADER = 3


def header(kind: int, clock: int, version: int) -> torch.Tensor:
    return torch.tensor([kind, clock, version], dtype=torch.int64)


class PairChannel:
    """The link between global ranks ``me`` and ``peer``; errors name the peer's global rank."""

    def __init__(self, comm, me: int, peer: int, peer_role: str) -> None:
        self.comm = comm
        self.me = me
        self.peer = peer
        self.peer_role = peer_role
        self._peer_local = 1 - comm.rank  # the pair's ranks are 0 and 1

    def _call(self, what: str, fn, tensor: torch.Tensor) -> None:
        try:
            fn(tensor, self._peer_local)
        except (CommError, RuntimeError) as e:
            raise CommError(
                f"[rank {self.me}] ParameterServer.{what}: {self.peer_role} rank {self.peer} "
                f"failed: {e}"
            ) from e

    def send(self, tensor: torch.Tensor, what: str) -> None:
        self._call(what, self.comm.send, tensor)

    def recv(self, tensor: torch.Tensor, what: str) -> None:
        self._call(what, self.comm.recv, tensor)

    def close(self) -> None:
        self.comm.close()


def open_pair_channels(
    comm, servers: Sequence[int], workers: Sequence[int], timeout
) -> Dict[Tuple[int, int], PairChannel]:
    """Creates the (server, worker) pair communicators this rank belongs to.

    Collective over the default group: ``dist.new_group`` must run on every rank, for every
    pair, in the same (sorted) order; creating the pairs in that order cannot deadlock.
    """
    from ..comm import Communicator

    me = dist.get_rank()
    channels = {}
    for server in sorted(servers):
        for worker in sorted(workers):
            if server == worker:
                continue  # a rank serving itself calls its server directly
            group = dist.new_group([server, worker])
            if me not in (server, worker):
                continue
            pair = Communicator(group=group, device=comm.device, timeout=timeout)
            if me == worker:
                channels[(server, worker)] = PairChannel(pair, me, server, "server")
            else:
                channels[(server, worker)] = PairChannel(pair, me, worker, "worker")
    return channels
