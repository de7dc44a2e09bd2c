"""ProcessMesh: the world split into data-, pipeline-, tensor-, context- and expert-parallel
sub-communicators.

The axes that talk most sit innermost, on consecutive ranks (which launchers such as torchrun
place on one host): tensor-parallel ranks (every layer), then context-parallel ranks (a ring
of key/value blocks every attention layer), then expert-parallel ranks (an all-to-all every
MoE layer), then pipeline stages, then the data-parallel replicas of an expert shard::

    rank = (((expert_dp_rank * pp + pp_rank) * ep + ep_rank) * cp + cp_rank) * tp + tp_rank
    dp_rank = expert_dp_rank * ep + ep_rank           (ep is carved out of dp)

    dp=2, pp=2, tp=2, cp=2 (16 ranks; ep=1)
                      replica 0 (dp_rank 0)           replica 1 (dp_rank 1)
                      cp_rank 0       cp_rank 1       cp_rank 0       cp_rank 1
                      tp 0   tp 1     tp 0   tp 1     tp 0   tp 1     tp 0   tp 1
        stage 0        0      1        2      3        8      9       10     11
        stage 1        4      5        6      7       12     13       14     15

    tp groups    {0,1} {2,3} ... {14,15}      one stage of one replica's sequence shard
    cp groups    {0,2} {1,3} {4,6} ...        one stage of one replica, split by sequence
    pp groups    {0,4} {1,5} {2,6} ...        one pipeline: same replica, cp_rank, tp_rank
    dp groups    {0,8} {1,9} {2,10} ...       same stage, cp_rank, tp_rank: same weights, same
                                              sequence shard of other samples
    dp_cp groups {0,2,8,10} {1,3,9,11} ...    dp x cp: every rank that holds the same weight
                                              shard (parameters' gradients are averaged here)

    dp=4, ep=2, pp=1, tp=1 (4 ranks): experts sharded over ep, replicated over dp / ep
                      expert_dp_rank 0        expert_dp_rank 1
                      ep 0      ep 1          ep 0      ep 1
        rank           0         1             2         3
    ep groups        {0,1} {2,3}       the all-to-all of tokens to experts
    expert_dp groups {0,2} {1,3}       the replicas of one expert shard (its gradients)
    dp groups        {0,1,2,3}         the dense (non-expert) parameters' replicas

With every size but dp and pp at 1 (the defaults) this is the data x pipeline mesh,
``rank = dp_rank * pp + pp_rank``; with cp = ep = 1 it is the dp x tp x pp mesh as before. An
axis whose groups equal another's (every size-1 axis; ``expert_dp`` and ``dp_cp`` when ep or cp
is 1) shares that axis's communicator. The layout is a pure function of the rank: when the
launcher does not put consecutive ranks on one host, the mesh warns, naming the tp, cp or ep
groups that span hosts (their traffic then crosses the network).
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

#: Mesh coordinates from the innermost (consecutive ranks) to the outermost.
COORDS = ("tp", "cp", "ep", "pp", "expert_dp")
#: Each group kind: the coordinates that vary inside one group (the others are shared).
GROUP_KINDS: Dict[str, Tuple[str, ...]] = {
    "tp": ("tp",),
    "cp": ("cp",),
    "ep": ("ep",),
    "pp": ("pp",),
    "dp": ("ep", "expert_dp"),
    "expert_dp": ("expert_dp",),
    "dp_cp": ("cp", "ep", "expert_dp"),
}
#: Group kinds that carry traffic every layer: they should stay inside a host.
INTRA_HOST_KINDS = ("tp", "cp", "ep")

_mesh_counter = itertools.count()  # meshes are built in the same order on every rank


def _check_size(arg: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise TypeError(f"{arg} must be an int or None, got {type(value).__name__}")
    if value is not None and value < 1:
        raise ValueError(f"{arg} must be >= 1, got {value}")


def _resolve_sizes(
    dp: Optional[int], pp: Optional[int], world_size: int, tp: int = 1, cp: int = 1
) -> Tuple[int, int]:
    """``(dp, pp)``: the one left None is world_size / (the others); errors show the sums."""
    for arg, value in (("dp", dp), ("pp", pp), ("tp", tp), ("cp", cp)):
        _check_size(arg, value)
    inner = tp * cp
    inner_text = "".join(f" x {n}({v})" for n, v in (("tp", tp), ("cp", cp)) if v != 1)
    if dp is None and pp is None:
        if world_size % inner:
            raise ValueError(f"world_size({world_size}) is not a multiple of {inner_text[3:]}")
        pp = 1
    if dp is None or pp is None:
        known, name = (pp, "pp") if dp is None else (dp, "dp")
        if world_size % (known * inner):
            raise ValueError(
                f"world_size({world_size}) is not a multiple of {name}({known}){inner_text}"
            )
        other = world_size // (known * inner)
        dp, pp = (other, pp) if dp is None else (dp, other)
    if dp * inner * pp != world_size:
        raise ValueError(f"dp({dp}){inner_text} x pp({pp}) != world_size({world_size})")
    return dp, pp


def _check_ep(dp: int, ep: int) -> None:
    _check_size("ep", ep)
    if dp % ep:
        raise ValueError(
            f"dp({dp}) is not a multiple of ep({ep}): expert parallelism is carved out of "
            f"data parallelism (dp = ep x {dp / ep:g} replicas of each expert shard)"
        )


def mesh_rank(
    dp_rank: int,
    tp_rank: int,
    pp_rank: int,
    tp: int,
    pp: int,
    *,
    cp_rank: int = 0,
    cp: int = 1,
    ep: int = 1,
) -> int:
    """The global rank at mesh coordinates ``(dp_rank, tp_rank, pp_rank, cp_rank)``."""
    expert_dp_rank, ep_rank = divmod(dp_rank, ep)
    return (((expert_dp_rank * pp + pp_rank) * ep + ep_rank) * cp + cp_rank) * tp + tp_rank


def mesh_coords(rank: int, tp: int, pp: int, *, cp: int = 1, ep: int = 1) -> Dict[str, int]:
    """The coordinates of a global rank: ``tp``, ``cp``, ``ep``, ``pp``, ``expert_dp`` and
    ``dp`` (= ``expert_dp * ep + ep``), each the rank's index along that axis."""
    coords: Dict[str, int] = {}
    rest = rank
    for axis, size in (("tp", tp), ("cp", cp), ("ep", ep), ("pp", pp)):
        rest, coords[axis] = divmod(rest, size)
    coords["expert_dp"] = rest
    coords["dp"] = rest * ep + coords["ep"]
    return coords


