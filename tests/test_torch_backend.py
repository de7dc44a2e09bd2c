"""The "dk" torch.distributed backend against torch: every collective against a reference,
torch DDP against torch DDP over gloo, FSDP2 and DTensor against single-process runs,
functional collectives eager and compiled, errors, and the world-group path.

The shared pool's workers already have a gloo default group, so most tests make a dk group
with ``new_group(backend="dk")`` beside it (torch's own path for every non-default group; the
world group's path is tested in fresh processes by ``test_init_process_group_dk_world``).
Inputs are generated from the same seed on every rank, so each rank computes the reference
itself (float64, or exact int64 wrapped to the dtype; see test_comm.py).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
import time
import zlib

import pytest
import torch
from mp_pool import RankDied, run_ranks, shm_leaks
from test_comm import UNIT_ROUNDOFF, check_close, error_bound, make_input, reference

import dist_kernels  # noqa: F401 - registers "dk" (the workers import this module too)

SEED = 1616
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.int8,
    torch.uint8,
]
# torch's ReduceOp name -> the name test_comm's reference uses
OPS = {"SUM": "SUM", "AVG": "AVG", "PRODUCT": "PROD", "MIN": "MIN", "MAX": "MAX"}
PREMUL = 0.75

_GROUPS = {}


def _dk_group():
    """This worker's dk group over every rank (made once per pool, in the same order)."""
    import torch.distributed as dist

    n = dist.get_world_size()
    if n not in _GROUPS:
        _GROUPS[n] = dist.new_group(backend="dk")
    return _GROUPS[n]


def _torch_op(name, dtype):
    import torch.distributed as dist

    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(PREMUL)
    return getattr(dist.ReduceOp, name)


def _op_cases(dtype):
    """(torch op name, reference op name, scale applied to every input)."""
    cases = [(name, ref, 1.0) for name, ref in OPS.items()]
    if dtype.is_floating_point:
        cases.append(("PREMUL_SUM", "SUM", PREMUL))
    return cases


def _inputs(n, count, dtype, op, tag, scale=1.0):
    xs = [make_input(r, count, dtype, op, tag) for r in range(n)]
    return xs, [x.double() * scale if scale != 1.0 else x for x in xs]


# -- every collective x dtype x op -----------------------------------------------------------


def _bound(scaled, dtype, op, scale):
    """The reduction's rounding bound; PREMUL_SUM (``scale != 1``) also rounds each rank's
    pre-multiplied input to the dtype once: at most ``u`` of each term, ``u * sum |x_r|``."""
    if not dtype.is_floating_point:
        return None  # integers compare exactly
    bound = error_bound(scaled, dtype, op)
    if scale != 1.0:
        u = UNIT_ROUNDOFF[dtype] + (2.0**-24 if dtype.itemsize == 2 else 0.0)
        bound = bound + u * torch.stack([x.double().abs() for x in scaled]).sum(0)
    return bound


