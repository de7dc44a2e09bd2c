"""Tensor-parallel pairs, layers and cross-entropy against the unsharded layer in float64.

One pool of 4 ranks runs every tp size: tp groups {0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}.
"""

import copy
import datetime

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mp_pool import run_ranks

import dist_kernels as dk
from dist_kernels import tensor_parallel as tp

SEED = 20261201
TP_SIZES = (1, 2, 3, 4)
SEQ, BATCH, FEAT = 12, 2, 12  # divisible by every tp size
_COMMS = {}
TIMEOUT = datetime.timedelta(seconds=30)  # a failing rank ends the others' waits


def _tp_comms():
    """``{tp: Communicator or None}`` for this rank (None where it is not in the group)."""
    import torch.distributed as dist

    if not _COMMS:
        for n in TP_SIZES:  # new_group is collective: every rank creates every group, in order
            group = dist.new_group(list(range(n)))
            member = dist.get_rank() < n
            _COMMS[n] = dk.Communicator(group=group, timeout=TIMEOUT) if member else None
    return _COMMS


def _close(a, b, what, tol=1e-12):
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    assert diff < tol, f"{what}: max difference {diff:.2e}"
    return diff


def _data(*shape, seed=0):
    g = torch.Generator().manual_seed(SEED + seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _chunk(t, dim, comm):
    return t.chunk(comm.world_size, dim)[comm.rank]


def _run_pair(fn, x, grad_out):
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.backward(grad_out)
    return y.detach(), x.grad


def _val(q, *shape):
    """Integer-valued data that differs per rank ``q`` (a dropped or doubled rank shows)."""
    return torch.arange(float(torch.Size(shape).numel()), dtype=torch.float64).view(shape) + 100 * q


def _check_pairs(comm):
    """Every autograd pair on integer-valued data (exact), forward and backward."""
    n, r = comm.world_size, comm.rank
    shape = (SEQ, FEAT)

    def x(q):
        return _val(q, *shape)

    def g(q):
        return _val(q + 10, *shape)

    def chunk(t, q, dim=0):
        return t.chunk(n, dim)[q]

    total_x, total_g = sum(x(q) for q in range(n)), sum(g(q) for q in range(n))
    #        pair, input, output grad, expected output, expected input grad
    cases = {
        "copy_to": (tp.copy_to_parallel_region, x(0), g(r), x(0), total_g),
        "reduce_from": (tp.reduce_from_parallel_region, x(r), g(r), total_x, g(r)),
        "gather_seq": (
            tp.gather_from_sequence_parallel_region,
            chunk(x(0), r),
            g(r),
            x(0),
            chunk(total_g, r),
        ),
        "reduce_scatter_seq": (
            tp.reduce_scatter_to_sequence_parallel_region,
            x(r),
            chunk(g(r), r),
            chunk(total_x, r),
            torch.cat([chunk(g(q), q) for q in range(n)]),
        ),
        "scatter_seq": (
            tp.scatter_to_sequence_parallel_region,
            x(0),
            chunk(g(r), r),
            chunk(x(0), r),
            torch.cat([chunk(g(q), q) for q in range(n)]),
        ),
        "gather_last": (
            tp.gather_from_tensor_parallel_region,
            chunk(x(0), r, 1),
            g(r),
            x(0),
            chunk(g(r), r, 1),
        ),
        "scatter_last": (
            tp.scatter_to_tensor_parallel_region,
            x(0),
            chunk(g(r), r, 1),
            chunk(x(0), r, 1),
            torch.cat([chunk(g(q), q, 1) for q in range(n)], 1),
        ),
    }
    for name, (fn, inp, grad_out, want_y, want_grad) in cases.items():
        y, grad = _run_pair(lambda t, fn=fn: fn(t, comm), inp, grad_out)
        _close(y, want_y, f"{name} forward", 0.5)
        _close(grad, want_grad, f"{name} backward", 0.5)
    # dimensions other than 0: along dimension 1 of [2, SEQ, 3]
    x3 = [x(q).unsqueeze(0).repeat(2, 1, 1) for q in range(n)]
    y = tp.gather_from_sequence_parallel_region(chunk(x3[0], r, 1), comm, dim=1)
    _close(y, x3[0], "gather dim 1", 0.5)
    y = tp.reduce_scatter_to_sequence_parallel_region(x3[r], comm, dim=1)
    _close(y, chunk(sum(x3), r, 1), "reduce_scatter dim 1", 0.5)
    return 0.0


def _column_cases(comm):
    torch.manual_seed(SEED)
    full = nn.Linear(FEAT, FEAT).double()
    x = _data(SEQ, BATCH, FEAT, seed=1)
    w_out = _data(SEQ, BATCH, FEAT, seed=2)
    ref_x = x.clone().requires_grad_(True)
    ref_y = full(ref_x)
    (ref_y * w_out).sum().backward()
    diffs = []
    for gather, sp in ((False, False), (True, False), (False, True)):
        layer = tp.ColumnParallel(gather_output=gather, sequence_parallel=sp).apply(
            copy.deepcopy(full), comm, "col"
        )
        assert tuple(layer.weight.shape) == (FEAT // comm.world_size, FEAT)  # torch's layout
        xin = (_chunk(x, 0, comm) if sp else x).clone().requires_grad_(True)
        y = layer(xin)
        want = ref_y if gather else _chunk(ref_y, 2, comm)
        g = w_out if gather else _chunk(w_out, 2, comm)
        diffs.append(_close(y, want, f"column gather={gather} sp={sp} forward"))
        (y * g).sum().backward()
        want_xg = _chunk(ref_x.grad, 0, comm) if sp else ref_x.grad
        diffs.append(_close(xin.grad, want_xg, "column input grad"))
        want_wg = _chunk(full.weight.grad, 0, comm)
        diffs.append(_close(layer.weight.grad, want_wg, "column weight grad"))
        diffs.append(_close(layer.bias.grad, _chunk(full.bias.grad, 0, comm), "column bias grad"))
    return max(diffs)


def _row_cases(comm):
    torch.manual_seed(SEED + 3)
    full = nn.Linear(FEAT, FEAT).double()
    x = _data(SEQ, BATCH, FEAT, seed=4)
    w_out = _data(SEQ, BATCH, FEAT, seed=5)
    ref_x = x.clone().requires_grad_(True)
    ref_y = full(ref_x)
    (ref_y * w_out).sum().backward()
    diffs = []
    for parallel_in, sp in ((True, False), (False, False), (True, True)):
        layer = tp.RowParallel(input_is_parallel=parallel_in, sequence_parallel=sp).apply(
            copy.deepcopy(full), comm, "row"
        )
        assert tuple(layer.weight.shape) == (FEAT, FEAT // comm.world_size)
        xin = (_chunk(x, 2, comm) if parallel_in else x).clone().requires_grad_(True)
        y = layer(xin)
        want, g = (_chunk(ref_y, 0, comm), _chunk(w_out, 0, comm)) if sp else (ref_y, w_out)
        diffs.append(_close(y, want, f"row parallel_in={parallel_in} sp={sp} forward"))
        (y * g).sum().backward()
        want_xg = _chunk(ref_x.grad, 2, comm) if parallel_in else ref_x.grad
        diffs.append(_close(xin.grad, want_xg, "row input grad"))
        want_wg = _chunk(full.weight.grad, 1, comm)
        diffs.append(_close(layer.weight.grad, want_wg, "row weight grad"))
        # under sp each rank's bias gradient covers its sequence shard only: summed over tp
        diffs.append(_close(layer.bias.grad, full.bias.grad, f"row bias grad sp={sp}"))
    return max(diffs)


def _embedding_cases(comm):
    vocab, dim = 12, 5
    torch.manual_seed(SEED + 6)
    full = nn.Embedding(vocab, dim).double()
    ids = torch.randint(0, vocab, (SEQ, BATCH), generator=torch.Generator().manual_seed(SEED))
    w_out = _data(SEQ, BATCH, dim, seed=7)
    ref = full(ids)
    (ref * w_out).sum().backward()
    diffs = []
    for sp in (False, True):
        layer = tp.VocabParallel(sequence_parallel=sp).apply(copy.deepcopy(full), comm, "wte")
        y = layer(ids)
        want, g = (_chunk(ref, 0, comm), _chunk(w_out, 0, comm)) if sp else (ref, w_out)
        diffs.append(_close(y, want, f"embedding sp={sp} forward"))
        (y * g).sum().backward()
        diffs.append(_close(layer.weight.grad, _chunk(full.weight.grad, 0, comm), "embedding grad"))
    with pytest.raises(IndexError, match=r"ids must lie in \[0, 12\)"):
        layer(ids + vocab)
    return max(diffs)


def _cross_entropy_cases(comm):
    n_rows, vocab = 10, 12
    logits = _data(n_rows, vocab, seed=8) * 3
    targets = torch.randint(0, vocab, (n_rows,), generator=torch.Generator().manual_seed(SEED))
    targets[[1, 6]] = -100  # ignore_index
    diffs = []
    for reduction in ("mean", "sum", "none"):
        ref_logits = logits.clone().requires_grad_(True)
        ref = F.cross_entropy(ref_logits, targets, reduction=reduction)
        ref.sum().backward()
        shard = _chunk(logits, 1, comm).clone().requires_grad_(True)
        loss = tp.vocab_parallel_cross_entropy(shard, targets, comm=comm, reduction=reduction)
        loss.sum().backward()
        diffs.append(_close(loss, ref, f"cross_entropy {reduction} value"))
        diffs.append(_close(shard.grad, _chunk(ref_logits.grad, 1, comm), "cross_entropy grad"))
        assert (shard.grad[[1, 6]] == 0).all()
    # The comparison rejects a wrong answer: a local softmax over this shard alone.
    if comm.world_size > 1:
        clamped = targets.clamp(0, vocab // comm.world_size - 1)
        local = F.cross_entropy(_chunk(logits, 1, comm), clamped)
        assert (local - F.cross_entropy(logits, targets)).abs() > 1e-3
    # 3-d logits [seq, batch, vocab/tp], another ignore_index
    logits3 = _data(4, 3, vocab, seed=9)
    t3 = torch.randint(0, vocab, (4, 3), generator=torch.Generator().manual_seed(SEED + 1))
    t3[0, 0] = 7
    ref = F.cross_entropy(logits3.reshape(-1, vocab), t3.reshape(-1), ignore_index=7)
    got = tp.vocab_parallel_cross_entropy(_chunk(logits3, 2, comm), t3, comm=comm, ignore_index=7)
    diffs.append(_close(got, ref, "cross_entropy 3-d"))
    return max(diffs)


def _error_cases(comm):
    n = comm.world_size
    if n == 1:
        return []
    bad = FEAT + 1
    cases = [
        (lambda: tp.ColumnParallelLinear(FEAT, bad, comm=comm), rf"out_features\({bad}\)"),
        (lambda: tp.RowParallelLinear(bad, FEAT, comm=comm), rf"in_features\({bad}\)"),
        (lambda: tp.VocabParallelEmbedding(bad, 4, comm=comm), rf"num_embeddings\({bad}\)"),
        (
            lambda: tp.reduce_scatter_to_sequence_parallel_region(torch.zeros(bad, 2), comm),
            rf"shape \({bad}, 2\) is not divisible by tp: {bad}",
        ),
    ]
    messages = []
    for fn, pattern in cases:
        with pytest.raises(ValueError, match=rf"{pattern} % tp\({n}\) != 0") as info:
            fn()
        messages.append(str(info.value))
    with pytest.raises(ValueError, match=r"needs input_is_parallel=True"):
        tp.RowParallelLinear(FEAT, FEAT, comm, input_is_parallel=False, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"matches no module"):
        tp.shard_module(nn.Sequential(nn.Linear(4, 4)), {"nope": tp.ColumnParallel()}, comm)
    with pytest.raises(TypeError, match=r"applies to Linear"):
        tp.shard_module(nn.Sequential(nn.ReLU()), {"0": tp.ColumnParallel()}, comm)
    return messages


def _shard_marks(comm):
    """The reference GPT sharded over ``comm``: which parameters ``is_tensor_parallel_shard``
    names, against their shapes (a shard is smaller than the unsharded parameter)."""
    from dist_kernels.models import GPT, GPTConfig

    cfg = GPTConfig(n_layers=1, n_heads=12, dim=24, block_size=8, vocab_size=24)  # tp 1-4 divide
    full = dict(GPT(cfg).named_parameters())
    model = GPT(cfg).parallelize(comm)
    wrong = []
    for name, p in model.named_parameters():
        if tp.is_tensor_parallel_shard(p) != (p.shape != full[name].shape):
            wrong.append((name, tuple(p.shape), tp.is_tensor_parallel_shard(p)))
    return wrong


def _rank_all(what):
    results = {}
    for n, comm in _tp_comms().items():
        if comm is None:
            continue
        results[n] = globals()[what](comm)
    return results


@pytest.mark.parametrize(
    "what",
    ["_check_pairs", "_column_cases", "_row_cases", "_embedding_cases", "_cross_entropy_cases"],
)
def test_layers_equal_unsharded_float64(what):
    print("seed", SEED)
    results = run_ranks(4, _rank_all, what, timeout=120)
    for rank, per_tp in enumerate(results):
        assert sorted(per_tp) == [n for n in TP_SIZES if rank < n]
        for n, diff in per_tp.items():
            print(f"{what} tp={n} rank {rank}: max difference {diff}")


def test_is_tensor_parallel_shard_names_exactly_the_split_parameters():
    for per_tp in run_ranks(4, _rank_all, "_shard_marks", timeout=60):
        assert all(wrong == [] for wrong in per_tp.values()), per_tp


def test_shapes_that_do_not_divide_raise_with_the_arithmetic():
    results = run_ranks(4, _rank_all, "_error_cases", timeout=60)
    for rank, per_tp in enumerate(results):
        for n, messages in per_tp.items():
            for m in messages:
                print(f"tp={n} rank {rank}: {m}")
            assert all(f"[rank {rank}]" in m for m in messages)


# ------------------------------------------------------------------ overlap and desync guard


class _Recorder:
    """The tp communicator, recording when asynchronous collectives start and are waited."""

    def __init__(self, comm, events):
        self.comm, self.events = comm, events
        self.rank, self.world_size = comm.rank, comm.world_size

    def _wrap(self, name, work):
        self.events.append(f"start {name}")
        wait = work.wait

        def recorded_wait(*args):
            self.events.append(f"wait {name}")
            return wait(*args)

        work.wait = recorded_wait
        return work

    def all_reduce(self, t, op="sum", async_op=False):
        work = self.comm.all_reduce(t, op=op, async_op=async_op)
        return self._wrap("all_reduce", work) if async_op else work

    def reduce_scatter(self, out, inp, async_op=False):
        work = self.comm.reduce_scatter(out, inp, async_op=async_op)
        return self._wrap("reduce_scatter", work) if async_op else work

    def all_gather(self, out, inp, async_op=False):
        return self.comm.all_gather(out, inp, async_op=async_op)


def _rank_overlap():
    from torch.utils._python_dispatch import TorchDispatchMode

    events = []

    class MatmulLog(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
                events.append("matmul")
            return func(*args, **(kwargs or {}))

    tp_comm = _tp_comms()[2]  # on every rank: creating the groups is collective
    if tp_comm is None:
        return None
    comm = _Recorder(tp_comm, events)
    out = {}
    for sp in (False, True):
        layer = tp.ColumnParallelLinear(FEAT, FEAT, comm=comm, sequence_parallel=sp).double()
        x = _data(SEQ // 2 if sp else SEQ, BATCH, FEAT).requires_grad_(True)
        y = layer(x)
        events.clear()
        with MatmulLog():
            y.sum().backward()
        out[sp] = list(events)
    return out


def test_column_backward_overlaps_input_grad_reduction_with_weight_grad():
    results = run_ranks(4, _rank_overlap, timeout=60)
    for rank, per_sp in enumerate(results[:2]):
        for sp, events in per_sp.items():
            print(f"rank {rank} sequence_parallel={sp}: {events}")
            name = "reduce_scatter" if sp else "all_reduce"
            # input-grad matmul, its collective started, weight-grad matmul, then the wait
            assert events == ["matmul", f"start {name}", "matmul", f"wait {name}"], events


def _rank_desync(same_input):
    import torch.distributed as dist

    comm = _tp_comms()[2]
    if comm is None:
        return None
    rank = dist.get_rank()
    salt = 0 if same_input else rank
    x = _data(SEQ, BATCH, FEAT) + salt
    model = tp.shard_module(
        nn.Sequential(nn.Linear(FEAT, FEAT), nn.Linear(FEAT, FEAT)),
        {"0": tp.ColumnParallel(), "1": tp.RowParallel(input_is_parallel=False)},
        comm,
    ).double()
    embed = tp.VocabParallelEmbedding(FEAT, 4, comm=comm)
    ids = torch.arange(SEQ) % FEAT
    targets = ids.clone()
    calls = {
        "ColumnParallelLinear '0'": lambda: model[0](x),
        "RowParallelLinear '1'": lambda: model[1](x),
        "VocabParallelEmbedding": lambda: embed((ids + salt) % FEAT),
        "vocab_parallel_cross_entropy (targets)": lambda: tp.vocab_parallel_cross_entropy(
            torch.zeros(SEQ, FEAT // 2), (targets + salt) % FEAT, comm=comm
        ),
    }
    raised = {}
    for name, call in calls.items():
        try:
            call()
            raised[name] = None
        except tp.TensorParallelDesyncError as e:
            raised[name] = str(e)
    return raised


@pytest.mark.parametrize("same_input", [False, True])
def test_desync_guard_names_the_layer(same_input):
    results = run_ranks(4, _rank_desync, same_input, timeout=60, env={"DK_DEBUG": "1"})
    for rank, raised in enumerate(results[:2]):
        for name, message in raised.items():
            print(f"rank {rank} {name}: {message}")
            if same_input:
                assert message is None
            else:
                assert message is not None and f"] {name}: tensor-parallel ranks" in message
                assert "tp ranks [1] differ" in message