def mesh_groups(
    dp: int, pp: int, tp: int = 1, *, cp: int = 1, ep: int = 1
) -> Dict[str, List[List[int]]]:
    """The ranks of every group of each kind in :data:`GROUP_KINDS` (``"tp"``, ``"cp"``,
    ``"ep"``, ``"pp"``, ``"dp"``, ``"expert_dp"``, ``"dp_cp"``).

    A group holds the ranks whose coordinates outside its kind's varying ones are equal, in
    rank order (so a rank's index in its group is its coordinate along the axis); groups are
    listed in order of their lowest rank.
    """
    _check_ep(dp, ep)
    world_size = dp * pp * tp * cp
    coords = [mesh_coords(r, tp, pp, cp=cp, ep=ep) for r in range(world_size)]
    groups: Dict[str, List[List[int]]] = {}
    for kind, varying in GROUP_KINDS.items():
        by_rest: Dict[tuple, List[int]] = {}
        for rank, c in enumerate(coords):
            rest = tuple(c[a] for a in COORDS if a not in varying)
            by_rest.setdefault(rest, []).append(rank)
        groups[kind] = sorted(by_rest.values())
    return groups


def groups_across_hosts(
    groups: Dict[str, List[List[int]]], hosts: Sequence[str], kinds: Sequence[str]
) -> Dict[str, List[List[int]]]:
    """The groups of each of ``kinds`` whose ranks are on more than one host (``hosts[r]`` is
    rank r's host); kinds with none are left out."""
    spanning = {}
    for kind in kinds:
        across = [g for g in groups[kind] if len({hosts[r] for r in g}) > 1]
        if across:
            spanning[kind] = across
    return spanning