def _reductions(group, dtype, count):
    """all_reduce (sync and async + future), coalesced, reduce, reduce_scatter (both forms)."""
    import torch.distributed as dist

    rank, n = dist.get_rank(group), dist.get_world_size(group)
    for name, ref_op, scale in _op_cases(dtype):
        op = _torch_op(name, dtype)
        xs, scaled = _inputs(n, count, dtype, ref_op, f"ar{name}", scale)
        ref, bound = reference(scaled, dtype, ref_op), _bound(scaled, dtype, ref_op, scale)
        what = f"rank {rank}/{n} {dtype} {name}"
        t = xs[rank].clone()
        dist.all_reduce(t, op=op, group=group)
        check_close(t, ref, dtype, ref_op, f"all_reduce {what}", bound)
        t = xs[rank].clone()
        future = dist.all_reduce(t, op=op, group=group, async_op=True).get_future()
        check_close(future.wait()[0], ref, dtype, ref_op, f"all_reduce async {what}", bound)
        pair = [xs[rank].clone(), xs[rank][: count // 2].clone()]
        dist.all_reduce_coalesced(pair, op=op, group=group)
        check_close(pair[0], ref, dtype, ref_op, f"all_reduce_coalesced {what}", bound)
        half = slice(0, count // 2)
        half_bound = None if bound is None else bound[half]
        check_close(pair[1], ref[half], dtype, ref_op, f"coalesced[1] {what}", half_bound)
        t = xs[rank].clone()
        dist.reduce(t, dst=dist.get_global_rank(group, n - 1), op=op, group=group)
        if rank == n - 1:
            check_close(t, ref, dtype, ref_op, f"reduce {what}", bound)
        else:
            assert torch.equal(t, xs[rank]), f"reduce changed a non-root tensor: {what}"
        ys, yscaled = _inputs(n, n * count, dtype, ref_op, f"rs{name}", scale)
        mine = slice(rank * count, (rank + 1) * count)
        chunk = reference(yscaled, dtype, ref_op)[mine]
        chunk_bound = _bound(yscaled, dtype, ref_op, scale)
        chunk_bound = None if chunk_bound is None else chunk_bound[mine]
        out = torch.empty(count, dtype=dtype)
        dist.reduce_scatter_tensor(out, ys[rank], op=op, group=group)
        check_close(out, chunk, dtype, ref_op, f"reduce_scatter_tensor {what}", chunk_bound)
        out = torch.empty(count, dtype=dtype)
        dist.reduce_scatter(out, list(ys[rank].chunk(n)), op=op, group=group)
        check_close(out, chunk, dtype, ref_op, f"reduce_scatter {what}", chunk_bound)


def _data_movement(group, dtype, count):
    """all_gather (both forms), broadcast, gather, scatter, all_to_all (three forms), p2p."""
    import torch.distributed as dist

    rank, n = dist.get_rank(group), dist.get_world_size(group)
    root = n - 1
    groot = dist.get_global_rank(group, root)
    xs = [make_input(r, count, dtype, "SUM", "ag") for r in range(n)]
    what = f"rank {rank}/{n} {dtype}"
    outs = [torch.empty(count, dtype=dtype) for _ in range(n)]
    dist.all_gather(outs, xs[rank], group=group)
    assert all(torch.equal(o, x) for o, x in zip(outs, xs)), f"all_gather {what}"
    flat = torch.empty(n * count, dtype=dtype)
    dist.all_gather_into_tensor(flat, xs[rank], group=group)
    assert torch.equal(flat, torch.cat(xs)), f"all_gather_into_tensor {what}"
    t = xs[rank].clone()
    dist.broadcast(t, src=groot, group=group)
    assert torch.equal(t, xs[root]), f"broadcast {what}"
    gathered = [torch.empty(count, dtype=dtype) for _ in range(n)] if rank == root else None
    dist.gather(xs[rank], gathered, dst=groot, group=group)
    if rank == root:
        assert all(torch.equal(g, x) for g, x in zip(gathered, xs)), f"gather {what}"
    pieces = [make_input(r, count, dtype, "SUM", "sc") for r in range(n)]
    t = torch.empty(count, dtype=dtype)
    dist.scatter(t, pieces if rank == root else None, src=groot, group=group)
    assert torch.equal(t, pieces[rank]), f"scatter {what}"
    _all_to_all(group, dtype, count, what)
    # a ring of isend / irecv in one batch
    t = torch.empty(count, dtype=dtype)
    if n > 1:
        ops = [
            dist.P2POp(dist.isend, xs[rank], dist.get_global_rank(group, (rank + 1) % n), group),
            dist.P2POp(dist.irecv, t, dist.get_global_rank(group, (rank - 1) % n), group),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        assert torch.equal(t, xs[(rank - 1) % n]), f"batch_isend_irecv {what}"


def _block(src, dst, dtype, rows, tag):
    """What rank src sends rank dst: ``rows[src][dst]`` rows of 3, the same on every rank."""
    return make_input(src * 97 + dst, rows[src][dst] * 3, dtype, "SUM", tag).view(-1, 3)


def _all_to_all(group, dtype, count, what):
    import torch.distributed as dist

    rank, n = dist.get_rank(group), dist.get_world_size(group)
    # even: every rank sends `count` rows of 3 to every rank
    even = [[count] * n for _ in range(n)]
    # uneven: rows (src + 2 * dst) % 4, zero included
    uneven = [[(s + 2 * d) % 4 for d in range(n)] for s in range(n)]
    for rows, splits in ((even, False), (uneven, True)):
        inp = torch.cat([_block(rank, d, dtype, rows, "a2a") for d in range(n)])
        expected = torch.cat([_block(s, rank, dtype, rows, "a2a") for s in range(n)])
        out = torch.empty_like(expected)
        dist.all_to_all_single(
            out,
            inp,
            [rows[s][rank] for s in range(n)] if splits else None,
            rows[rank] if splits else None,
            group=group,
        )
        assert torch.equal(out, expected), f"all_to_all_single splits={splits} {what}"
    ins = [_block(rank, d, dtype, uneven, "l") for d in range(n)]
    outs = [torch.empty_like(_block(s, rank, dtype, uneven, "l")) for s in range(n)]
    dist.all_to_all(outs, ins, group=group)
    for s in range(n):
        assert torch.equal(outs[s], _block(s, rank, dtype, uneven, "l")), f"all_to_all {what}"


def _collective_matrix(counts):
    import torch.distributed as dist

    group = _dk_group()
    for dtype in DTYPES:
        for count in counts:
            _reductions(group, dtype, count)
            _data_movement(group, dtype, count)
    # dtypes we do not reduce still move as bytes
    for dtype in (torch.bool, torch.complex64):
        t = (torch.arange(6) % 2 == 1).to(dtype) * (dist.get_rank() + 1)
        outs = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(outs, t, group=group)
        expected = [(torch.arange(6) % 2 == 1).to(dtype) * (r + 1) for r in range(len(outs))]
        assert all(torch.equal(o, e) for o, e in zip(outs, expected)), dtype
    dist.barrier(group=group)
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_collectives_match_torch_reference(world_size):
    print(f"seed {SEED}")
    # 13: a prime below one slice; 2**17 + 5 float32 elements cross slots and chunks
    counts = (13,) if world_size >= 3 else (13, 2**17 + 5)
    assert run_ranks(world_size, _collective_matrix, counts, timeout=300) == [True] * world_size


def test_reference_check_rejects_wrong_answers():
    """The checks above fail on a doubled result and on a result that misses a rank."""
    xs = [make_input(r, 13, torch.float32, "SUM", "arSUM") for r in range(3)]
    ref = reference(xs, torch.float32, "SUM")
    bound = error_bound(xs, torch.float32, "SUM")
    check_close(ref.float(), ref, torch.float32, "SUM", "right", bound)
    for wrong in (ref.float() * 2, (xs[0] + xs[1]).float()):
        with pytest.raises(AssertionError):
            check_close(wrong, ref, torch.float32, "SUM", "wrong", bound)


# -- the hot paths (process_group.py: allreduce, all_gather_single and broadcast skip the routed
# code) ---


def _hot_paths():
    """The plain synchronous calls take the hot path, every other form the routed one, and
    both give torch's results and a usable Work."""
    import torch.distributed as dist

    group = _dk_group()
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    dist.all_reduce(torch.zeros(1), group=group)  # a group's first call resolves its routes
    routed = []
    routed_names = ("_allreduce", "_all_gather_single", "_broadcast")
    for name in routed_names:  # count calls of the routed versions
        impl = getattr(group, name)
        setattr(group, name, lambda *a, _impl=impl, _name=name: routed.append(_name) or _impl(*a))
    try:
        print(f"hot paths: seed tag hot, rank {rank}/{n}")
        xs = [make_input(r, 37, torch.float32, "SUM", "hot") for r in range(n)]
        ref = reference(xs, torch.float32, "SUM")
        bound = error_bound(xs, torch.float32, "SUM")
        t = xs[rank].clone()
        dist.all_reduce(t, group=group)
        check_close(t, ref, torch.float32, "SUM", f"hot all_reduce rank {rank}", bound)
        assert routed == [], f"a plain all_reduce took the routed path: {routed}"
        # what the hot path does not take: another op, a non-contiguous tensor, async
        t = xs[rank].clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        assert torch.equal(t, torch.stack(xs).max(0).values), "MAX"
        wide = torch.stack([xs[rank], xs[rank]], 1)
        dist.all_reduce(wide[:, 0], group=group)
        check_close(wide[:, 0], ref, torch.float32, "SUM", "non-contiguous", bound)
        assert torch.equal(wide[:, 1], xs[rank]), "the other column changed"
        t = xs[rank].clone()
        dist.all_reduce(t, group=group, async_op=True).wait()
        check_close(t, ref, torch.float32, "SUM", "async", bound)
        assert routed == ["_allreduce"] * 3, routed
        # a direct synchronous call's Work: completed, carrying the tensor
        opts = dist.AllreduceOptions()
        opts.asyncOp = False
        t = xs[rank].clone()
        work = group.allreduce([t], opts)
        assert work.is_completed() and work.is_success() and work.wait()
        assert work.result()[0] is t and work.get_future().value()[0] is t
        check_close(t, ref, torch.float32, "SUM", "direct allreduce", bound)
        # the hot path reuses one finished Work: each call's result and future are its own
        future = work.get_future()
        t2 = xs[rank].clone()
        work2 = group.allreduce([t2], opts)
        assert work2.is_completed() and work2.result()[0] is t2
        assert work2.get_future().value()[0] is t2 and future.value()[0] is t
        check_close(t2, ref, torch.float32, "SUM", "second direct allreduce", bound)
        # all_gather_into_tensor: the hot path, then a mismatched dtype on the routed one
        out = torch.empty(n * 37)
        dist.all_gather_into_tensor(out, xs[rank], group=group)
        assert torch.equal(out, torch.cat(xs)), "hot all_gather_into_tensor"
        assert routed == ["_allreduce"] * 3, routed
        try:
            dist.all_gather_into_tensor(out, xs[rank].double(), group=group)
        except TypeError as e:
            assert "dtype" in str(e), e
        else:
            raise AssertionError("a float64 input into a float32 output was accepted")
        assert routed[-1] == "_all_gather_single", routed
        # broadcast from the last rank: the hot path, then non-contiguous and async (routed)
        root = n - 1
        groot = dist.get_global_rank(group, root)
        t = xs[rank].clone()
        dist.broadcast(t, src=groot, group=group)
        assert torch.equal(t, xs[root]), "hot broadcast"
        assert routed[-1] == "_all_gather_single", routed
        wide = torch.stack([xs[rank], xs[rank]], 1)
        dist.broadcast(wide[:, 0], src=groot, group=group)
        assert torch.equal(wide[:, 0], xs[root]) and torch.equal(wide[:, 1], xs[rank])
        t = xs[rank].clone()
        dist.broadcast(t, src=groot, group=group, async_op=True).wait()
        assert torch.equal(t, xs[root]), "async broadcast"
        assert routed[-2:] == ["_broadcast", "_broadcast"], routed
    finally:
        for name in routed_names:
            delattr(group, name)
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_hot_paths_match_the_routed_ones(world_size):
    assert run_ranks(world_size, _hot_paths, timeout=120) == [True] * world_size


# -- bad arguments ----------------------------------------------------------------------------


def _bad_arguments():
    """Rank 0 makes every mistake; then both ranks all-reduce: had rank 0 sent anything, the
    all-reduce would mismatch or hang. Returns the messages rank 0 got."""
    import torch.distributed as dist

    group = _dk_group()
    rank, n = dist.get_rank(), dist.get_world_size()
    messages = []
    if rank == 0:
        t = torch.ones(4)
        bad = [
            lambda: dist.all_reduce(t, op=dist.ReduceOp.BAND, group=group),
            lambda: dist.all_gather_into_tensor(torch.empty(3), t, group=group),
            lambda: dist.reduce_scatter_tensor(torch.empty(3), t, group=group),
            # lists of several sizes are taken, but this rank's own entry must fit its tensor
            lambda: dist.all_gather([torch.empty(5), torch.empty(4)][:n], t, group=group),
            lambda: dist.all_to_all_single(torch.empty(4), t, [1, 3], [3, 2], group=group),
            lambda: dist.all_reduce(
                torch.ones(4, dtype=torch.int32), op=_torch_op("PREMUL_SUM", None), group=group
            ),  # noqa: E501
            lambda: group.allreduce([t, t]),
            lambda: dist.broadcast(torch.sparse_coo_tensor([[0]], [1.0], (4,)), 0, group=group),
            # the communicator underneath checks too: rank 0 would send itself 1, expect 3
            lambda: group.communicator().all_to_all(torch.empty(4), t, [1, 3], [3, 1]),
        ]
        for call in bad:
            with pytest.raises((ValueError, TypeError, NotImplementedError)) as info:
                call()
            messages.append(str(info.value))
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t, group=group)
    assert torch.equal(t, torch.full((5,), float(n * (n + 1) // 2))), t
    return messages


def test_bad_arguments_raise_before_anything_is_sent():
    messages = run_ranks(2, _bad_arguments)[0]
    print("\n".join(messages))
    assert len(messages) == 9
    assert all(m.startswith("[rank 0] dk backend: ") for m in messages[:8]), messages
    assert messages[8].startswith("[rank 0] all_to_all: send_counts[0] (1)"), messages[8]
    assert "BAND" in messages[0] and "bitwise ops take integer" in messages[0], messages[0]
    assert "output_tensor_list[0] is (5,)" in messages[3], messages[3]
    assert "all_to_all_single" in messages[4] and "split sizes" in messages[4]
    assert "broadcast: a torch.sparse_coo tensor" in messages[7] and "dense" in messages[7]


# -- errors from peers ------------------------------------------------------------------------


def _peer_failure(kind):
    """Rank 1 dies (or stays away past the group's timeout); rank 0's all-reduce raises
    DistBackendError, and with ``timeout`` a shorter ``Work.wait(timeout)`` gives up first."""
    import torch.distributed as dist

    group = dist.new_group(backend="dk", timeout=datetime.timedelta(seconds=3))
    rank = dist.get_rank()
    if rank == 1:
        if kind == "dead":
            os._exit(0)
        time.sleep(5)  # alive, but never calls: rank 0's collective runs into its timeout
        dist.destroy_process_group(group)
        return None
    try:
        if kind == "timeout":  # Work.wait(timeout) gives up first; the collective runs on
            work = dist.all_reduce(torch.ones(1 << 16), group=group, async_op=True)
            with pytest.raises(dist.DistBackendError, match=r"\[rank 0\] all_reduce"):
                work.wait(datetime.timedelta(seconds=0.2))
            assert not work.is_completed()
            work.wait()  # until the group's 3 s timeout fails it
        else:
            dist.all_reduce(torch.ones(1 << 16), group=group)
    except dist.DistBackendError as e:
        assert kind != "timeout" or work.is_completed()
        return f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group(group)
    return "no error"


@pytest.mark.parametrize("kind", ["dead", "timeout"])
def test_dead_peer_or_timeout_raises_dist_backend_error(kind):
    results = run_ranks(2, _peer_failure, kind, expect_death=kind == "dead", timeout=120)
    print(results[0])
    assert results[0].startswith("DistBackendError: [rank 0] all_reduce"), results[0]
    assert ("died" if kind == "dead" else "Timed out") in results[0], results[0]
    if kind == "dead":
        assert isinstance(results[1], RankDied)
    assert shm_leaks() == []


# -- torch's engines --------------------------------------------------------------------------


class _Net(torch.nn.Module):
    """An MLP with a branch that some steps do not use (find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.side = torch.nn.Linear(8, 4)

    def forward(self, x, use_side):
        y = self.fc2(torch.relu(self.fc1(x)))
        return y + self.side(x) if use_side else y


def _ddp_train(group, steps):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    torch.manual_seed(SEED)
    model = DDP(_Net(), process_group=group, find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(SEED + rank)
    for step in range(steps):
        x = torch.randn(6, 8, generator=gen)
        use_side = step % 3 != 2
        if step % 2 == 0:  # accumulate locally, synchronise on the next step
            with model.no_sync():
                model(x, use_side).square().mean().backward()
            continue
        model(x, use_side).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _ddp_dk_vs_gloo():
    import torch.distributed as dist

    gloo = _ddp_train(dist.group.WORLD, 6)
    dk = _ddp_train(_dk_group(), 6)
    torch.manual_seed(SEED)
    initial = list(_Net().parameters())
    moved = any(not torch.equal(a, b) for a, b in zip(dk, initial))
    return moved, all(torch.equal(a, b) for a, b in zip(gloo, dk))


def test_torch_ddp_over_dk_trains_as_over_gloo():
    results = run_ranks(2, _ddp_dk_vs_gloo, timeout=180)
    assert results == [(True, True)] * 2, results


def _sgd_steps(call, model, steps):
    """``steps`` SGD steps of ``call(x)`` (the model or its compiled form) on this rank's
    batches; the parameters after them."""
    import torch.distributed as dist

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(SEED + dist.get_rank())
    for _ in range(steps):
        call(torch.randn(6, 8, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _same_on_dk_as_gloo(train, steps):
    """``train(group, steps)`` on the gloo world group, then on a dk group: equal bitwise."""
    import torch.distributed as dist

    gloo = train(dist.group.WORLD, steps)
    dk = train(_dk_group(), steps)
    return all(torch.equal(a, b) for a, b in zip(gloo, dk))


def _compiled_ddp(group, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    torch.manual_seed(SEED)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = DDP(net, process_group=group)
    return _sgd_steps(torch.compile(model, backend="aot_eager"), model, steps)


def test_torch_compile_of_ddp_over_dk_trains_as_over_gloo():
    """torch.compile(DDP(model)): DDP's forward runs its C++ reducer eagerly around a graph
    break and the reducer broadcasts through the group; dynamo must not trace our Python group
    there (it failed with UnsafeScriptObjectError before torch_backend/dynamo.py)."""
    assert run_ranks(2, _same_on_dk_as_gloo, _compiled_ddp, 3, timeout=300) == [True, True]


def _powersgd_train(group, steps):
    """torch DDP with torch's PowerSGD hook, whose future callbacks wait for all-reduces they
    start (so a group must complete a later call while a callback blocks)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(SEED)
    model = DDP(_Net(), process_group=group, bucket_cap_mb=0.0005)  # several buckets
    state = powersgd.PowerSGDState(
        process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2
    )
    model.register_comm_hook(state, powersgd.powerSGD_hook)
    return _sgd_steps(lambda x: model(x, True), model, steps)


def test_torch_ddp_powersgd_hook_over_dk_trains_as_over_gloo():
    """Steps 0-1 all-reduce plainly, steps 2-4 compress; before the watcher pool the first
    compressed step hung (the callback waited on a future only the blocked thread completes)."""
    assert run_ranks(2, _same_on_dk_as_gloo, _powersgd_train, 5, timeout=180) == [True, True]


def _zero_overlap_vs_float64(steps):
    """torch's ZeroRedundancyOptimizer(overlap_with_ddp=True) stepping inside DDP's comm hook
    (``hook_with_zero_step``) on a dk group, against single-process SGD in float64 on both
    ranks' batches. torch refuses this on gloo ("may meet hangs", pytorch#62300): the hook's
    broadcasts are started and waited for while other buckets' all-reduces are in flight."""
    import copy

    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    group, rank, world = _dk_group(), dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Linear(32, 2)
    )
    start = [p.detach().clone() for p in net.parameters()]
    ref = copy.deepcopy(net).double()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ddp = DDP(net, process_group=group, bucket_cap_mb=0.002)  # several buckets
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(),
        optimizer_class=torch.optim.SGD,
        process_group=group,
        overlap_with_ddp=True,
        lr=0.1,
    )
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    gen = torch.Generator().manual_seed(SEED)  # every rank draws every rank's batch
    for i in range(steps):
        xs = torch.randn(world, 4, 8, generator=gen)
        ys = torch.randn(world, 4, 2, generator=gen)
        zero.zero_grad()
        torch.nn.functional.mse_loss(ddp(xs[rank]), ys[rank]).backward()  # steps in the hook
        if i >= 2:  # torch's docs: the first two iterations build the buckets, no update
            ref_opt.zero_grad()
            out = ref(xs.flatten(0, 1).double())
            torch.nn.functional.mse_loss(out, ys.flatten(0, 1).double()).backward()
            ref_opt.step()
    got = [p.detach() for p in net.parameters()]
    err = max((a.double() - b).abs().max().item() for a, b in zip(got, ref.parameters()))
    moved = max((a - b).abs().max().item() for a, b in zip(got, start))
    return err, moved


def test_zero_redundancy_optimizer_overlapped_with_ddp_on_dk_matches_float64_sgd():
    print("seed", SEED)
    results = run_ranks(2, _zero_overlap_vs_float64, 6, timeout=180)
    for err, moved in results:
        assert err < 1e-5 and moved > 1e-3, results


def _nested_futures(depth):
    """A chain of ``depth`` then() callbacks, each waiting inside for an all-reduce it starts."""
    import torch.distributed as dist

    group, rank = _dk_group(), dist.get_rank()
    seen = []

    def step(level):
        def callback(fut):
            seen.append(float(fut.value()[0][0]))
            if level == depth:
                return fut.value()
            t = torch.full((4,), float(rank + level + 1))
            inner = dist.all_reduce(t, group=group, async_op=True).get_future()
            inner.then(step(level + 1)).wait()  # blocks this watcher until the next completes
            return fut.value()

        return callback

    t = torch.full((4,), float(rank))
    dist.all_reduce(t, group=group, async_op=True).get_future().then(step(0)).wait()
    return seen


def test_future_callbacks_may_wait_for_later_calls():
    n = 2
    for depth in (1, 3):
        seen = run_ranks(n, _nested_futures, depth, timeout=120)
        # level k sums rank + k over the ranks (level 0: the ranks themselves)
        expected = [float(sum(r + k for r in range(n))) for k in range(depth + 1)]
        assert seen == [expected] * n, (depth, seen)


def _fsdp2_vs_single(steps):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    group = _dk_group()
    mesh = DeviceMesh.from_group(group, "cpu")
    assert mesh.get_group() is group and dist.get_backend(group) == "dk"
    torch.manual_seed(SEED)
    reference_model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )
    model = _copy(reference_model)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _sgd_beside_one_process(model, reference_model, steps)
    for p, ref in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p.full_tensor(), ref, rtol=1e-5, atol=1e-6)
    return True


def _copy(module):
    import copy

    return copy.deepcopy(module)


def _sgd_beside_one_process(model, reference, steps):
    """``steps`` SGD steps of ``model`` on this rank's batch, and of ``reference`` on every
    rank's batches at once: the mean a data-parallel engine's averaged gradients give."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(SEED)
    for _ in range(steps):
        batches = [torch.randn(4, 8, generator=gen) for _ in range(n)]
        for o, m, x in ((opt, model, batches[rank]), (ref_opt, reference, torch.cat(batches))):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()


def test_fsdp2_over_dk_matches_single_process():
    assert run_ranks(2, _fsdp2_vs_single, 3, timeout=180) == [True, True]


def _fsdp1_run(strategy, group, steps):
    """torch's FSDP (the first one, what accelerate's FSDP plugin wraps) over ``group``."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    torch.manual_seed(SEED)
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = FSDP(
        _copy(reference),
        process_group=group,
        sharding_strategy=getattr(ShardingStrategy, strategy),
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )
    _sgd_beside_one_process(model, reference, steps)
    with FSDP.summon_full_params(model):
        params = [p.detach().clone() for p in model.parameters()]
    return params, list(reference.parameters())


def _fsdp1_vs_gloo(strategy, steps):
    import torch.distributed as dist

    ours, reference = _fsdp1_run(strategy, _dk_group(), steps)
    gloo, _ = _fsdp1_run(strategy, dist.group.WORLD, steps)
    for p, g, ref in zip(ours, gloo, reference):
        # two addends sum alike in any order; more are summed in each backend's own order
        assert dist.get_world_size() > 2 or torch.equal(p, g), strategy
        # single process: the mean over every rank's batch (FSDP averages gradients)
        torch.testing.assert_close(p, ref.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g, ref.detach(), rtol=1e-5, atol=1e-6)
    return True


@pytest.mark.parametrize(
    "strategy,world_size",
    [("FULL_SHARD", 2), ("SHARD_GRAD_OP", 2), ("NO_SHARD", 2), ("FULL_SHARD", 4)],
)
def test_fsdp1_over_dk_equals_gloo_and_single_process(strategy, world_size):
    assert run_ranks(world_size, _fsdp1_vs_gloo, strategy, 3, timeout=180) == [True] * world_size


# torch.distributed.pipelining's schedules: name -> stage ids of rank r out of n ranks
_PIPELINING = {
    "ScheduleGPipe": lambda r, n: [r],
    "Schedule1F1B": lambda r, n: [r],
    "ScheduleInterleaved1F1B": lambda r, n: [r, r + n],
    "ScheduleLoopedBFS": lambda r, n: [r, r + n],
    "ScheduleInterleavedZeroBubble": lambda r, n: [r, r + n],
    "ScheduleZBVZeroBubble": lambda r, n: [r, 2 * n - 1 - r],  # the V: first and last stage
    "ScheduleDualPipeV": lambda r, n: [r, 2 * n - 1 - r],
}


def _pipelining_step(name, layers, group, x, y):
    """One step of torch's schedule ``name`` over ``group``: this rank's gradients and losses."""
    import torch.distributed as dist
    from torch.distributed import pipelining

    rank, n = dist.get_rank(), dist.get_world_size()
    ids = _PIPELINING[name](rank, n)
    n_stages = n * len(ids)
    per = len(layers) // n_stages
    mods = {s: _copy(torch.nn.Sequential(*layers[s * per : (s + 1) * per])) for s in ids}
    stages = [
        pipelining.PipelineStage(mods[s], s, n_stages, torch.device("cpu"), group=group)
        for s in ids
    ]
    cls = getattr(pipelining, name)
    schedule = cls(stages if len(ids) > 1 else stages[0], 8, loss_fn=torch.nn.functional.mse_loss)
    losses = []
    schedule.step(
        *((x,) if 0 in ids else ()), target=y if n_stages - 1 in ids else None, losses=losses
    )
    grads = {f"{s}.{k}": p.grad for s, m in mods.items() for k, p in m.named_parameters()}
    return grads, losses


def _torch_pipelining(name):
    """A schedule over dk against the same schedule over gloo (bitwise: the same sends, the same
    arithmetic) and against single-process autograd of the whole model (rounding)."""
    import torch.distributed as dist

    n = dist.get_world_size()
    torch.manual_seed(SEED)
    layers = [torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()) for _ in range(2 * n)]
    gen = torch.Generator().manual_seed(SEED)
    x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 6, generator=gen)
    ours = _pipelining_step(name, layers, _dk_group(), x, y)
    gloo = _pipelining_step(name, layers, dist.group.WORLD, x, y)
    assert dist.get_backend(_dk_group()) == "dk" and dist.get_backend() == "gloo"
    assert ours[0].keys() == gloo[0].keys() and ours[0]
    for key, grad in ours[0].items():
        assert torch.equal(grad, gloo[0][key]), (name, key)
    assert len(ours[1]) == len(gloo[1]) and all(map(torch.equal, ours[1], gloo[1]))
    # single process: 8 equal micro-batches, gradients averaged over them (scale_grads)
    full = _copy(torch.nn.Sequential(*layers))
    torch.nn.functional.mse_loss(full(x), y).backward()
    per = len(layers) // (n * len(_PIPELINING[name](0, n)))
    for key, grad in ours[0].items():
        stage, rest = key.split(".", 1)
        layer, param = rest.split(".", 1)
        ref = full.get_parameter(f"{int(stage) * per + int(layer)}.{param}").grad
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6)
    return len(ours[0])


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", sorted(_PIPELINING))
def test_torch_pipelining_schedules_over_dk_equal_gloo(name, world_size):
    counts = run_ranks(world_size, _torch_pipelining, name, timeout=180)
    assert all(c > 0 for c in counts)


