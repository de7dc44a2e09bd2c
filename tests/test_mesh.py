"""ProcessMesh: the rank layout on paper against an independent numpy reshape of the world, for
many sizes; errors that show the arithmetic; the cross-host warning; and on 4 CPU ranks, the
sub-communicators hold the ranks the plan says (dp x cp and ep carved from dp)."""

import itertools
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mp_pool import run_ranks

import dist_kernels as dk
from dist_kernels.mesh import (
    GROUP_KINDS,
    INTRA_HOST_KINDS,
    _resolve_sizes,
    cross_host_warning,
    groups_across_hosts,
    mesh_coords,
    mesh_groups,
    mesh_rank,
)

# (dp, pp, tp, cp, ep): every combination of small sizes up to 48 ranks, ep dividing dp
SIZES = [
    (dp, pp, tp, cp, ep)
    for dp, pp, tp, cp, ep in itertools.product(
        (1, 2, 3, 4, 6), (1, 2, 3), (1, 2, 4), (1, 2, 3), (1, 2, 3)
    )
    if dp % ep == 0 and dp * pp * tp * cp <= 48
]
# The reference: the world as an array indexed [expert_dp, pp, ep, cp, tp] (outermost first).
_AXIS = {"expert_dp": 0, "pp": 1, "ep": 2, "cp": 3, "tp": 4}


