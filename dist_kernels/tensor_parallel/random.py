"""Random numbers under tensor parallelism: one stream per tp rank inside tp regions.

Two kinds of randomness meet in a tensor-parallel model:

* on replicated tensors (the hidden state between blocks without sequence parallelism, the
  initialisation of replicated parameters) every tp rank must draw the **same** numbers, or
  the replicas drift apart: that is torch's default generator, seeded the same on every rank;
* on sharded tensors (attention heads, a sequence shard, sharded weights at initialisation)
  each tp rank must draw **different** numbers, as one process would for different elements:
  that is the tracker's ``"tensor-parallel"`` stream, seeded ``seed + 2718 + tp_rank``.

    tp.model_parallel_seed(1234, mesh.tp_comm)      # on every rank
    with tp.get_rng_tracker().fork():               # per-tp-rank stream
        y = F.dropout(x_shard, 0.1)

``fork()`` swaps the stream into torch's default CPU generator (and the current CUDA device's,
once CUDA is initialised) and swaps it back out afterwards, so ordinary torch ops draw from it.
Before ``model_parallel_seed`` is called the tracker is empty and ``fork()`` is a no-op (an
unsharded model draws everything from the default generator).
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Tuple

import torch

__all__ = [
    "RNGStatesTracker",
    "get_rng_tracker",
    "model_parallel_seed",
    "TENSOR_PARALLEL_RNG",
]

TENSOR_PARALLEL_RNG = "tensor-parallel"
_OFFSET = 2718  # keeps the tp streams away from the default stream's seed

_State = Tuple[torch.Tensor, Any]


def _get_state() -> _State:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_state(state: _State) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(cuda)


class RNGStatesTracker:
    """Named generator states, swapped into torch's default generators by :meth:`fork`."""

    def __init__(self) -> None:
        self.states: Dict[str, _State] = {}

    def reset(self) -> None:
        self.states = {}

    def add(self, name: str, seed: int) -> None:
        """Adds a stream seeded with ``seed`` (the default generators are left unchanged)."""
        if name in self.states:
            raise ValueError(f"RNGStatesTracker: stream {name!r} exists already")
        saved = _get_state()
        torch.manual_seed(seed)
        self.states[name] = _get_state()
        _set_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL_RNG) -> Iterator[None]:
        """Draws from stream ``name`` inside the block (no-op if the stream was never added)."""
        if name not in self.states:
            yield
            return
        saved = _get_state()
        _set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state()
            _set_state(saved)

    def get_states(self) -> Dict[str, _State]:
        """A copy of every stream's state (for checkpoints)."""
        return dict(self.states)

    def set_states(self, states: Dict[str, _State]) -> None:
        self.states = dict(states)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (one per process, like torch's default generator)."""
    return _TRACKER


def model_parallel_seed(seed: int, comm: Any) -> None:
    """Seeds the default generator with ``seed`` (the same on every rank) and the per-tp-rank
    stream with ``seed + 2718 + tp_rank``."""
    tp_rank = 0 if comm is None else comm.rank
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(TENSOR_PARALLEL_RNG, seed + _OFFSET + tp_rank)