def _dtensor_tp():
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = DeviceMesh.from_group(_dk_group(), "cpu")
    assert dist.get_backend(mesh.get_group()) == "dk"
    torch.manual_seed(SEED)
    full = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 6))
    tp = parallelize_module(_copy(full), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(SEED))
    y_full, y_tp = full(x), tp(x)
    torch.testing.assert_close(y_tp, y_full, rtol=1e-5, atol=1e-6)
    y_full.square().sum().backward()
    y_tp.square().sum().backward()
    for p, ref in zip(tp.parameters(), full.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), ref.grad, rtol=1e-5, atol=1e-5)
    # distribute_tensor / full_tensor round-trip, sharded and replicated
    big = torch.randn(6, 4, generator=torch.Generator().manual_seed(SEED + 1))
    for placement in (Shard(0), Shard(1), Replicate()):
        d = distribute_tensor(big, mesh, [placement])
        assert torch.equal(d.full_tensor(), big), placement
    shard = distribute_tensor(big, mesh, [Shard(0)]).to_local()
    assert torch.equal(shard, big.chunk(dist.get_world_size())[dist.get_rank()])
    return True


def test_dtensor_tensor_parallel_over_dk_matches_unsharded():
    assert run_ranks(2, _dtensor_tp, timeout=180) == [True, True]