def _reference_groups(dp, pp, tp, cp, ep, kind):
    """The groups of ``kind`` by moving its varying axes last in a reshaped arange."""
    world = np.arange(dp * pp * tp * cp).reshape(dp // ep, pp, ep, cp, tp)
    varying = [_AXIS[a] for a in sorted(GROUP_KINDS[kind], key=lambda a: _AXIS[a])]
    fixed = [i for i in range(5) if i not in varying]
    size = int(np.prod([world.shape[i] for i in varying]))
    return sorted(world.transpose(fixed + varying).reshape(-1, size).tolist())


@pytest.mark.parametrize("dp, pp, tp, cp, ep", SIZES)
def test_groups_equal_a_reshape_of_the_world(dp, pp, tp, cp, ep):
    groups = mesh_groups(dp, pp, tp, cp=cp, ep=ep)
    for kind in GROUP_KINDS:
        assert groups[kind] == _reference_groups(dp, pp, tp, cp, ep, kind), kind
    sizes = {"tp": tp, "cp": cp, "ep": ep, "pp": pp, "dp": dp}
    sizes.update(expert_dp=dp // ep, dp_cp=dp * cp)
    for kind, size in sizes.items():
        assert all(len(g) == size for g in groups[kind]), kind


@pytest.mark.parametrize("dp, pp, tp, cp, ep", SIZES)
def test_coords_round_trip_and_index_in_group(dp, pp, tp, cp, ep):
    groups = mesh_groups(dp, pp, tp, cp=cp, ep=ep)
    for rank in range(dp * pp * tp * cp):
        c = mesh_coords(rank, tp, pp, cp=cp, ep=ep)
        assert mesh_rank(c["dp"], c["tp"], c["pp"], tp, pp, cp_rank=c["cp"], cp=cp, ep=ep) == rank
        # a rank's index in its group is its coordinate along that axis
        c["dp_cp"] = c["dp"] * cp + c["cp"]
        for kind in GROUP_KINDS:
            mine = next(g for g in groups[kind] if rank in g)
            assert mine.index(rank) == c[kind], (rank, kind)


@pytest.mark.parametrize("dp, pp, tp, cp, ep", SIZES)
def test_tp_cp_ep_groups_lie_in_blocks_of_consecutive_ranks(dp, pp, tp, cp, ep):
    """tp inside tp consecutive ranks, cp inside tp x cp, ep inside tp x cp x ep: a host that
    holds a multiple of that block keeps them all (checked against the warning's planner)."""
    groups = mesh_groups(dp, pp, tp, cp=cp, ep=ep)
    blocks = {"tp": tp, "cp": tp * cp, "ep": tp * cp * ep}
    world = dp * pp * tp * cp
    for kind, block in blocks.items():
        assert all(g[0] // block == g[-1] // block for g in groups[kind]), kind
    for per_host in (d for d in range(1, world + 1) if world % d == 0):
        hosts = [f"h{r // per_host}" for r in range(world)]
        spanning = groups_across_hosts(groups, hosts, INTRA_HOST_KINDS)
        expected = {
            k for k, b in blocks.items() if per_host % b and {"tp": tp, "cp": cp, "ep": ep}[k] > 1
        }
        assert set(spanning) == expected, (per_host, spanning)


def test_the_drawn_layouts():
    groups = mesh_groups(dp=2, pp=2, tp=2, cp=2)
    assert groups["tp"][:2] == [[0, 1], [2, 3]]
    assert groups["cp"][:3] == [[0, 2], [1, 3], [4, 6]]
    assert groups["pp"][:3] == [[0, 4], [1, 5], [2, 6]]
    assert groups["dp"][:3] == [[0, 8], [1, 9], [2, 10]]
    assert groups["dp_cp"][:2] == [[0, 2, 8, 10], [1, 3, 9, 11]]
    groups = mesh_groups(dp=4, pp=1, ep=2)
    assert groups["ep"] == [[0, 1], [2, 3]]
    assert groups["expert_dp"] == [[0, 2], [1, 3]]
    assert groups["dp"] == [[0, 1, 2, 3]]
    # cp = ep = 1 is the dp x tp x pp mesh as it was: rank = (dp_rank * pp + pp_rank) * tp + tp_rank
    for dp, pp, tp in [(2, 2, 2), (3, 2, 4), (1, 4, 2), (5, 3, 1)]:
        for d, p, t in itertools.product(range(dp), range(pp), range(tp)):
            assert mesh_rank(d, t, p, tp, pp) == (d * pp + p) * tp + t


def test_cross_host_warning_names_groups_and_hosts():
    groups = mesh_groups(dp=1, pp=1, tp=2, cp=2)
    hosts = ["a", "a", "b", "b"]
    spanning = groups_across_hosts(groups, hosts, INTRA_HOST_KINDS)
    assert spanning == {"cp": [[0, 2], [1, 3]]}
    text = cross_host_warning(spanning, hosts, {"tp": 2, "cp": 2, "ep": 1})
    print(text)
    assert "cp groups [[0, 2], [1, 3]] span hosts" in text
    assert "a: ranks [0, 1]; b: ranks [2, 3]" in text
    assert "tp(2) x cp(2) consecutive ranks" in text
    assert cross_host_warning({}, hosts, {"tp": 2, "cp": 2, "ep": 1}) == ""


@pytest.mark.parametrize(
    "dp, pp, world, tp, cp, message",
    [
        (2, 3, 8, 2, 1, r"dp\(2\) x tp\(2\) x pp\(3\) != world_size\(8\)"),
        (None, 3, 8, 2, 1, r"world_size\(8\) is not a multiple of pp\(3\) x tp\(2\)"),
        (2, 3, 4, 1, 1, r"dp\(2\) x pp\(3\) != world_size\(4\)"),
        (3, None, 8, 1, 1, r"world_size\(8\) is not a multiple of dp\(3\)"),
        (None, None, 6, 4, 1, r"world_size\(6\) is not a multiple of tp\(4\)$"),
        (2, 1, 8, 2, 3, r"dp\(2\) x tp\(2\) x cp\(3\) x pp\(1\) != world_size\(8\)"),
        (None, 1, 8, 1, 3, r"world_size\(8\) is not a multiple of pp\(1\) x cp\(3\)"),
        (None, None, 6, 2, 2, r"world_size\(6\) is not a multiple of tp\(2\) x cp\(2\)$"),
    ],
)
def test_errors_show_the_arithmetic(dp, pp, world, tp, cp, message):
    with pytest.raises(ValueError, match=message):
        _resolve_sizes(dp, pp, world, tp, cp)


def test_sizes_resolve():
    assert _resolve_sizes(None, None, 8, 2) == (4, 1)
    assert _resolve_sizes(2, None, 8, 2) == (2, 2)
    assert _resolve_sizes(None, 2, 8, 2) == (2, 2)
    assert _resolve_sizes(None, 4, 4) == (1, 4)
    assert _resolve_sizes(None, 1, 8, 2, 2) == (2, 1)
    with pytest.raises(ValueError, match=r"dp\(6\) is not a multiple of ep\(4\)"):
        mesh_groups(dp=6, pp=1, ep=4)
    with pytest.raises(ValueError, match="cp must be >= 1, got 0"):
        _resolve_sizes(1, 1, 1, 1, 0)


# ------------------------------------------------------------------ on 4 CPU ranks


def _members(comm):
    """The global ranks of a communicator's group, found by an all-gather over it."""
    out = torch.zeros(comm.world_size, dtype=torch.int64)
    comm.all_gather(out, torch.tensor([dist.get_rank()]))
    return out.tolist()


def _rank_meshes():
    seen = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dk.ProcessMesh(dp=2, pp=1, tp=1, cp=2) as mesh:
            seen["cp"] = (mesh.cp_rank, mesh.cp_ranks, _members(mesh.cp_comm))
            seen["dp"] = (mesh.dp_rank, mesh.dp_ranks, _members(mesh.dp_comm))
            seen["dp_cp"] = (mesh.dp_cp_rank, mesh.dp_cp_ranks, _members(mesh.dp_cp_comm))
            seen["shared"] = mesh.tp_comm is mesh.ep_comm is mesh.pp_comm
        with dk.ProcessMesh(dp=4, tp=1, pp=1, ep=2) as mesh:
            seen["ep"] = (mesh.ep_rank, mesh.ep_ranks, _members(mesh.ep_comm))
            seen["expert_dp"] = (
                mesh.expert_dp_rank,
                mesh.expert_dp_ranks,
                _members(mesh.expert_dp_comm),
            )
            seen["ep_dp"] = (mesh.dp_rank, _members(mesh.dp_comm))
        with dk.ProcessMesh(1, 4) as mesh:  # the positional form still means (dp, pp)
            seen["positional"] = (mesh.dp, mesh.pp, mesh.pp_rank, mesh.cp_comm is mesh.tp_comm)
    seen["warnings"] = [str(w.message) for w in caught if "span hosts" in str(w.message)]
    return seen


def test_mesh_communicators_hold_the_planned_ranks():
    # hosts a, b, a, b: the cp groups {0,1} {2,3} of the first mesh span hosts (warned), and so
    # do the ep groups of the second
    results = run_ranks(4, _rank_meshes, env={"DK_HOST_ID": ["a", "b", "a", "b"]}, timeout=180)
    for rank, seen in enumerate(results):
        cp_group = [rank - rank % 2, rank - rank % 2 + 1]
        assert seen["cp"] == (rank % 2, cp_group, cp_group)
        assert seen["dp"] == (rank // 2, [rank % 2, rank % 2 + 2], [rank % 2, rank % 2 + 2])
        assert seen["dp_cp"] == (rank, [0, 1, 2, 3], [0, 1, 2, 3])
        assert seen["shared"]
        assert seen["ep"] == (rank % 2, cp_group, cp_group)
        expert_dp = [rank % 2, rank % 2 + 2]
        assert seen["expert_dp"] == (rank // 2, expert_dp, expert_dp)
        assert seen["ep_dp"] == (rank, [0, 1, 2, 3])
        assert seen["positional"] == (1, 4, rank, True)
        assert len(seen["warnings"]) == 2, seen["warnings"]
        assert seen["warnings"][0].startswith(
            f"[rank {rank}] ProcessMesh: cp groups [[0, 1], [2, 3]]"
        )
        assert "ep groups [[0, 1], [2, 3]] span hosts" in seen["warnings"][1]