def _hosts_text(hosts: Sequence[str]) -> str:
    by_host: Dict[str, List[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    return "; ".join(f"{host}: ranks {ranks}" for host, ranks in by_host.items())


def cross_host_warning(
    spanning: Dict[str, List[List[int]]], hosts: Sequence[str], sizes: Dict[str, int]
) -> str:
    """The text of the warning for groups that span hosts (empty when there are none)."""
    if not spanning:
        return ""
    listed = "; ".join(
        f"{kind} groups {groups[:4]}{' ...' if len(groups) > 4 else ''} span hosts"
        for kind, groups in spanning.items()
    )
    inner = " x ".join(f"{k}({sizes[k]})" for k in INTRA_HOST_KINDS if sizes[k] > 1)
    return (
        f"ProcessMesh: {listed} ({_hosts_text(hosts)}): their traffic crosses the network "
        f"every layer. The mesh puts {inner} consecutive ranks together: launch so that each "
        "host holds a multiple of that many consecutive ranks."
    )


class ProcessMesh:
    """Data x pipeline x tensor x context x expert layout of the default process group (drawn
    above).

    Args:
        dp: data-parallel replicas (ep included); None = world_size / (pp x tp x cp).
        pp: pipeline stages (ranks per pipeline); None = world_size / (dp x tp x cp).
        tp: tensor-parallel ranks per stage (keyword only, default 1, so the older
            ``ProcessMesh(dp, pp)`` positional form keeps its meaning).
        cp: context-parallel ranks (each holds ``seq / cp`` of every sequence).
        ep: expert-parallel ranks, carved out of dp: experts sharded over ep and replicated
            over ``dp / ep``; ``dp % ep == 0``.
        communicator_factory: builds a communicator from a ``torch.distributed`` group
            (default ``dk.Communicator(group=...)``).

    Attributes: the sizes ``dp``, ``pp``, ``tp``, ``cp``, ``ep``; ``rank``, ``world_size``;
    for each group kind ``K`` of ``tp``, ``cp``, ``ep``, ``pp``, ``dp``, ``expert_dp`` (the
    dp / ep replicas of this rank's expert shard) and ``dp_cp`` (dp x cp: where dense
    parameters' gradients are averaged under context parallelism): ``K_rank`` (this rank's
    index in its group), ``K_ranks`` (the group's global ranks) and ``K_comm``. Every rank must
    build the mesh (group creation is collective). Errors show the arithmetic: ``dp(2) x tp(2)
    x pp(3) != world_size(8)``.
    """

    def __init__(
        self,
        dp: Optional[int] = None,
        pp: Optional[int] = None,
        *,
        tp: int = 1,
        cp: int = 1,
        ep: int = 1,
        communicator_factory: Optional[Callable[[Any], Any]] = None,
    ) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("ProcessMesh needs torch.distributed.init_process_group() first")
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.dp, self.pp = _resolve_sizes(dp, pp, self.world_size, tp, cp)
        _check_ep(self.dp, ep)
        self.tp, self.cp, self.ep = tp, cp, ep
        groups = mesh_groups(self.dp, self.pp, tp, cp=cp, ep=ep)
        self._warn_across_hosts(groups)
        if communicator_factory is None:
            from .comm import Communicator

            communicator_factory = lambda group: Communicator(group=group)  # noqa: E731
        self._comms: List[Any] = []
        built: Dict[Tuple[Tuple[int, ...], ...], Any] = {}
        for kind in GROUP_KINDS:  # the same order on every rank: creation is collective
            mine = next(g for g in groups[kind] if self.rank in g)
            key = tuple(map(tuple, groups[kind]))
            if key not in built:  # an axis with the same groups as an earlier one shares its comm
                built[key] = communicator_factory(self._new_groups(groups[kind], mine))
                self._comms.append(built[key])
            setattr(self, f"{kind}_ranks", mine)
            setattr(self, f"{kind}_rank", mine.index(self.rank))
            setattr(self, f"{kind}_comm", built[key])

    @staticmethod
    def _new_groups(all_groups: List[List[int]], mine: List[int]):
        import torch.distributed as dist

        # new_group is collective over the world: every rank creates every group, in order.
        created = [dist.new_group(ranks) for ranks in all_groups]
        return created[all_groups.index(mine)]

    def _warn_across_hosts(self, groups: Dict[str, List[List[int]]]) -> None:
        sizes = {"tp": self.tp, "cp": self.cp, "ep": self.ep}
        if all(sizes[k] == 1 for k in INTRA_HOST_KINDS):
            return
        hosts = _gather_hosts(self.rank, self.world_size)
        text = cross_host_warning(
            groups_across_hosts(groups, hosts, INTRA_HOST_KINDS), hosts, sizes
        )
        if text:
            warnings.warn(f"[rank {self.rank}] {text}", stacklevel=3)

    def close(self) -> None:
        """Closes the sub-communicators (each once, shared ones included)."""
        for comm in self._comms:
            close = getattr(comm, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> ProcessMesh:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        sizes = f"dp={self.dp}, pp={self.pp}, tp={self.tp}, cp={self.cp}, ep={self.ep}"
        coords = ", ".join(f"{k}_rank={getattr(self, k + '_rank')}" for k in ("dp", "pp", "tp"))
        extra = "".join(f", {k}_rank={getattr(self, k + '_rank')}" for k in ("cp", "ep"))
        return f"ProcessMesh({sizes}, rank={self.rank}, {coords}{extra})"


def _gather_hosts(rank: int, world_size: int) -> List[str]:
    """Every rank's host (``DK_HOST_ID`` or the hostname, as the Communicator reads it),
    exchanged through the default group's store under a key of this mesh's own."""
    import torch.distributed as dist

    from .comm.communicator import _host_id
    from .comm.shm import wait_keys

    base = dist.distributed_c10d._get_default_store()
    store = dist.PrefixStore(f"dk/mesh/{next(_mesh_counter)}/", base)
    store.set(f"host/{rank}", _host_id())
    wait_keys(store, [f"host/{r}" for r in range(world_size)], base.timeout)
    return [store.get(f"host/{r}").decode() for r in range(world_size)]