def _functional(compiled):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    group = _dk_group()
    rank, n = dist.get_rank(), dist.get_world_size()

    def step(x):
        summed = fc.all_reduce(x, "sum", group)
        gathered = fc.all_gather_tensor(x * 2, 0, group)
        scattered = fc.reduce_scatter_tensor(gathered, "sum", 0, group)
        return summed + 1, gathered, scattered

    fn = torch.compile(step, backend="aot_eager", fullgraph=True) if compiled else step
    xs = [make_input(r, 2 * n * 3, torch.float32, "SUM", "fc").view(2 * n, 3) for r in range(n)]
    summed, gathered, scattered = (torch.as_tensor(t) for t in fn(xs[rank].clone()))
    total = torch.stack(xs).double().sum(0)
    # the sum's rounding bound, plus the rounding of the added 1
    bound = error_bound([x.view(-1) for x in xs], torch.float32, "SUM")
    bound = bound + (total + 1).abs().view(-1) * 2.0**-24
    check_close(summed.view(-1), (total + 1).view(-1), torch.float32, "SUM", "all_reduce", bound)
    assert torch.equal(gathered, torch.cat([x * 2 for x in xs])), "all_gather_tensor"
    rows = 2 * n * n // n
    ref = (n * torch.cat([x * 2 for x in xs]).double()).view(n, rows, 3)[rank]
    gathered_in = torch.cat([x * 2 for x in xs]).view(n, rows, 3)[rank].reshape(-1)
    bound = error_bound([gathered_in] * n, torch.float32, "SUM")
    check_close(scattered.view(-1), ref.reshape(-1), torch.float32, "SUM", "reduce_scatter", bound)
    return True


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_functional_collectives_over_dk(compiled):
    assert run_ranks(2, _functional, compiled, timeout=240) == [True, True]


