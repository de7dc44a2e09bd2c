"""ProcessMesh: the world split into data-parallel and pipeline-parallel sub-communicators.

Ranks are laid out stage-major, ``rank = pp_rank * dp + dp_rank``::

    dp=2, pp=2          dp_rank 0   dp_rank 1
        pp_rank 0 (stage 0)   0           1        <- a data-parallel group: ranks {0, 1}
        pp_rank 1 (stage 1)   2           3
                              ^ a pipeline: ranks {0, 2}

so a pipeline's neighbours are ``dp`` ranks apart and each stage's replicas are consecutive.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional


def _resolve_sizes(dp: Optional[int], pp: Optional[int], world_size: int):
    for arg, value in (("dp", dp), ("pp", pp)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(f"{arg} must be an int or None, got {type(value).__name__}")
        if value is not None and value < 1:
            raise ValueError(f"{arg} must be >= 1, got {value}")
    if dp is None and pp is None:
        dp, pp = world_size, 1
    elif dp is None:
        if world_size % pp:
            raise ValueError(f"world_size({world_size}) is not a multiple of pp({pp})")
        dp = world_size // pp
    elif pp is None:
        if world_size % dp:
            raise ValueError(f"world_size({world_size}) is not a multiple of dp({dp})")
        pp = world_size // dp
    if dp * pp != world_size:
        raise ValueError(f"dp({dp}) x pp({pp}) != world_size({world_size})")
    return dp, pp


def mesh_groups(dp: int, pp: int) -> tuple:
    """``(dp_groups, pp_groups)``: the ranks of every data-parallel and pipeline group."""
    dp_groups = [[s * dp + d for d in range(dp)] for s in range(pp)]
    pp_groups = [[s * dp + d for s in range(pp)] for d in range(dp)]
    return dp_groups, pp_groups


class ProcessMesh:
    """Data-parallel x pipeline-parallel layout of the default process group.

    Args:
        dp: data-parallel replicas; None = world_size / pp.
        pp: pipeline stages (ranks per pipeline); None = world_size / dp.
        communicator_factory: builds a communicator from a ``torch.distributed`` group
            (default ``dk.Communicator(group=...)``).

    Attributes: ``dp``, ``pp``, ``rank``, ``world_size``, ``dp_rank``, ``pp_rank``,
    ``dp_ranks`` / ``pp_ranks`` (global ranks of this rank's groups), ``dp_comm``, ``pp_comm``.
    Every rank must build the mesh (group creation is collective).
    """

    def __init__(
        self,
        dp: Optional[int] = None,
        pp: Optional[int] = None,
        *,
        communicator_factory: Optional[Callable[[Any], Any]] = None,
    ) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("ProcessMesh needs torch.distributed.init_process_group() first")
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.dp, self.pp = _resolve_sizes(dp, pp, self.world_size)
        self.pp_rank, self.dp_rank = divmod(self.rank, self.dp)
        if communicator_factory is None:
            from .comm import Communicator

            communicator_factory = lambda group: Communicator(group=group)  # noqa: E731
        dp_groups, pp_groups = mesh_groups(self.dp, self.pp)
        self.dp_ranks: List[int] = dp_groups[self.pp_rank]
        self.pp_ranks: List[int] = pp_groups[self.dp_rank]
        self.dp_comm = communicator_factory(self._new_groups(dp_groups, self.dp_ranks))
        self.pp_comm = communicator_factory(self._new_groups(pp_groups, self.pp_ranks))

    @staticmethod
    def _new_groups(all_groups: List[List[int]], mine: List[int]):
        import torch.distributed as dist

        # new_group is collective over the world: every rank creates every group, in order.
        created = [dist.new_group(ranks) for ranks in all_groups]
        return created[all_groups.index(mine)]

    def close(self) -> None:
        """Closes both sub-communicators."""
        for comm in (self.dp_comm, self.pp_comm):
            close = getattr(comm, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> ProcessMesh:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ProcessMesh(dp={self.dp}, pp={self.pp}, rank={self.rank}, "
            f"dp_rank={self.dp_rank}, pp_rank={self.pp_rank})"
        )
