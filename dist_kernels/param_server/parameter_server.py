"""``dk.ParameterServer``: workers push gradients and pull parameters at their own pace.

    ps = dk.ParameterServer(model, comm, lambda p: torch.optim.SGD(p, lr=0.1),
                            servers=[0, 1], mode="bounded", max_staleness=2)
    for x, y in batches:                       # on every worker rank
        model.zero_grad(); loss_fn(model(x), y).backward()
        ps.step()                              # push(.grad) then pull() into the model
    ps.close()                                 # every rank (servers wait for all workers)
    ps.log                                     # on a server: pushes, pulls, staleness, deaths

The flat parameter buffer is cut into contiguous byte ranges, one per server rank
(:func:`plan.shard_ranges`). A rank may be a server and a worker at once: its worker talks to
its own shard by a direct call, to the other servers through the requests and replies
communicators (:mod:`.channel`).
"""

from __future__ import annotations

import datetime
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from .channel import DONE, HEADER, PULL, PUSH, Channels, header
from .plan import Consistency, shard_ranges
from .server import ShardServer

OptimizerFactory = Callable[[List[torch.Tensor]], torch.optim.Optimizer]


def _check_ranks(what: str, ranks: Sequence[int], world_size: int, me: int) -> List[int]:
    ranks = sorted(set(int(r) for r in ranks))
    bad = [r for r in ranks if not 0 <= r < world_size]
    if not ranks or bad:
        raise ValueError(
            f"[rank {me}] ParameterServer: {what} must be non-empty ranks in [0, {world_size}), "
            f"got {ranks}"
        )
    return ranks


