"""The server side: one shard of the parameters, its optimizer, and the consistency rule.

State changes happen under one condition variable: requests from remote workers (one thread,
receiving from any source on the requests communicator) and from a worker sharing this rank
(a direct call) take the same path. A remote pull that the rule does not allow yet waits in a
list, answered (sent without waiting, so the loop keeps hearing pushes) by whichever change of
state allows it. Every applied push and every answered pull is logged, so that staleness can
be measured (and asserted) after the run.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import CommError
from .channel import DONE, HEADER, PULL, PUSH, Channels, header
from .plan import Consistency, Shard


class ShardServer:
    """Serves ``shard`` of the flat parameters to ``workers`` under ``consistency``.

    Sync mode sums a round's pushes in worker-rank order and divides by the number of pushes
    (what synchronous data-parallel SGD does with the gradients), then steps the optimizer once.
    Bounded and async modes step on every push with the gradient divided by the number of
    workers, so that one round of pushes moves the parameters as far as one synchronous step.
    """

    def __init__(
        self,
        rank: int,
        shard: Shard,
        initial: torch.Tensor,
        optimizer: Callable[[List[torch.Tensor]], torch.optim.Optimizer],
        workers: Sequence[int],
        consistency: Consistency,
    ) -> None:
        self.rank = rank
        self.shard = shard
        self.param = torch.nn.Parameter(initial.detach().clone(), requires_grad=True)
        self.optimizer = optimizer([self.param])
        self.workers = sorted(workers)
        self.consistency = consistency
        self.version = 0  # optimizer steps applied to this shard
        self.rounds = 0  # sync: rounds applied
        self.clock: Dict[int, int] = {w: 0 for w in self.workers}  # pushes received per worker
        self.finished: set = set()
        self.dead: Dict[int, str] = {}
        self.log: List[dict] = []  # one entry per applied push / answered pull / death
        self._round: Dict[int, torch.Tensor] = {}
        self._cond = threading.Condition()
        self._channels: Optional[Channels] = None
        self._remote: List[int] = []  # workers on other ranks (the loop serves them)
        self._pulls: List[Tuple[int, int]] = []  # remote (worker, clock) not answered yet
        self._replies: List = []  # Works of replies sent and not yet seen complete
        self._thread: Optional[threading.Thread] = None
        self._t0 = time.monotonic()

    # -- the rule ------------------------------------------------------------------------

    def _live(self) -> List[int]:
        return [w for w in self.workers if w not in self.dead and w not in self.finished]

    def _min_live_clock(self) -> int:
        """Pushes received from the slowest worker still running (finished and dead ones no
        longer hold anyone back)."""
        live = self._live()
        return min(self.clock[w] for w in live) if live else max(self.clock.values())

    def _slowest_clock(self) -> int:
        return self.rounds if self.consistency.mode == "sync" else self._min_live_clock()

    # -- handlers (a remote worker's thread or the local worker call these) ---------------

    def push(self, worker: int, clock: int, version_read: int, grad: torch.Tensor) -> None:
        with self._cond:
            self.clock[worker] = clock
            entry = {
                "event": "push",
                "worker": worker,
                "clock": clock,
                "version_read": version_read,
                "staleness": self.version - version_read,
                "t": time.monotonic() - self._t0,
            }
            if self.consistency.mode == "sync":
                self._round[worker] = grad
                self._maybe_apply_round()
            else:
                self._apply(grad / len(self.workers))
            self.log.append(entry)
            self._changed()

    def _maybe_apply_round(self) -> None:
        waiting = [w for w in self._live() if w not in self._round]
        if waiting or not self._round:
            return
        ordered = [self._round[w] for w in sorted(self._round)]
        total = ordered[0].clone()
        for g in ordered[1:]:
            total += g
        total /= len(ordered)
        self._apply(total)
        self._round.clear()
        self.rounds += 1

    def _apply(self, grad: torch.Tensor) -> None:
        self.param.grad = grad
        self.optimizer.step()
        self.version += 1

    def _may_answer(self, clock: int) -> bool:
        return self.consistency.may_answer(clock, self._slowest_clock())

    def _answer(self, worker: int, clock: int) -> tuple:
        """Logs the pull (under the lock); returns (version, a copy of the shard)."""
        self.log.append(
            {
                "event": "pull",
                "worker": worker,
                "clock": clock,
                "gap": clock - self._min_live_clock(),
                "version": self.version,
                "t": time.monotonic() - self._t0,
            }
        )
        return self.version, self.param.detach().clone()

    def pull(self, worker: int, clock: int) -> tuple:
        """The local worker's pull: waits until it may read; returns (version, shard copy)."""
        with self._cond:
            self._cond.wait_for(lambda: self._may_answer(clock))
            return self._answer(worker, clock)

    def _changed(self) -> None:
        """Under the lock, after any change of state: wakes the local worker and answers the
        remote pulls the rule allows now."""
        self._cond.notify_all()
        for worker, clock in list(self._pulls):
            if self._may_answer(clock):
                self._pulls.remove((worker, clock))
                self._reply(worker, *self._answer(worker, clock))

    def _reply(self, worker: int, version: int, values: torch.Tensor) -> None:
        replies = self._channels.replies
        self._replies = [w for w in self._replies if not w.is_completed()]
        self._replies.append(replies.isend(header(version, 0, 0), worker))
        self._replies.append(replies.isend(values, worker))

    def finish(self, worker: int, error: Optional[str] = None) -> None:
        with self._cond:
            if error is None:
                self.finished.add(worker)
            else:
                self.dead[worker] = error
                self.log.append({"event": "dead", "worker": worker, "error": error})
            if self.consistency.mode == "sync":
                self._maybe_apply_round()  # the round no longer waits for this worker
            self._changed()

    # -- remote workers --------------------------------------------------------------------

    def serve(self, channels: Channels, remote: Sequence[int]) -> None:
        """Starts the loop that serves the workers on other ranks."""
        self._channels = channels
        self._remote = sorted(remote)
        if self._remote:
            self._thread = threading.Thread(
                target=self._serve, name=f"dk-ps-server{self.rank}", daemon=True
            )
            self._thread.start()

    def _serving(self) -> List[int]:
        with self._cond:
            return [w for w in self._remote if w not in self.finished and w not in self.dead]

    def _serve(self) -> None:
        head = torch.empty(HEADER, dtype=torch.int64)
        while self._serving():
            try:
                worker = self._channels.requests.recv(head)  # from any worker
                self._handle(worker, *(int(v) for v in head))
            except CommError as e:
                self._lost(e)

    def _handle(self, worker: int, kind: int, clock: int, version_read: int) -> None:
        if kind == PUSH:
            grad = torch.empty(self.shard.numel, dtype=self.param.dtype)
            self._channels.requests.recv(grad, worker)
            self.push(worker, clock, version_read, grad)
        elif kind == PULL:
            with self._cond:
                self._pulls.append((worker, clock))
                self._changed()
        elif kind == DONE:
            self.finish(worker)
        else:
            raise CommError(f"[rank {self.rank}] ParameterServer: bad message {kind}")

    def _lost(self, error: CommError) -> None:
        """A receive failed: the workers found dead are lost; if none was (the requests
        communicator itself failed), every worker still served is."""
        serving = self._serving()
        dead = [w for w in self._channels.requests.dead_peers() if w in serving] or serving
        for worker in dead:
            self.finish(
                worker,
                error=f"[rank {self.rank}] ParameterServer.serve: worker rank {worker} "
                f"failed: {error}",
            )

    def join(self, timeout: Optional[float] = None) -> None:
        """Waits for the loop (every remote worker done or lost) and the replies it sent."""
        if self._thread is not None:
            self._thread.join(timeout)
        for work in self._replies:
            try:
                work.wait()
            except CommError:
                pass  # a reply to a worker that died: it is in self.dead already