# -- what gloo has and torch's own tests use ---------------------------------------------------


def _recv_any_source():
    """``dist.recv(t)`` without ``src`` returns the sender, as over gloo (each message carries
    its sender's rank); ``irecv`` without ``src`` names it through ``Work._source_rank()``."""
    import torch.distributed as dist

    group, rank, n = _dk_group(), dist.get_rank(), dist.get_world_size()
    if rank != 0:
        dist.send(torch.full((3,), float(rank)), 0, group=group)
        dist.send(torch.full((3,), float(10 * rank)), 0, group=group)
        return None
    got = []
    for k in range(2 * (n - 1)):
        t = torch.empty(3)
        if k % 2:
            work = dist.irecv(t, group=group)
            work.wait()
            source = work._source_rank()
        else:
            source = dist.recv(t, group=group)
        got.append((source, float(t[0])))
    return got


def _tagged_p2p(seed, group_name):
    """torch's send / recv / isend / irecv with tags over ``group_name``: rank 1 sends a random
    schedule (tags, sizes, dtypes), rank 0 receives it in a random order that keeps each tag's
    messages in sending order (test_comm_tags._schedule); then rank 1 isends one more tag-0
    message and both gather, and rank 0 receives that message after the gather. Returns what
    rank 0 got wrong; the same on gloo, which matches tags by definition."""
    import torch.distributed as dist
    from test_comm_tags import _index_within_tag, _payload, _schedule

    group = _dk_group() if group_name == "dk" else dist.group.WORLD
    assert dist.get_backend(group) == group_name
    rank, n = dist.get_rank(), dist.get_world_size()
    sends, order = _schedule(seed, 16)
    dtypes = [(torch.float32, torch.float64, torch.int32)[i % 3] for i in range(len(sends))]
    tags = [abs(tag) % 2**31 for tag, _ in sends]  # gloo takes nonnegative tags only
    sends = [(t, numel % 5000) for t, (_, numel) in zip(tags, sends)]
    wrong = []

    def payload(i):
        tag, numel = sends[i]
        return _payload(1, tag, _index_within_tag(sends, i), numel).to(dtypes[i])

    if rank == 1:
        works = [dist.isend(payload(i), 0, group=group, tag=sends[i][0]) for i in range(len(sends))]
        late = dist.isend(torch.full((3,), 7.0), 0, group=group, tag=0)
        for w in works:
            w.wait()
    elif rank == 0:
        for k, i in enumerate(order):
            tag, numel = sends[i]
            t = torch.empty(numel, dtype=dtypes[i])
            if k % 2:
                dist.irecv(t, 1, group=group, tag=tag).wait()
            else:
                dist.recv(t, 1, group=group, tag=tag)
            if not torch.equal(t, payload(i)):
                wrong.append((i, tag, numel))
    gathered = [torch.empty(2) for _ in range(n)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), gathered, dst=0, group=group)
    if rank == 0:
        if [g.tolist() for g in gathered] != [[float(r)] * 2 for r in range(n)]:
            wrong.append(("gather", [g.tolist() for g in gathered]))
        t = torch.empty(3)
        dist.recv(t, 1, group=group, tag=0)
        if t.tolist() != [7.0] * 3:
            wrong.append(("after gather", t.tolist()))
    elif rank == 1:
        late.wait()
    dist.barrier(group=group)
    return wrong


@pytest.mark.parametrize("backend", ["gloo", "dk"])
def test_point_to_point_tags_match_as_gloo_does(backend):
    seed = int(os.environ.get("DK_TAG_SEED", zlib.crc32(b"tags") + SEED))
    print(f"tag schedule seed {seed} (rerun with DK_TAG_SEED={seed})")
    assert run_ranks(2, _tagged_p2p, seed, backend, timeout=180) == [[], []]


def test_recv_without_src_returns_the_sender():
    got = run_ranks(3, _recv_any_source)[0]
    assert sorted(got) == [(1, 1.0), (1, 10.0), (2, 2.0), (2, 20.0)], got
    assert [v for s, v in got if s == 1] == [1.0, 10.0], got  # one sender's messages in order


def _bool_reductions():
    """Reductions of bool tensors over dk equal gloo's (the pool's default group) for every op
    gloo takes on bool, in all_reduce, reduce, reduce_scatter_tensor and the coalesced
    all-reduce; AVG raises TypeError naming the op, as torch's NCCL backend does."""
    import torch.distributed as dist

    group, rank, n = _dk_group(), dist.get_rank(), dist.get_world_size()
    seed = SEED + 17 * rank
    print(f"bool reductions: seed {seed}, rank {rank}/{n}")
    gen = torch.Generator().manual_seed(seed)
    # 5 columns: random, every rank True, every rank False, True on one rank only, random
    x = torch.rand(4 * n, 5, generator=gen) < 0.5
    x[:, 1], x[:, 2], x[:, 3] = True, False, rank == n - 1
    R = dist.ReduceOp
    for op in (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR):
        ours, theirs = x.clone(), x.clone()
        dist.all_reduce(ours, op=op, group=group)
        dist.all_reduce(theirs, op=op)
        assert ours.dtype is torch.bool and torch.equal(ours, theirs), (op, ours, theirs)
        # every byte 0 or 1: a byte of 2 reads as True here, but torch's ops on it misbehave
        # (~ gives 253, still True) and a sum of 256 of them would wrap to False
        assert int(ours.view(torch.uint8).max()) == 1, (op, ours.view(torch.uint8))
        ours, theirs = x.clone(), x.clone()
        dist.reduce(ours, dst=n - 1, op=op, group=group)
        dist.reduce(theirs, dst=n - 1, op=op)
        if rank == n - 1:
            assert torch.equal(ours, theirs), ("reduce", op)
        ours, theirs = torch.empty(4, 5, dtype=torch.bool), torch.empty(4, 5, dtype=torch.bool)
        dist.reduce_scatter_tensor(ours, x, op=op, group=group)
        rows = x.clone()
        dist.all_reduce(rows, op=op)  # gloo has no reduce_scatter: the slice of its all-reduce
        theirs = rows[4 * rank : 4 * rank + 4]
        assert torch.equal(ours, theirs), ("reduce_scatter", op)
    pieces = [x[:3].clone(), x[3:].clone()]
    dist.all_reduce_coalesced(pieces, op=R.SUM, group=group)
    expected = x.clone()
    dist.all_reduce(expected, op=R.SUM)
    assert torch.equal(torch.cat(pieces), expected)
    try:
        dist.all_reduce(x.clone(), op=R.AVG, group=group)
    except TypeError as e:
        assert "AVG" in str(e) and "bool" in str(e), e
    else:
        raise AssertionError("AVG of bools did not raise")
    dist.all_reduce(torch.ones(1), group=group)  # still in step after the refusal
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_bool_reductions_match_gloo(world_size):
    assert run_ranks(world_size, _bool_reductions, timeout=120) == [True] * world_size


