"""What ``Pipeline.profile()`` measures: per-action times for the simulator, per stage.

Each rank times its own actions (:class:`ActionTimer`) while it runs real steps, then the
pipeline agrees on one table (:func:`gather_times`, a sum all-reduce: every stage is timed by
exactly one rank). The result is the simulator's input (``dk.pipeline.simulate(...,
**profile)``), in seconds:

* ``F``, ``B``, ``W``, ``BW``: the mean time of a forward, an input-gradient half (action
  ``I``), a weight-gradient half and a full backward of each stage, whichever its schedule runs
  (so simulate a schedule with a profile of the same kind: split or not). A compute action's
  time excludes the receives it waited in.
* ``send``: the mean time a send takes its thread (packing the message and the ``isend``
  call); ``recv``: the fastest receive seen (one whose message was already there), both
  averaged over the ranks that send or receive.
* ``step``: what a step costs outside the schedule's actions, once per step: splitting the
  batch and waiting for the last sends (the mean per rank, the largest over the ranks), and
  the loss broadcast: the mean time it takes the rank that reaches it last (the shortest over
  the ranks; the others' include waiting for that rank's last action), plus (added by
  ``Pipeline.profile``) one ``p2p`` and one ``recv`` for it to reach the others.
* ``p2p``: half the median round trip of a message of the size of rank 0's first activation
  between ranks 0 and 1 (0 on one rank): from the end of one side's send call to the other
  side holding the bytes.

On a shared machine the steps of one profile see one moment's load; :func:`average_profiles`
combines profiles taken at several moments (one step each, say, between the steps a benchmark
times), so that the prediction and the measured steps see the same noise.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from .actions import Action, Kind

__all__ = ["ActionTimer", "average_profiles", "gather_times", "measure_p2p"]

# How one action's samples become its time: the mean, since a step's time is a sum of its
# actions' (with waits), and what sums is the mean; a median misses the tail that steps pay
# (preemption, page faults, a cold cache).
_AVERAGE = statistics.fmean

_COMPUTE_KEY = {
    Kind.FORWARD: "F",
    Kind.BACKWARD_INPUT: "B",
    Kind.BACKWARD_WEIGHT: "W",
    Kind.BACKWARD: "BW",
}
KEYS = ("F", "B", "W", "BW")


class ActionTimer:
    """Durations of one rank's actions; a receive run inside a compute step is not counted
    in the step's time."""

    def __init__(self) -> None:
        self.compute: Dict[Tuple[str, int], List[float]] = defaultdict(list)
        self.sends: List[float] = []
        self.receives: List[float] = []
        self._nested = [0.0]  # per open compute step: seconds spent in its receives
        # per step: (splitting the batch + waiting for the sends, the loss broadcast), seconds
        self.step_costs: List[Tuple[float, float]] = []

    def run(self, action: Action, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        if action.kind.is_compute:
            self._nested.append(0.0)
        try:
            return fn()
        finally:
            spent = time.perf_counter() - start
            if action.kind.is_compute:
                waited = self._nested.pop()
                self.compute[(_COMPUTE_KEY[action.kind], action.stage)].append(spent - waited)
            elif action.kind.is_send:
                self.sends.append(spent)
            else:
                self.receives.append(spent)
                self._nested[-1] += spent


def gather_times(timer: ActionTimer, n_stages: int, comm: Any) -> Dict[str, Any]:
    """The pipeline's table (module docstring): means per stage, summed over the ranks."""
    table = torch.zeros(len(KEYS) + 2, n_stages, dtype=torch.float64)
    for (key, stage), seconds in timer.compute.items():
        table[KEYS.index(key), stage] = _AVERAGE(seconds)
    counts = torch.zeros(2, dtype=torch.float64)  # ranks that sent, and that received
    if timer.sends:
        table[len(KEYS), 0] = _AVERAGE(timer.sends)
        counts[0] = 1
    if timer.receives:
        table[len(KEYS) + 1, 0] = min(timer.receives)
        counts[1] = 1
    step = torch.zeros(comm.world_size, 2, dtype=torch.float64)  # per rank: its step costs
    if timer.step_costs:
        step[comm.rank] = torch.tensor([_AVERAGE(c) for c in zip(*timer.step_costs)])
    if comm.world_size > 1:
        comm.all_reduce(table)
        comm.all_reduce(counts)
        comm.all_reduce(step)
    times: Dict[str, Any] = {}
    for i, key in enumerate(KEYS):
        if table[i].any():
            times[key] = table[i].tolist()
    times["send"] = table[len(KEYS), 0].item() / max(counts[0].item(), 1.0)
    times["recv"] = table[len(KEYS) + 1, 0].item() / max(counts[1].item(), 1.0)
    # The loss broadcast as the rank that reached it last saw it: the others' durations also
    # hold their wait for that rank (the root of 1F1B waited 1.3 ms for rank 0's last backward
    # in every step), which the simulator's timeline already has.
    times["step"] = step[:, 0].max().item() + step[:, 1].min().item()
    return times


def average_profiles(profiles: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One profile from several of the same pipeline, each ``{"times": ..., "p2p": ...}`` as
    ``Pipeline.profile()`` returns it: every time the mean over the profiles (per stage for the
    compute keys: profiles of equally many steps hold equally many samples, so this is the mean
    of all samples), except ``recv``, the fastest receive seen (the least), and ``p2p``, a
    median already (the median)."""
    if not profiles:
        raise ValueError("average_profiles needs at least one profile")
    times: Dict[str, Any] = {}
    for key in profiles[0]["times"]:
        values = [p["times"][key] for p in profiles]
        if key == "recv":
            times[key] = min(values)
        elif isinstance(values[0], list):
            times[key] = [_AVERAGE(per_stage) for per_stage in zip(*values)]
        else:
            times[key] = _AVERAGE(values)
    return {"times": times, "p2p": statistics.median(p["p2p"] for p in profiles)}


def measure_p2p(comm: Any, nbytes: int, rounds: int = 20) -> float:
    """Half the median round trip between ranks 0 and 1 of rank 0's ``nbytes``, on every
    rank (collective on ``comm``)."""
    if comm.world_size == 1:
        return 0.0
    size = torch.tensor([nbytes], dtype=torch.int64)
    comm.broadcast(size, 0)
    result = torch.zeros(1, dtype=torch.float64)
    if comm.rank in (0, 1):
        result[0] = _ping_pong(comm, max(int(size.item()), 1), rounds)
    comm.broadcast(result, 0)
    return result.item()


def _ping_pong(comm: Any, nbytes: int, rounds: int) -> float:
    message = torch.zeros(nbytes, dtype=torch.uint8)
    peer = 1 - comm.rank
    trips = []
    for _ in range(rounds + 2):  # the first two warm the path up
        start = time.perf_counter()
        if comm.rank == 0:
            comm.send(message, peer)
            comm.recv(message, peer)
        else:
            comm.recv(message, peer)
            comm.send(message, peer)
        trips.append(time.perf_counter() - start)
    return statistics.median(trips[2:]) / 2
