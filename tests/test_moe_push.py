"""The one-copy row exchange (dist_kernels/moe/push.py) against references built from torch
ops on every rank's inputs (each rank regenerates every rank's tensors from the seed):
plain all-to-all layouts and the MoE dispatch layout, gradients against a float64 reference,
the slab pool's lifetimes, bad input; and Communicator.empty_symmetric itself."""

import pytest
import torch
from mp_pool import run_ranks

import dist_kernels as dk
from dist_kernels.moe import MoE, shard_experts
from dist_kernels.moe import push as P

SEED = 20261204


def _rows_matrix(n, seed, zero_rank=None):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 5, (n, n), generator=g)
    if zero_rank is not None:  # this rank sends nothing and receives nothing
        rows[zero_rank, :] = 0
        rows[:, zero_rank] = 0
    return rows.tolist()


def _inputs(rows, rank, d, seed, dtype):
    """Rank ``rank``'s x (with spare rows) and an index with repeats into it."""
    g = torch.Generator().manual_seed(seed + rank)
    sent = sum(rows[rank])
    x = torch.randn(sent + 3, d, generator=g, dtype=dtype)
    index = torch.randint(0, sent + 3, (sent,), generator=g)
    return x, index


def _rank_blocks(d, seed, zero_rank):
    comm = dk.Communicator()
    n, me = comm.world_size, comm.rank
    rows = _rows_matrix(n, seed, zero_rank)
    plan = P.RowPlan.blocks(rows)
    inputs = [_inputs(rows, r, d, seed, torch.float64) for r in range(n)]
    x, index = inputs[me]
    x = x.clone().requires_grad_()
    got = P.push_rows(x, index, comm, plan)
    # Reference: all_to_all_single's layout, block by source rank.
    blocks = []
    for src in range(n):
        xs, ixs = inputs[src]
        start = sum(rows[src][:me])
        blocks.append(xs[ixs[start : start + rows[src][me]]])
    want = torch.cat(blocks) if blocks else torch.zeros(0, d, dtype=torch.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.equal(got.detach(), want)
    # Gradient: d/dx of sum(got * w), w drawn per receiving rank; a row sent k times gets k.
    ws = [
        torch.randn(
            sum(rows[s][r] for s in range(n)),
            d,
            dtype=torch.float64,
            generator=torch.Generator().manual_seed(seed + 1000 + r),
        )
        for r in range(n)
    ]
    (got * ws[me]).sum().backward()
    want_grad = torch.zeros_like(x)
    for dst in range(n):
        start = sum(rows[s][dst] for s in range(me))  # dst receives by source rank
        w_block = ws[dst][start : start + rows[me][dst]]
        mine = index[sum(rows[me][:dst]) : sum(rows[me][: dst + 1])]
        want_grad.index_add_(0, mine, w_block)
    err = float((x.grad - want_grad).abs().max()) if x.numel() else 0.0
    # The round trip without an index: pushes rows back where they came from.
    back = P.push_rows(got.detach(), None, comm, plan.transposed())
    assert torch.equal(back, x.detach()[index])
    comm.close()
    return err


@pytest.mark.parametrize("n, zero_rank", [(2, None), (3, 1), (4, None), (4, 0)])
def test_push_rows_is_an_all_to_all_and_its_gradient(n, zero_rank):
    print("seed", SEED + n)
    for err in run_ranks(n, _rank_blocks, 5, SEED + n, zero_rank):
        assert err <= 1e-12


def _rank_dispatch_layout(num_local, seed):
    comm = dk.Communicator()
    n, me = comm.world_size, comm.rank
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 4, (n, n * num_local), generator=g).tolist()
    plan = P.RowPlan.moe_dispatch(counts, num_local)
    xs = [
        torch.randn(sum(counts[r]), 3, generator=torch.Generator().manual_seed(seed + r))
        for r in range(n)
    ]
    got = P.push_rows(xs[me], None, comm, plan)
    # Reference: rank src's rows are sorted by expert; here they arrive grouped by local
    # expert, then by source rank.
    parts = []
    for le in range(num_local):
        e = me * num_local + le
        for src in range(n):
            start = sum(counts[src][:e])
            parts.append(xs[src][start : start + counts[src][e]])
    want = torch.cat(parts)
    ok = torch.equal(got, want)
    comm.close()
    return ok


@pytest.mark.parametrize("n, num_local", [(2, 4), (4, 2)])
def test_dispatch_plan_groups_rows_by_local_expert_then_source(n, num_local):
    print("seed", SEED)
    assert all(run_ranks(n, _rank_dispatch_layout, num_local, SEED))