def _complex_reductions():
    """Complex tensors in the reductions torch hands the backend as they are (reduce_scatter,
    reduce, the coalesced all-reduce, all-reduce through the group itself): SUM equals gloo's,
    AVG and PREMUL_SUM gloo's SUM divided and scaled (gloo has neither); MAX raises ValueError
    naming the op, as torch does for all_reduce."""
    import torch.distributed as dist
    from torch.distributed import AllreduceOptions

    group, rank, n = _dk_group(), dist.get_rank(), dist.get_world_size()
    seed = SEED + 31 * rank
    print(f"complex reductions: seed {seed}, rank {rank}/{n}")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * n, 3, dtype=torch.complex64, generator=gen)
    total = x.clone()
    dist.all_reduce(total)  # gloo: the reference sum
    R = dist.ReduceOp
    premul = dist._make_nccl_premul_sum(PREMUL)
    for op, want in ((R.SUM, total), (R.AVG, total / n), (premul, total * PREMUL)):
        out = torch.empty(2, 3, dtype=torch.complex64)
        dist.reduce_scatter_tensor(out, x, op=op, group=group)
        torch.testing.assert_close(out, want[2 * rank : 2 * rank + 2], msg=str(op))
        y = x.clone()
        dist.reduce(y, dst=0, op=op, group=group)
        if rank == 0:
            torch.testing.assert_close(y, want, msg=str(op))
        opts = AllreduceOptions()
        opts.reduceOp = op
        y = x.clone()
        group.allreduce([y], opts).wait()
        torch.testing.assert_close(y, want, msg=str(op))
    pieces = [x[:1].clone(), x[1:].clone()]
    dist.all_reduce_coalesced(pieces, group=group)
    torch.testing.assert_close(torch.cat(pieces), total)
    try:
        dist.reduce_scatter_tensor(
            torch.empty(2, 3, dtype=torch.complex64), x, op=R.MAX, group=group
        )
    except ValueError as e:
        assert "MAX" in str(e) and "complex" in str(e), e
    else:
        raise AssertionError("MAX of complex tensors did not raise")
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_complex_reductions_match_gloo(world_size):
    assert run_ranks(world_size, _complex_reductions, timeout=120) == [True] * world_size


def _bits(rank, count, dtype, tag):
    """Random bit patterns of ``dtype``, the same on every process (seeded by rank and tag)."""
    seed = zlib.crc32(repr((SEED, rank, count, str(dtype), tag)).encode())
    g = torch.Generator().manual_seed(seed)
    width = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (count * width,), generator=g, dtype=torch.uint8).view(dtype)


def _bitwise_reductions():
    """BAND, BOR and BXOR on integer tensors (and BXOR on bool) in every reduction, against
    torch's bitwise fold of all ranks' inputs, and gloo's result where gloo takes the dtype."""
    import functools

    import torch.distributed as dist

    group, gloo = _dk_group(), dist.group.WORLD
    rank, n = dist.get_rank(), dist.get_world_size()
    fns = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}
    cases = [(d, name) for d in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
             for name in fns] + [(torch.bool, "BXOR")]  # fmt: skip
    for dtype, name in cases:
        op, fn, what = getattr(dist.ReduceOp, name), fns[name], f"{name} {dtype}"
        xs = [_bits(r, 37, dtype, name) for r in range(n)]
        if dtype is torch.bool:
            xs = [x.view(torch.uint8) & 1 for x in xs]
            xs = [x.bool() for x in xs]
        want = functools.reduce(fn, xs)
        t = xs[rank].clone()
        dist.all_reduce(t, op=op, group=group)
        assert torch.equal(t, want), what
        if dtype not in (torch.int16, torch.bool):  # gloo takes these
            g = xs[rank].clone()
            dist.all_reduce(g, op=op, group=gloo)
            assert torch.equal(g, want), f"gloo {what}"
        t = xs[rank].clone()
        dist.all_reduce(t, op=op, group=group, async_op=True).wait()
        assert torch.equal(t, want), f"async {what}"
        wide = torch.zeros(37, 2, dtype=dtype)
        wide[:, 0] = xs[rank]
        dist.all_reduce(wide[:, 0], op=op, group=group)  # not contiguous
        assert torch.equal(wide[:, 0], want) and not wide[:, 1].any(), f"strided {what}"
        t = xs[rank].clone()
        dist.reduce(t, dst=n - 1, op=op, group=group)
        assert torch.equal(t, want if rank == n - 1 else xs[rank]), f"reduce {what}"
        parts = [xs[rank][:5].clone(), xs[rank][5:].clone()]
        opts = dist.AllreduceCoalescedOptions()
        opts.reduceOp = op
        group.allreduce_coalesced(parts, opts).wait()
        assert torch.equal(torch.cat(parts), want), f"coalesced {what}"
        big = [_bits(r, 3 * n, dtype, name + "rs") for r in range(n)]
        if dtype is torch.bool:
            big = [(b.view(torch.uint8) & 1).bool() for b in big]
        out = torch.empty(3, dtype=dtype)
        dist.reduce_scatter_tensor(out, big[rank], op=op, group=group)
        assert torch.equal(out, functools.reduce(fn, big).view(n, 3)[rank]), f"rs {what}"
    with pytest.raises(TypeError, match="bitwise ops take integer and bool tensors"):
        dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BOR, group=group)
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_bitwise_reductions_on_integers(world_size):
    print(f"seed {SEED}")
    assert run_ranks(world_size, _bitwise_reductions, timeout=180) == [True] * world_size


def _uneven_reduce_scatter():
    """reduce_scatter with a list of several sizes (gloo takes it): each rank's output is the
    reduction of the pieces every rank holds for it, against the float64 / exact reference,
    and against gloo where gloo takes the op."""
    import functools

    import torch.distributed as dist

    group, gloo = _dk_group(), dist.group.WORLD
    rank, n = dist.get_rank(), dist.get_world_size()
    sizes = [d + 2 for d in range(n)]  # destination d receives d + 2 elements
    for dtype, op_name in [
        (torch.float32, "SUM"),
        (torch.bfloat16, "AVG"),
        (torch.float64, "PROD"),
        (torch.int32, "MAX"),
        (torch.int8, "MIN"),
        (torch.int64, "BXOR"),
        (torch.complex64, "SUM"),
    ]:
        what = f"uneven reduce_scatter {op_name} {dtype}"
        base = torch.float32 if dtype.is_complex else dtype
        lists = [
            [make_input(r, sizes[d] * (2 if dtype.is_complex else 1), base, op_name, ("rs", d))
             for d in range(n)]
            for r in range(n)
        ]  # fmt: skip
        if dtype.is_complex:
            lists = [[torch.view_as_complex(x.view(-1, 2)) for x in row] for row in lists]
        out = torch.empty(sizes[rank], dtype=dtype)
        op = getattr(dist.ReduceOp, "PRODUCT" if op_name == "PROD" else op_name)
        dist.reduce_scatter(out, [x.clone() for x in lists[rank]], op=op, group=group)
        mine = [lists[r][rank] for r in range(n)]
        if op_name == "BXOR":
            assert torch.equal(out, functools.reduce(torch.bitwise_xor, mine)), what
        elif dtype.is_complex:
            got, parts = (
                torch.view_as_real(out).reshape(-1),
                [torch.view_as_real(x).reshape(-1) for x in mine],
            )
            check_close(
                got,
                reference(parts, base, "SUM"),
                base,
                "SUM",
                what,
                error_bound(parts, base, "SUM"),
            )
        else:
            bound = error_bound(mine, dtype, op_name) if dtype.is_floating_point else None
            check_close(out, reference(mine, dtype, op_name), dtype, op_name, what, bound)
        if dtype in (torch.int32, torch.int64, torch.int8):  # exact: gloo must agree bitwise
            g = torch.empty_like(out)
            dist.reduce_scatter(g, [x.clone() for x in lists[rank]], op=op, group=gloo)
            assert torch.equal(g, out), f"gloo {what}"
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_uneven_reduce_scatter_list(world_size):
    print(f"seed {SEED}")
    assert run_ranks(world_size, _uneven_reduce_scatter, timeout=180) == [True] * world_size


