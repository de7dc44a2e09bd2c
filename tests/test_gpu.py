"""GPU tier: kernels and collectives on a CUDA device, against torch and against NCCL.

Every test is marked ``gpu`` and skipped, with the reason, where there is no CUDA device or the
build has no CUDA (``pytest -m gpu`` runs only these; benchmarks/device_check.sh runs them on a
lent GPU). Integer inputs compare exactly; floating inputs compare with NCCL's own result on
the same data, which ring/tree must match bitwise on integers and to rounding on floats.
"""

from __future__ import annotations

import os

import pytest
import torch

from dist_kernels import _C
from dist_kernels.comm import cuda as _cuda_comm
from dist_kernels.dtypes import DTYPE_CODES, ReduceOp

_REASON = _cuda_comm.unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=str(_REASON))]

SEED = 20261130
DTYPES = list(DTYPE_CODES)
OPS = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.AVG]
# Counts around warp, block and staging-slot boundaries (slots of 4 MiB = 1 Mi float32).
COUNTS = [1, 31, 1000, 4096 + 3, (1 << 20) + 17]


def _random(count: int, dtype: torch.dtype, gen: torch.Generator, device="cuda") -> torch.Tensor:
    """Small values so that sums and products of a few ranks stay exact in every dtype."""
    if dtype.is_floating_point:
        values = torch.randint(-4, 5, (count,), generator=gen).to(torch.float64) / 4
    else:
        low = 0 if dtype == torch.uint8 else -3
        values = torch.randint(low, 4, (count,), generator=gen)
    return values.to(dtype).to(device)


