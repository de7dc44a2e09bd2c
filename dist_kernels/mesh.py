"""ProcessMesh: the world split into data-, tensor- and pipeline-parallel sub-communicators.

Tensor-parallel ranks are adjacent (they exchange the most, every layer: consecutive ranks,
which launchers such as torchrun place on one host), then pipeline stages, then data-parallel
replicas::

    rank = (dp_rank * pp + pp_rank) * tp + tp_rank

    dp=2, tp=2, pp=2 (8 ranks)
                    replica 0 (dp_rank 0)       replica 1 (dp_rank 1)
                    tp_rank 0   tp_rank 1       tp_rank 0   tp_rank 1
        stage 0         0           1               4           5
        stage 1         2           3               6           7

    tp groups {0,1} {2,3} {4,5} {6,7}     (one stage of one replica, split by tensor)
    pp groups {0,2} {1,3} {4,6} {5,7}     (one pipeline: same replica, same tp_rank)
    dp groups {0,4} {1,5} {2,6} {3,7}     (same stage, same tp_rank: the same shard of weights)

With ``tp=1`` (the default) this is the data x pipeline mesh, ``rank = dp_rank * pp + pp_rank``.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional

_AXES = ("dp", "tp", "pp")


def _check_size(arg: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise TypeError(f"{arg} must be an int or None, got {type(value).__name__}")
    if value is not None and value < 1:
        raise ValueError(f"{arg} must be >= 1, got {value}")


def _resolve_sizes(dp: Optional[int], pp: Optional[int], world_size: int, tp: int = 1):
    """``(dp, pp)``: the one left None is world_size / (the others); errors show the sums."""
    for arg, value in (("dp", dp), ("pp", pp), ("tp", tp)):
        _check_size(arg, value)
    tp_text = f" x tp({tp})" if tp != 1 else ""
    if dp is None and pp is None:
        if world_size % tp:
            raise ValueError(f"world_size({world_size}) is not a multiple of tp({tp})")
        pp = 1
    if dp is None or pp is None:
        known, name = (pp, "pp") if dp is None else (dp, "dp")
        if world_size % (known * tp):
            raise ValueError(
                f"world_size({world_size}) is not a multiple of {name}({known}){tp_text}"
            )
        other = world_size // (known * tp)
        dp, pp = (other, pp) if dp is None else (dp, other)
    if dp * tp * pp != world_size:
        raise ValueError(f"dp({dp}){tp_text} x pp({pp}) != world_size({world_size})")
    return dp, pp


def mesh_rank(dp_rank: int, tp_rank: int, pp_rank: int, tp: int, pp: int) -> int:
    """The global rank at mesh coordinates ``(dp_rank, tp_rank, pp_rank)``."""
    return (dp_rank * pp + pp_rank) * tp + tp_rank


def mesh_coords(rank: int, tp: int, pp: int) -> Dict[str, int]:
    """``{"dp": dp_rank, "tp": tp_rank, "pp": pp_rank}`` of a global rank."""
    rest, tp_rank = divmod(rank, tp)
    dp_rank, pp_rank = divmod(rest, pp)
    return {"dp": dp_rank, "tp": tp_rank, "pp": pp_rank}


def mesh_groups(dp: int, pp: int, tp: int = 1) -> Dict[str, List[List[int]]]:
    """``{"dp": [...], "tp": [...], "pp": [...]}``: the ranks of every group along each axis.

    A group along one axis holds the ranks whose other two coordinates are equal; groups are
    listed in order of their lowest rank.
    """
    sizes = {"dp": dp, "tp": tp, "pp": pp}
    groups: Dict[str, List[List[int]]] = {}
    for axis in _AXES:
        by_rest: Dict[tuple, List[int]] = {}
        for rank in range(dp * tp * pp):
            coords = mesh_coords(rank, tp, pp)
            rest = tuple(coords[a] for a in _AXES if a != axis)
            by_rest.setdefault(rest, []).append(rank)
        groups[axis] = sorted(by_rest.values())
        assert all(len(g) == sizes[axis] for g in groups[axis])
    return groups


def groups_across_hosts(groups: List[List[int]], hosts: List[str]) -> List[List[int]]:
    """The groups whose ranks sit on more than one host (``hosts[r]``: rank r's host)."""
    return [g for g in groups if len({hosts[r] for r in g}) > 1]


def _warn_if_across_hosts(groups: List[List[int]], what: str) -> None:
    """Warns, naming them, when groups of ``what`` span hosts (their every layer's collective
    would cross the network). Collective: every rank tells its host."""
    import torch.distributed as dist

    from .comm.host_layout import host_id

    hosts: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host_id())
    spanning = groups_across_hosts(groups, hosts)
    if spanning:
        where = "; ".join(f"{g} on {sorted({hosts[r] for r in g})}" for g in spanning)
        warnings.warn(
            f"ProcessMesh: {what} groups span hosts ({where}): their collectives cross the "
            "network on every layer. Keep them on one host: a tp size that divides the ranks "
            "per host (torchrun --nproc-per-node) puts each group on one.",
            stacklevel=3,
        )