def _uneven_lists():
    """all_gather, gather and scatter with lists of several sizes (torch's NCCL backend takes
    them; gloo refuses uneven all_gather): every entry equals the tensor its rank passed,
    including an empty one, for float32 and bool; a rank whose tensor has another size than
    its peers' lists say makes every rank raise."""
    import torch.distributed as dist

    group, rank, n = _dk_group(), dist.get_rank(), dist.get_world_size()
    size = [(2 * r + 1) % 4 for r in range(n)]
    size[n - 1] = 0  # an empty entry: 1, 0 at two ranks, 1, 3, 0 at three
    for dtype in (torch.float32, torch.bool):

        def value(r, dtype=dtype):
            t = torch.arange(size[r], dtype=torch.float32) + 100 * r
            return t.to(torch.bool) if dtype is torch.bool else t

        mine = value(rank)
        outs = [torch.full((size[r],), -1.0).to(dtype) for r in range(n)]
        dist.all_gather(outs, mine, group=group)
        assert all(torch.equal(o, value(r)) for r, o in enumerate(outs)), (dtype, outs)
        got = [torch.full((size[r],), -1.0).to(dtype) for r in range(n)] if rank == 1 else None
        dist.gather(mine, got, dst=1, group=group)
        if rank == 1:
            assert all(torch.equal(o, value(r)) for r, o in enumerate(got)), (dtype, got)
        parts = [value(r) + 1 if dtype is torch.float32 else value(r) for r in range(n)]
        out = torch.full((size[rank],), -1.0).to(dtype)
        dist.scatter(out, parts if rank == 0 else None, src=0, group=group)
        assert torch.equal(out, parts[rank]), (dtype, out)
    # rank 0 sends one element more than its peers' lists expect from it: they raise naming
    # the sizes; rank 0 itself received what it expected, and its next call raises (the first
    # failure stops the communicator on every rank; a group of its own, so the pool's stays usable)
    failing = dist.new_group(backend="dk", timeout=datetime.timedelta(seconds=30))
    mine = torch.zeros(size[rank] + (1 if rank == 0 else 0))
    outs = [torch.zeros(size[r]) for r in range(n)]
    outs[rank] = torch.zeros(mine.numel())
    errors = []
    try:
        for call in (
            lambda: dist.all_gather(outs, mine, group=failing),
            lambda: dist.all_reduce(torch.ones(1), group=failing),
        ):
            try:
                call()
            except dist.DistBackendError as e:
                errors.append(str(e))
    finally:
        dist.destroy_process_group(failing)
    dist.all_reduce(torch.ones(1), group=group)  # the pool's group is unharmed
    return errors


@pytest.mark.parametrize("world_size", [2, 3])
def test_uneven_all_gather_gather_scatter(world_size):
    errors = run_ranks(world_size, _uneven_lists, timeout=120)
    assert all(errors), errors  # every rank raised
    peers = [e[0] for e in errors[1:]]
    assert all("rank 0 sent 8 bytes where" in e and "expected 4" in e for e in peers), errors