def _torch_reduce(a: torch.Tensor, b: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """The reference: float64 (or int64) math, rounded once to the dtype."""
    wide = torch.float64 if a.dtype.is_floating_point else torch.int64
    x, y = a.to(wide), b.to(wide)
    result = {
        ReduceOp.SUM: x + y,
        ReduceOp.AVG: x + y,  # the kernel reduces AVG as SUM; the divide is a separate step
        ReduceOp.PROD: x * y,
        ReduceOp.MAX: torch.maximum(x, y),
        ReduceOp.MIN: torch.minimum(x, y),
    }[op]
    return result.to(a.dtype)


@pytest.fixture(scope="module")
def comm():
    """A world-size-1 CUDA communicator over a HashStore."""
    store = torch.distributed.HashStore()
    with _cuda_comm.CudaCommunicator(device=0, store=store, rank=0, world_size=1) as c:
        yield c


# -- kernels on the device ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_reduce_kernel_matches_torch(dtype, op):
    if not hasattr(_C, "kernels_reduce"):
        pytest.skip("the kernels' bindings (_C.kernels_reduce) are not in this build")
    print(f"seed {SEED}")
    gen = torch.Generator().manual_seed(SEED)
    for count in COUNTS:
        a, b = _random(count, dtype, gen), _random(count, dtype, gen)
        dst = torch.full_like(a, 7)  # poisoned: every element must be written
        stream = torch.cuda.current_stream().cuda_stream
        _C.kernels_reduce(
            dst.data_ptr(),
            [a.data_ptr(), b.data_ptr()],
            count,
            DTYPE_CODES[dtype],
            int(op),
            0,
            stream,
        )
        torch.testing.assert_close(dst, _torch_reduce(a, b, op), rtol=0, atol=0)


@pytest.mark.parametrize(
    "src_dtype,dst_dtype",
    [
        (s, d)
        for s in (torch.float32, torch.float16, torch.bfloat16)
        for d in (torch.float32, torch.float16, torch.bfloat16)
    ],
    ids=str,
)
def test_cast_scale_kernel_matches_torch(src_dtype, dst_dtype):
    if not hasattr(_C, "kernels_cast_scale"):
        pytest.skip("the kernels' bindings (_C.kernels_cast_scale) are not in this build")
    gen = torch.Generator().manual_seed(SEED)
    src = (torch.randn(100_003, generator=gen) * 100).to(src_dtype).cuda()
    src[7] = float("inf")
    dst = torch.empty(src.numel(), dtype=dst_dtype, device="cuda")
    scale = 0.37
    _C.kernels_cast_scale(
        dst.data_ptr(),
        DTYPE_CODES[dst_dtype],
        src.data_ptr(),
        DTYPE_CODES[src_dtype],
        src.numel(),
        scale,
        0,
        torch.cuda.current_stream().cuda_stream,
    )
    expected = (src.to(torch.float32) * scale).to(dst_dtype)  # FP32 math, one rounding
    torch.testing.assert_close(dst, expected, rtol=0, atol=0, equal_nan=True)


# -- collectives at world size 1 -------------------------------------------------------------


def _algorithms():
    return ["nccl", "ring", "tree"] if hasattr(_C, "CudaCommunicator") else ["nccl"]


@pytest.mark.parametrize("algorithm", ["nccl", "ring", "tree"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_all_reduce_world_one_is_identity(comm, dtype, op, algorithm):
    if algorithm not in _algorithms():
        pytest.skip("this build has no ring/tree CUDA communicator")
    gen = torch.Generator().manual_seed(SEED)
    x = _random(4099, dtype, gen)
    expected = x.clone()
    comm.all_reduce(x, op=op, algorithm=algorithm)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)


@pytest.mark.parametrize("algorithm", ["nccl", "ring"])
def test_reduce_scatter_all_gather_broadcast_world_one(comm, algorithm):
    if algorithm not in _algorithms():
        pytest.skip("this build has no ring/tree CUDA communicator")
    gen = torch.Generator().manual_seed(SEED)
    x = _random(1000, torch.int32, gen)
    out = torch.full_like(x, -7)
    comm.reduce_scatter(out, x, algorithm=algorithm)
    assert torch.equal(out, x)
    gathered = torch.full_like(x, -7)
    comm.all_gather(gathered, x, algorithm=algorithm)
    assert torch.equal(gathered, x)
    y = x.clone()
    comm.broadcast(y, src=0, algorithm=algorithm)
    assert torch.equal(y, x)


def test_transport_send_recv_to_self_crosses_slots(comm):
    """NcclTransport + CudaCompute: a message larger than one staging slot, sent to self."""
    gen = torch.Generator().manual_seed(SEED)
    send = _random(3 * (_cuda_comm.DEFAULT_SLOT_BYTES // 4) + 5, torch.int32, gen)
    recv = torch.full_like(send, -1)
    comm.send_recv(send, 0, recv, 0)
    assert torch.equal(recv, send)


def test_bad_inputs_raise_value_or_type_error(comm):
    with pytest.raises(ValueError, match="tensor is on cpu|expected a tensor on cuda"):
        comm.all_reduce(torch.ones(4))
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce(torch.ones(4, 4, device="cuda").t())
    with pytest.raises(TypeError, match="unsupported dtype"):
        comm.all_reduce(torch.ones(4, dtype=torch.complex64, device="cuda"))
    with pytest.raises(ValueError, match="world_size"):
        comm.all_gather(torch.empty(3, device="cuda"), torch.empty(2, device="cuda"))
    with pytest.raises(ValueError, match="algorithm"):
        comm.all_reduce(torch.ones(4, device="cuda"), algorithm="butterfly")


def test_async_op_returns_work(comm):
    x = torch.arange(1 << 16, device="cuda", dtype=torch.float32)
    work = comm.all_reduce(x, async_op=True)
    work.wait()
    torch.cuda.synchronize()
    assert work.is_completed()
    assert torch.equal(x, torch.arange(1 << 16, device="cuda", dtype=torch.float32))


@pytest.mark.parametrize("algorithm", ["nccl", "ring"])
def test_graph_capture_replays_all_reduce(comm, algorithm):
    if algorithm not in _algorithms():
        pytest.skip("this build has no ring/tree CUDA communicator")
    x = torch.zeros(1 << 12, device="cuda", dtype=torch.float32)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph, as torch's docs ask
        comm.all_reduce(x, algorithm=algorithm)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.mul_(2).add_(1)
        comm.all_reduce(x, algorithm=algorithm)
        x.add_(1)
    for value in (0.0, 3.0, -5.0):
        x.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.all(x == value * 2 + 2), (value, x[:4])


def test_cupy_input(comm):
    cupy = pytest.importorskip("cupy")
    a = cupy.arange(1000, dtype=cupy.int64)
    comm.all_reduce(a)
    torch.cuda.synchronize()
    assert bool((a == cupy.arange(1000, dtype=cupy.int64)).all())


# -- two ranks on one GPU (NCCL's socket transport, as in design.md) -------------------------

_TWO_RANKS_ENV = {
    "NCCL_HOSTID": ["dk-rank-0", "dk-rank-1"],
    "NCCL_NET": "Socket",
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_SOCKET_IFNAME": "lo",
}


def _float64_reference(first, second, op):
    """The 2-rank result computed in float64 / int64 (AVG truncates integers toward zero)."""
    if op != ReduceOp.AVG:
        return _torch_reduce(first, second, op)
    wide = torch.float64 if first.dtype.is_floating_point else torch.int64
    total = first.to(wide) + second.to(wide)
    if first.dtype.is_floating_point:
        return (total / 2).to(first.dtype)
    return torch.div(total, 2, rounding_mode="trunc").to(first.dtype)


def _two_rank_collectives(seed: int, algorithms):
    """Runs on both ranks; returns the (dtype, op, algorithm, collective) cases that differ.

    Every algorithm's all_reduce must equal NCCL's bitwise and the float64 reference; the
    inputs are small multiples of 1/4, so every sum, product and average is exact.
    """
    import torch.distributed as dist

    import dist_kernels

    rank = dist.get_rank()
    # The public entry point where communicator.py exists, else the CUDA class itself.
    try:
        comm = dist_kernels.Communicator(device="cuda:0")
    except (ImportError, AttributeError):
        comm = _cuda_comm.CudaCommunicator(device="cuda:0")
    assert isinstance(comm, _cuda_comm.CudaCommunicator), type(comm)
    gen = torch.Generator().manual_seed(seed + rank)
    wrong = []
    slot_elems = _cuda_comm.DEFAULT_SLOT_BYTES // 4
    for dtype in DTYPES:
        for op in OPS:
            # 5000 elements, and for float32 1.5 staging slots + 7: slices cross slot boundaries.
            count = slot_elems * 3 // 2 + 7 if dtype == torch.float32 else 5000
            mine = _random(count, dtype, gen)
            theirs = torch.empty_like(mine)
            comm.send_recv(mine, 1 - rank, theirs, 1 - rank)  # NcclTransport, both directions
            first, second = (mine, theirs) if rank == 0 else (theirs, mine)
            expected = _float64_reference(first, second, op)
            for algorithm in algorithms:
                got = mine.clone()
                comm.all_reduce(got, op=op, algorithm=algorithm)
                torch.cuda.synchronize()
                if not torch.equal(got, expected):
                    wrong.append(f"all_reduce {dtype} {op.name} {algorithm}")
            wrong += _check_scatter_gather_broadcast(comm, mine, first, second, op, algorithms)
    comm.close()
    return wrong


def _check_scatter_gather_broadcast(comm, mine, first, second, op, algorithms):
    rank, half = comm.rank, mine.numel() // 2
    both = torch.cat([first[: 2 * half], second[: 2 * half]])  # gathered in rank order
    wrong = []
    for algorithm in [a for a in algorithms if a != "tree"]:
        shard = torch.empty(half, dtype=mine.dtype, device="cuda")
        comm.reduce_scatter(shard, mine[: 2 * half], op=op, algorithm=algorithm)
        full = _float64_reference(first[: 2 * half], second[: 2 * half], op)
        gathered = torch.empty(4 * half, dtype=mine.dtype, device="cuda")
        comm.all_gather(gathered, mine[: 2 * half], algorithm=algorithm)
        torch.cuda.synchronize()
        if not torch.equal(shard, full[rank * half : (rank + 1) * half]):
            wrong.append(f"reduce_scatter {mine.dtype} {op.name} {algorithm}")
        if not torch.equal(gathered, both):
            wrong.append(f"all_gather {mine.dtype} {algorithm}")
    for algorithm in algorithms:
        copy = mine.clone()
        comm.broadcast(copy, src=1, algorithm=algorithm)
        torch.cuda.synchronize()
        if not torch.equal(copy, second):
            wrong.append(f"broadcast {mine.dtype} {algorithm}")
    return wrong


def test_two_ranks_on_one_gpu():
    if os.environ.get("DK_GPU_TWO_RANKS", "1") == "0":
        pytest.skip("DK_GPU_TWO_RANKS=0")
    mp_pool = pytest.importorskip("mp_pool")
    print(f"seed {SEED}")
    algorithms = ["nccl", "ring", "tree"] if hasattr(_C, "CudaCommunicator") else ["nccl"]
    results = mp_pool.run_ranks(
        2, _two_rank_collectives, (SEED, algorithms), env=_TWO_RANKS_ENV, timeout=240
    )
    assert results == [[], []], results
