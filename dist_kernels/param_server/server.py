"""The server side: one shard of the parameters, its optimizer, and the consistency rule.

State changes happen under one condition variable: pushes from remote workers (one thread
each, blocked on that worker's channel) and from a worker sharing this rank (a direct call)
take the same path. Every applied push and every answered pull is logged, so that staleness
can be measured (and asserted) after the run.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..errors import CommError
from .channel import DONE, HEADER, PULL, PUSH, PairChannel, header
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
        self._threads: List[threading.Thread] = []
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
            self._cond.notify_all()

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

    def pull(self, worker: int, clock: int) -> tuple:
        """Waits until ``worker`` at ``clock`` may read; returns (version, a copy of the shard)."""
        with self._cond:
            self._cond.wait_for(lambda: self.consistency.may_answer(clock, self._slowest_clock()))
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

    def finish(self, worker: int, error: Optional[str] = None) -> None:
        with self._cond:
            if error is None:
                self.finished.add(worker)
            else:
                self.dead[worker] = error
                self.log.append({"event": "dead", "worker": worker, "error": error})
            if self.consistency.mode == "sync":
                self._maybe_apply_round()  # the round no longer waits for this worker
            self._cond.notify_all()

    # -- remote workers --------------------------------------------------------------------

    def serve(self, channels: Dict[int, PairChannel]) -> None:
        """Starts one thread per remote worker."""
        for worker, channel in sorted(channels.items()):
            thread = threading.Thread(
                target=self._serve_worker,
                args=(worker, channel),
                name=f"dk-ps-server{self.rank}-worker{worker}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)

    def _serve_worker(self, worker: int, channel: PairChannel) -> None:
        head = torch.empty(HEADER, dtype=torch.int64)
        try:
            while True:
                channel.recv(head, "serve")
                kind, clock, version_read = (int(v) for v in head)
                if kind == PUSH:
                    grad = torch.empty(self.shard.numel, dtype=self.param.dtype)
                    channel.recv(grad, "serve")
                    self.push(worker, clock, version_read, grad)
                elif kind == PULL:
                    version, values = self.pull(worker, clock)
                    channel.send(header(version, 0, 0), "serve")
                    channel.send(values, "serve")
                elif kind == DONE:
                    self.finish(worker)
                    return
                else:
                    raise CommError(f"[rank {self.rank}] ParameterServer: bad message {kind}")
        except CommError as e:
            self.finish(worker, error=str(e))

    def join(self, timeout: Optional[float] = None) -> None:
        for thread in self._threads:
            thread.join(timeout)