class ProcessMesh:
    """Data x tensor x pipeline layout of the default process group (drawn above).

    Args:
        dp: data-parallel replicas; None = world_size / (tp x pp).
        pp: pipeline stages (ranks per pipeline); None = world_size / (dp x tp).
        tp: tensor-parallel ranks per stage (keyword only, default 1, so the older
            ``ProcessMesh(dp, pp)`` positional form keeps its meaning).
        communicator_factory: builds a communicator from a ``torch.distributed`` group
            (default ``dk.Communicator(group=...)``).

    Attributes: ``dp``, ``tp``, ``pp``, ``rank``, ``world_size``, ``dp_rank``, ``tp_rank``,
    ``pp_rank``, ``dp_ranks`` / ``tp_ranks`` / ``pp_ranks`` (global ranks of this rank's
    groups), ``dp_comm``, ``tp_comm``, ``pp_comm``. Every rank must build the mesh (group
    creation is collective). Errors show the arithmetic: ``dp(2) x tp(2) x pp(3) !=
    world_size(8)``.
    """

    def __init__(
        self,
        dp: Optional[int] = None,
        pp: Optional[int] = None,
        *,
        tp: int = 1,
        communicator_factory: Optional[Callable[[Any], Any]] = None,
    ) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("ProcessMesh needs torch.distributed.init_process_group() first")
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        _check_size("tp", tp)
        self.tp = tp
        self.dp, self.pp = _resolve_sizes(dp, pp, self.world_size, tp)
        coords = mesh_coords(self.rank, self.tp, self.pp)
        self.dp_rank, self.tp_rank, self.pp_rank = coords["dp"], coords["tp"], coords["pp"]
        if communicator_factory is None:
            from .comm import Communicator

            communicator_factory = lambda group: Communicator(group=group)  # noqa: E731
        groups = mesh_groups(self.dp, self.pp, self.tp)
        if self.tp > 1:
            _warn_if_across_hosts(groups["tp"], "tensor-parallel")
        for axis in ("tp", "pp", "dp"):  # the same order on every rank: creation is collective
            mine = next(g for g in groups[axis] if self.rank in g)
            setattr(self, f"{axis}_ranks", mine)
            setattr(
                self, f"{axis}_comm", communicator_factory(self._new_groups(groups[axis], mine))
            )

    @staticmethod
    def _new_groups(all_groups: List[List[int]], mine: List[int]):
        import torch.distributed as dist

        # new_group is collective over the world: every rank creates every group, in order.
        created = [dist.new_group(ranks) for ranks in all_groups]
        return created[all_groups.index(mine)]

    def close(self) -> None:
        """Closes the three sub-communicators."""
        for comm in (self.tp_comm, self.pp_comm, self.dp_comm):
            close = getattr(comm, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> ProcessMesh:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ProcessMesh(dp={self.dp}, tp={self.tp}, pp={self.pp}, rank={self.rank}, "
            f"dp_rank={self.dp_rank}, tp_rank={self.tp_rank}, pp_rank={self.pp_rank})"
        )