class ParameterServer:
    """Sharded parameter server over dist_kernels point-to-point messages.

    Args:
        model: the model; trainable parameters share one dtype. Rank 0's values are broadcast
            at construction (every rank of ``comm`` constructs, in the same order).
        comm: a CPU Communicator of a torch group (ranks below are its ranks); the server
            makes two communicators of its own over the same group.
        optimizer: factory ``params -> torch.optim.Optimizer``; each server builds one over
            its shard.
        servers: ranks holding shards (default ``[0]``).
        workers: ranks that train (default every rank).
        mode: ``"sync"``, ``"bounded"`` or ``"async"`` (see :class:`plan.Consistency`).
        max_staleness: s for ``"bounded"``: a worker more than s pushes ahead of the slowest
            live worker waits in :meth:`pull`.
        timeout: per-message timeout (default ``comm.timeout``); a worker may wait that long
            for a straggler in bounded or sync mode, a server that long for the next request.
    """

    def __init__(
        self,
        model: nn.Module,
        comm,
        optimizer: OptimizerFactory,
        *,
        servers: Sequence[int] = (0,),
        workers: Optional[Sequence[int]] = None,
        mode: str = "sync",
        max_staleness: int = 0,
        timeout: Optional[datetime.timedelta] = None,
    ) -> None:
        self.rank = comm.rank
        if getattr(comm, "group", None) is None:
            raise ValueError(
                f"[rank {self.rank}] ParameterServer: comm must be a Communicator of a torch "
                f"group (Communicator(group=...)), not one built from a store"
            )
        self.consistency = Consistency(mode, max_staleness)
        self.servers = _check_ranks("servers", servers, comm.world_size, self.rank)
        all_ranks = range(comm.world_size)
        self.workers = _check_ranks("workers", workers or all_ranks, comm.world_size, self.rank)
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        if len({p.dtype for p in self.params}) != 1:
            raise TypeError(f"[rank {self.rank}] ParameterServer: parameters need one dtype")
        with torch.no_grad():
            self.flat = torch.cat([p.detach().reshape(-1) for p in self.params])
            comm.broadcast(self.flat, src=0)
            self._write_params()
        self.shards = shard_ranges(self.flat.numel(), self.flat.element_size(), self.servers)
        self._channels = Channels(comm, timeout or comm.timeout)
        self.server: Optional[ShardServer] = None
        for shard in self.shards:
            if shard.server == self.rank:
                self.server = ShardServer(
                    self.rank,
                    shard,
                    self.flat[shard.start : shard.stop],
                    optimizer,
                    self.workers,
                    self.consistency,
                )
                remote = [w for w in self.workers if w != self.rank]
                self.server.serve(self._channels, remote)
        self.is_worker = self.rank in self.workers
        self.clock = 0  # pushes done by this worker
        self.versions = {s: 0 for s in self.servers}  # server version of the last pull
        self._closed = False

    # -- worker side -----------------------------------------------------------------------

    def _write_params(self) -> None:
        offset = 0
        for p in self.params:
            p.data.copy_(self.flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def _flat_grads(self, grads: Optional[Sequence[Optional[torch.Tensor]]]) -> torch.Tensor:
        if grads is None:
            grads = [p.grad for p in self.params]
        if len(grads) != len(self.params):
            raise ValueError(
                f"[rank {self.rank}] ParameterServer.push: got {len(grads)} gradients for "
                f"{len(self.params)} parameters"
            )
        return torch.cat(
            [
                (g if g is not None else torch.zeros_like(p)).detach().reshape(-1).to(p.dtype)
                for g, p in zip(grads, self.params)
            ]
        )

    def _check_worker(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"[rank {self.rank}] ParameterServer.{what}: closed")
        if not self.is_worker:
            raise RuntimeError(
                f"[rank {self.rank}] ParameterServer.{what}: this rank is not a worker "
                f"(workers {self.workers})"
            )

    def push(self, grads: Optional[Sequence[Optional[torch.Tensor]]] = None) -> None:
        """Sends this worker's gradients (default the parameters' ``.grad``) to every server."""
        self._check_worker("push")
        flat = self._flat_grads(grads)
        self.clock += 1
        for shard in self.shards:
            piece = flat[shard.start : shard.stop]
            version = self.versions[shard.server]
            if shard.server == self.rank:
                self.server.push(self.rank, self.clock, version, piece.clone())
                continue
            self._send(header(PUSH, self.clock, version), shard.server, "push")
            self._send(piece.contiguous(), shard.server, "push")

    def _send(self, tensor: torch.Tensor, server: int, what: str) -> None:
        requests = self._channels.requests
        self._channels.call(what, "server", server, lambda: requests.send(tensor, server))

    def _recv(self, tensor: torch.Tensor, server: int, what: str) -> None:
        replies = self._channels.replies
        self._channels.call(what, "server", server, lambda: replies.recv(tensor, server))

    def pull(self) -> None:
        """Writes the servers' parameters into the model (waits as the mode requires)."""
        self._check_worker("pull")
        remote = [s for s in self.shards if s.server != self.rank]
        for shard in remote:  # ask every server first: they answer in parallel
            self._send(header(PULL, self.clock, 0), shard.server, "pull")
        reply = torch.empty(HEADER, dtype=torch.int64)
        for shard in self.shards:
            if shard.server == self.rank:
                version, values = self.server.pull(self.rank, self.clock)
                self.flat[shard.start : shard.stop].copy_(values)
            else:
                self._recv(reply, shard.server, "pull")
                version = int(reply[0])
                self._recv(self.flat[shard.start : shard.stop], shard.server, "pull")
            self.versions[shard.server] = version
        with torch.no_grad():
            self._write_params()

    def step(self, grads: Optional[Sequence[Optional[torch.Tensor]]] = None) -> None:
        """push() then pull()."""
        self.push(grads)
        self.pull()

    # -- reports and lifecycle ---------------------------------------------------------------

    @property
    def log(self) -> List[dict]:
        """This rank's server log (empty on a rank that serves no shard)."""
        return list(self.server.log) if self.server is not None else []

    @property
    def dead_workers(self) -> Dict[int, str]:
        """Workers this rank's server lost, with the error that told it."""
        return dict(self.server.dead) if self.server is not None else {}

    def staleness(self) -> dict:
        """Summary of this server's log: max and mean staleness of applied pushes (server
        steps since the worker read the parameters), and the max clock gap at answered pulls."""
        pushes = [e["staleness"] for e in self.log if e["event"] == "push"]
        gaps = [e["gap"] for e in self.log if e["event"] == "pull"]
        return {
            "pushes": len(pushes),
            "max_staleness": max(pushes, default=0),
            "mean_staleness": sum(pushes) / len(pushes) if pushes else 0.0,
            "max_gap": max(gaps, default=0),
            "dead_workers": sorted(self.dead_workers),
        }

    def close(self) -> None:
        """Tells the servers this worker is done; on a server, waits for every worker."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.is_worker:
                for server in self.servers:
                    if server != self.rank:
                        self._send(header(DONE, self.clock, 0), server, "close")
                if self.server is not None:
                    self.server.finish(self.rank)
            if self.server is not None:
                self.server.join()
        finally:
            self._channels.close()

    def __enter__(self) -> ParameterServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