def _rank_slab_lifetimes():
    comm = dk.Communicator()
    n, me = comm.world_size, comm.rank
    plan = P.RowPlan.blocks([[8] * n for _ in range(n)])
    x1 = torch.full((8 * n, 4), float(me + 1))
    kept = P.push_rows(x1, None, comm, plan)
    pool = P._pools[comm]
    slabs_after_first = len(pool.slabs)
    x2 = torch.full((8 * n, 4), float(me + 100))
    second = P.push_rows(x2, None, comm, plan)  # must not land in `kept`'s slab
    kept_intact = all(bool((kept[8 * s : 8 * s + 8] == s + 1).all()) for s in range(n)) and bool(
        (second[:8] == 100).all()
    )
    view = kept[2:5]  # a view keeps the slab busy too
    del kept, second
    third = P.push_rows(x2, None, comm, plan)
    view_intact = bool((view == 1.0).all())  # rows 2-4 came from rank 0's x1
    del view, third
    for _ in range(5):  # everything freed: no more growth
        P.push_rows(x2, None, comm, plan)
    result = (slabs_after_first, len(pool.slabs), kept_intact, view_intact, sum(pool.busy))
    comm.close()
    return result


def test_a_result_keeps_its_slab_until_its_last_view_dies():
    for first, last, kept_intact, view_intact, busy in run_ranks(2, _rank_slab_lifetimes):
        assert kept_intact and view_intact
        # kept's slab, then second's; third reuses second's while the view holds kept's
        assert first == 1 and last == 2, (first, last)
        assert busy == 0


def _rank_bad_index():
    comm = dk.Communicator()
    plan = P.RowPlan.blocks([[2, 2], [2, 2]])
    try:
        P.push_rows(torch.zeros(5, 3), None, comm, plan)
    except ValueError as e:
        return str(e)
    finally:
        comm.close()
    return "no error"


def test_wrong_row_count_raises_naming_the_rank():
    for rank, msg in enumerate(run_ranks(2, _rank_bad_index)):
        assert f"[rank {rank}] push_rows: the plan sends 4 rows from this rank, x has 5" in msg


def _rank_disagreeing_plans():
    comm = dk.Communicator()
    rows = [[2, 2], [2, 2]] if comm.rank == 0 else [[2, 2], [2, 3]]
    plan = P.RowPlan.blocks(rows)
    try:
        P.push_rows(torch.zeros(plan.send_rows[comm.rank], 3), None, comm, plan)
        message = "no error"
    except ValueError as e:
        message = str(e)
    # the communicator and the pool go on: the next push with one plan works
    plan = P.RowPlan.blocks([[2, 2], [2, 2]])
    back = P.push_rows(torch.full((4, 3), float(comm.rank)), None, comm, plan)
    ok = back[:2].eq(0).all().item() and back[2:].eq(1).all().item()
    comm.close()
    return message, ok


def test_ranks_with_different_plans_raise_before_any_write():
    for rank, (message, ok) in enumerate(run_ranks(2, _rank_disagreeing_plans)):
        assert f"[rank {rank}] push_rows: the ranks passed different plans" in message
        assert "ranks [0] / [1]" in message
        assert ok


def _rank_symmetric():
    comm = dk.Communicator()
    n, me = comm.world_size, comm.rank
    bufs = comm.empty_symmetric((n, 2), torch.float32)
    mine = bufs[me]
    for r in range(n):
        bufs[r][me] = torch.tensor([me, r], dtype=torch.float32)  # into rank r's memory
    comm.barrier()
    got = mine.tolist()
    try:
        comm.empty_symmetric((-1,), torch.float32)
        bad = "no error"
    except ValueError as e:
        bad = str(e)
    comm.close()
    return got, bad


def test_empty_symmetric_writes_land_in_the_peer():
    for me, (got, bad) in enumerate(run_ranks(3, _rank_symmetric)):
        assert got == [[float(s), float(me)] for s in range(3)]
        assert f"[rank {me}] empty_symmetric: negative dimension" in bad


class _NoSymmetric:
    """The same communicator without empty_symmetric: the layer's all-to-all path."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        if name == "empty_symmetric":
            raise AttributeError(name)
        return getattr(self._comm, name)


def _rank_layer_paths(seed):
    comm = dk.Communicator()
    torch.manual_seed(seed)
    dense = MoE(8, 12, 8, 2, None).double()
    x = torch.randn(
        20, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + comm.rank)
    )
    results = []
    for c in (comm, _NoSymmetric(comm)):
        moe = shard_experts(dense, c)
        xi = x.clone().requires_grad_()
        y = moe(xi)
        (y.square().sum() + moe.aux_loss).backward()
        grads = [xi.grad] + [p.grad for p in moe.parameters()]
        results.append([y.detach()] + grads)
    used_push = comm in P._pools
    err = max(float((a - b).abs().max()) for a, b in zip(*results))
    comm.close()
    return used_push, err


def test_layer_push_path_equals_its_all_to_all_path():
    print("seed", SEED)
    for used_push, err in run_ranks(2, _rank_layer_paths, SEED):
        assert used_push
        assert err <= 1e-12