def _random_sparse(rank, shape, sparse_dim, nnz, tag):
    """A sparse COO tensor with repeated indices (uncoalesced, as nn.Embedding's gradients)."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((SEED, rank, shape, tag)).encode()))
    idx = torch.stack([torch.randint(0, s, (nnz,), generator=g) for s in shape[:sparse_dim]])
    val = torch.randn(nnz, *shape[sparse_dim:], generator=g)
    return torch.sparse_coo_tensor(idx, val, shape)


def _sparse_all_reduce():
    """Sparse COO all_reduce (SUM): the union of every rank's entries, duplicates summed,
    against the float64 sum of the dense forms; the same bits on every rank (the digest) and,
    at 2 ranks, gloo's bits; a rank without entries; AVG and mismatched shapes refused on
    every rank, after which the group still works."""
    import torch.distributed as dist

    group, rank, n = _dk_group(), dist.get_rank(), dist.get_world_size()
    digests = []
    for shape, sparse_dim in (((10, 3), 1), ((6, 5), 2), ((7,), 1)):
        inputs = [_random_sparse(r, shape, sparse_dim, 0 if r == 1 else 9, "s") for r in range(n)]
        t = inputs[rank].clone()
        dist.all_reduce(t, group=group)
        assert t.is_sparse and t.is_coalesced(), shape
        got = t.to_dense()
        dense = [x.to_dense().double() for x in inputs]
        ref = torch.stack(dense).sum(0)
        terms = sum(int(x._nnz()) for x in inputs)  # each entry's sum has at most this many
        size = torch.stack([x.coalesce().to_dense().double().abs() for x in inputs]).sum(0)
        bound = terms * 2.0**-24 * (size + ref.abs()) + 1e-30
        assert bool(((got.double() - ref).abs() <= bound).all()), shape
        digests.append(got.numpy().tobytes())
        if n == 2:
            g = inputs[rank].clone()
            dist.all_reduce(g, group=dist.group.WORLD)
            assert torch.equal(g.to_dense(), got), f"gloo {shape}"
    with pytest.raises(ValueError, match="sparse tensors reduce with SUM only"):
        dist.all_reduce(_random_sparse(rank, (4,), 1, 2, "a"), op=dist.ReduceOp.AVG, group=group)
    with pytest.raises(ValueError, match="differ in shape"):
        dist.all_reduce(_random_sparse(rank, (4 + rank,), 1, 2, "b"), group=group)
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, group=group)
    assert torch.equal(t, torch.full((3,), float(n * (n + 1) // 2)))
    return digests


@pytest.mark.parametrize("world_size", [2, 3])
def test_sparse_all_reduce(world_size):
    print(f"seed {SEED}")
    digests = run_ranks(world_size, _sparse_all_reduce, timeout=180)
    assert all(d == digests[0] for d in digests), "ranks disagree"


class _SparseNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 4, sparse=True)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.emb(x).sum(1))


def _sparse_embedding_ddp(group, steps):
    """torch DDP with a sparse embedding: its gradient is all-reduced as a sparse tensor."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(SEED)
    model = DDP(_SparseNet(), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(SEED + dist.get_rank())
    for _ in range(steps):
        model(torch.randint(0, 20, (5, 3), generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_torch_ddp_with_a_sparse_embedding_over_dk_trains_as_over_gloo():
    """Two ranks: every sum is one rounding either way, so dk and gloo agree bitwise."""
    assert run_ranks(2, _same_on_dk_as_gloo, _sparse_embedding_ddp, 3) == [True, True]


def _set_timeout():
    """``set_timeout`` lowers the timeout of the next call (made with 60 s, set to 1 s),
    worded as torch's tests expect ("Timed out")."""
    import torch.distributed as dist

    rank = dist.get_rank()
    group = dist.new_group(backend="dk", timeout=datetime.timedelta(seconds=60))
    group.set_timeout(datetime.timedelta(seconds=1))
    try:
        if rank == 0:
            with pytest.raises(dist.DistBackendError, match=" (Timed out|closed|timeout) ") as e:
                dist.barrier(group=group)  # alone
            return str(e.value)
        time.sleep(2.5)  # alive past rank 0's new timeout
        return None
    finally:
        dist.destroy_process_group(group)


def test_set_timeout_honoured():
    message = run_ranks(2, _set_timeout)[0]
    assert "Timed out after 1.0 s" in message, message


# -- devices, hosts, the world group -----------------------------------------------------------


def _mixed_devices():
    """ "cpu:dk,cuda:nccl" and "cpu:gloo,cuda:dk" route CPU tensors by device; a backend a dk
    group cannot hand a device to fails the group's first call, naming it."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    seen = []
    for backend in ("cpu:dk,cuda:nccl", "cpu:gloo,cuda:dk"):
        group = dist.new_group(backend=backend)
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, group=group)
        assert torch.equal(t, torch.full((3,), float(n * (n + 1) // 2))), (backend, t)
        seen.append((repr(group.__class__.__name__), group._routes.backends))
        dist.destroy_process_group(group)
    group = dist.new_group(backend="cpu:dk,cuda:ucc")
    with pytest.raises(ValueError, match="device 'cuda' asks for backend 'ucc'"):
        dist.all_reduce(torch.ones(1), group=group)
    dist.destroy_process_group(group)
    return seen


def test_mixed_device_backends_route_cpu_tensors():
    seen = run_ranks(2, _mixed_devices)[0]
    assert seen[0][1] == {"cpu": "dk", "cuda": "nccl"}, seen
    assert seen[1][1] == {"cpu": "gloo", "cuda": "dk"}, seen


def _two_hosts():
    """A dk group whose ranks sit on two fake hosts: its communicator goes hierarchical,
    with the gloo groups between hosts made from the group's store."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="dk")
    assert type(group._routes._ours["cpu"]._backend).__name__ == "HierarchicalBackend"
    _reductions(group, torch.float32, 13)
    _data_movement(group, torch.int32, 5)
    dist.destroy_process_group(group)
    return rank < n


def test_dk_group_across_two_fake_hosts():
    env = {"DK_HOST_ID": ["host-a", "host-a", "host-b", "host-b"]}
    assert run_ranks(4, _two_hosts, env=env, timeout=300) == [True] * 4
    assert shm_leaks() == []


_WORLD_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    import dist_kernels
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    assert "dist_kernels._C" not in sys.modules, "registering loaded the extension"
    rank = int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group(
        "dk", init_method="file://" + sys.argv[1] + "/store", rank=rank, world_size=2
    )
    assert dist.get_backend() == "dk" and "dist_kernels._C" in sys.modules
    mesh = init_device_mesh("cpu", (2,))
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t, group=mesh.get_group())
    assert torch.equal(t, torch.full((4,), 3.0)), t
    mesh2 = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))  # sub-groups per dim
    assert dist.get_backend(mesh2.get_group("dp")) == "dk", dist.get_backend(mesh2.get_group("dp"))
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t, group=mesh2.get_group("dp"))
    assert torch.equal(t, torch.full((4,), 3.0)), t
    dist.all_reduce(t, group=mesh2.get_group("tp"))  # one rank: unchanged
    assert torch.equal(t, torch.full((4,), 3.0)), t
    sub = dist.new_group([0, 1], backend="dk")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))
    model(torch.randn(3, 4) * (rank + 1)).sum().backward()
    grads = [torch.empty_like(model.module.weight.grad) for _ in range(2)]
    dist.all_gather(grads, model.module.weight.grad, group=sub)
    assert torch.equal(grads[0], grads[1])
    dist.destroy_process_group()
    print("ok", rank)
    """
)


def test_init_process_group_dk_world(tmp_path):
    """The world group's creator runs before dist.is_initialized(); DeviceMesh, new_group and
    DDP on it; registering at import loads nothing compiled."""
    _run_world_script(tmp_path, _WORLD_SCRIPT)


_CHECKPOINT_SCRIPT = textwrap.dedent(
    """
    import copy, sys
    import torch, torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict, get_state_dict,
        set_model_state_dict, set_state_dict,
    )
    from torch.distributed.fsdp import fully_shard
    import dist_kernels

    root, rank = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("dk", init_method="file://" + root + "/store", rank=rank, world_size=2)
    world = dist.group.WORLD
    assert torch.device("cpu") in world._device_types, world._device_types
    assert world._get_backend(torch.device("cpu")).name() == "dk"
    try:
        world._get_backend(torch.device("meta"))
        raise AssertionError("a device the group does not serve was given a backend")
    except RuntimeError as e:
        assert "no backend for device type 'meta'" in str(e), e
    FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def model(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
        for layer in (m[0], m[2]):
            fully_shard(layer)
        fully_shard(m)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    def train(m, opt, steps, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            m(torch.randn(4, 16, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()

    def full(m, opt):
        return get_model_state_dict(m, options=FULL), get_optimizer_state_dict(m, opt, options=FULL)

    def same(a, b):  # nested state dicts, tensors bitwise
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and torch.equal(a, b)
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(map(same, a, b))
        return a == b

    m, opt = model(0)
    train(m, opt, 2, seed=100 + rank)
    saved = copy.deepcopy(full(m, opt))
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=root + "/sync")
    dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=root + "/async").result()
    for kind in ("sync", "async"):
        m2, opt2 = model(1)
        train(m2, opt2, 1, seed=200 + rank)  # optimizer state to overwrite
        msd2, osd2 = get_state_dict(m2, opt2)
        loaded = {"model": msd2, "optim": osd2}
        dcp.load(loaded, checkpoint_id=root + "/" + kind)
        set_state_dict(m2, opt2, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        assert same(full(m2, opt2), saved), kind
    dist.barrier()
    if rank == 0:  # the sharded files read back in one process, no collective involved
        dcp_to_torch_save(root + "/sync", root + "/one.pt")
        one = torch.load(root + "/one.pt", weights_only=False)["model"]
        assert same(one, saved[0]), sorted(one)
    # a full state dict on rank 0 only (the Hugging Face weights load), broadcast to the shards
    m3, _ = model(2)
    set_model_state_dict(
        m3,
        copy.deepcopy(saved[0]) if rank == 0 else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    assert same(get_model_state_dict(m3, options=FULL), saved[0])
    dist.destroy_process_group()
    print("ok", rank)
    """
)


def test_distributed_checkpoint_on_dk_world(tmp_path):
    """torch.distributed.checkpoint over FSDP2 on a dk world group: save, async_save and load
    round-trip model and AdamW state bitwise, the files read back in one process equal the
    gathered state, and set_model_state_dict(broadcast_from_rank0=True) shards rank 0's full
    state (it indexes the group's _device_types, which torch leaves empty for a Python group)."""
    _run_world_script(tmp_path, _CHECKPOINT_SCRIPT)


def _run_world_script(tmp_path, text):
    """Runs ``text`` as 2 fresh processes (argv: ``tmp_path``, where the file store goes, and
    the rank); each must end by printing "ok <rank>"."""
    script = tmp_path / "world.py"
    script.write_text(text)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path), str(r)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=180)[0])
        finally:
            proc.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    assert [o.strip().splitlines()[-1] for o in outputs] == ["ok 0", "ok 1"], outputs
    assert shm_leaks() == []


# -- gpu tier: "cuda:dk" and "cpu:dk,cuda:nccl" on CUDA tensors --------------------------------

_NO_GPU = not torch.cuda.is_available()


def _cuda_routes():
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(0)
    results = []
    for backend in ("cuda:dk", "cpu:dk,cuda:nccl"):
        group = dist.new_group(backend=backend)
        t = torch.full((1000,), float(rank + 1), device="cuda")
        dist.all_reduce(t, group=group)
        out = torch.empty(n * 1000, device="cuda")
        dist.all_gather_into_tensor(out, t, group=group)
        torch.cuda.synchronize()
        expected = float(n * (n + 1) // 2)
        ok = bool((t == expected).all()) and bool((out == expected).all())
        if backend == "cuda:dk":
            ok = ok and _cuda_future_after_the_gpu(group, rank, n)
        results.append(ok)
        dist.destroy_process_group(group)
    return results


def _cuda_future_after_the_gpu(group, rank: int, n: int) -> bool:
    """The future of an async all-reduce held back on the GPU is not done until the GPU is, and a
    then() callback on another stream sees the result (DDP comm hooks work this way)."""
    import torch.distributed as dist

    t = torch.full((1 << 16,), float(rank + 1), device="cuda")
    torch.cuda._sleep(200_000_000)  # ~0.1 s: the collective is still pending when we look
    future = dist.all_reduce(t, group=group, async_op=True).get_future()
    pending = not future.done()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        doubled = future.then(lambda f: f.value()[0] * 2).wait()
    torch.cuda.synchronize()
    return pending and bool((doubled == n * (n + 1)).all())


@pytest.mark.gpu
@pytest.mark.two_ranks
@pytest.mark.skipif(_NO_GPU, reason="needs a CUDA device")
def test_cuda_routes_on_one_gpu():
    env = {
        "NCCL_HOSTID": ["dk-rank-0", "dk-rank-1"],
        "NCCL_NET": "Socket",
        "NCCL_P2P_DISABLE": "1",
        "NCCL_SHM_DISABLE": "1",
        "NCCL_SOCKET_IFNAME": "lo",
    }
    # 30 s: a hang ends inside the device check's per-test timeout (64 s), in pytest's summary.
    assert run_ranks(2, _cuda_routes, env=env, timeout=30) == [[True, True]] * 2
