"""GPU tier: kernels and collectives on a CUDA device, against torch and against NCCL.

Every test is marked ``gpu`` and skipped, with the reason, where there is no CUDA device or the
build has no CUDA (``pytest -m gpu`` runs only these; benchmarks/device_check.sh runs them on a
lent GPU, with DK_REQUIRE_GPU=1 so that test_gpu_required.py fails instead of skipping).

No test here can pass by doing nothing: at world size 1 only out-of-place calls into poisoned
outputs and sends through the staging slots are checked (an in-place collective of one rank
leaves its input unchanged, and ring and tree return at once); everything else runs on two ranks
sharing the one GPU through NCCL's socket transport (design.md), on inputs that differ by rank,
so that every result differs from every input. Inputs are small multiples of 1/4: every sum,
product and average is exact, so ring and tree must equal NCCL and the float64 reference bitwise.
"""

from __future__ import annotations

import os
import time

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


def test_dropout_masks_on_the_gpu_equal_the_cpu_kernels():
    """Counter-based dropout (dk.models.dropout): the GPU hashes with torch's int64 ops, the CPU
    with its C++ kernel; a layout spanning both kinds of device must draw the same masks."""
    from dist_kernels.models import dropout as dk_dropout

    key = dk_dropout.site_key(SEED, 7, 3)
    shapes = ([8, 256, 512], [2, 4, 64, 64])  # the residual stream; attention probabilities
    for shape in shapes:
        cpu = [torch.arange(n) + 5 for n in shape]
        gpu = [c.cuda() for c in cpu]
        on_gpu = dk_dropout.keep_mask(key, gpu, 0.1)
        assert on_gpu.is_cuda
        assert torch.equal(on_gpu.cpu(), dk_dropout.keep_mask(key, cpu, 0.1)), shape


# -- collectives at world size 1: out-of-place only, into poisoned outputs ---------------------


#: Every all-reduce algorithm of the CUDA route ("auto" is "nccl" there).
ALGORITHMS = ["nccl", "ring", "tree"]


@pytest.mark.parametrize("algorithm", ["nccl", "ring"])
def test_reduce_scatter_all_gather_world_one_write_the_output(comm, algorithm):
    gen = torch.Generator().manual_seed(SEED)
    x = _random(1000, torch.int32, gen)
    out = torch.full_like(x, -7)  # poisoned: a call that returns early leaves -7
    comm.reduce_scatter(out, x, algorithm=algorithm)
    assert torch.equal(out, x)
    gathered = torch.full_like(x, -7)
    comm.all_gather(gathered, x, algorithm=algorithm)
    assert torch.equal(gathered, x)


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


# -- two ranks on one GPU (NCCL's socket transport, as in design.md) -------------------------

_TWO_RANKS_ENV = {
    "NCCL_HOSTID": ["dk-rank-0", "dk-rank-1"],
    "NCCL_NET": "Socket",
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_SOCKET_IFNAME": "lo",
}
#: A call on two ranks ends well inside benchmarks/device_check.sh's per-test pytest timeout
#: (64 s), so a hang shows up as run_ranks' TimeoutError naming the ranks still running, and a
#: hung test costs the check 30 s, not its whole share. The slowest (every collective x dtype x
#: op, ~500 calls at a few ms over loopback sockets) is estimated at ~10 s.
TWO_RANK_TIMEOUT_S = 30
#: Each rank's communicator: a host wait longer than this is a CommError, not a hang.
COMM_TIMEOUT_S = 20
#: torch.cuda._sleep cycles that hold a stream for ~0.1 s (at ~2 GHz), so that work queued
#: behind it is certainly still pending when the host looks.
HOLD_CYCLES = 200_000_000


def _two_ranks(fn, *args):
    """Runs ``fn`` on two ranks sharing the GPU; tests that use it are marked ``two_ranks`` and
    run after every single-process test (tests/conftest.py)."""
    if os.environ.get("DK_GPU_TWO_RANKS", "1") == "0":
        pytest.skip("DK_GPU_TWO_RANKS=0")
    mp_pool = pytest.importorskip("mp_pool")
    print(f"seed {SEED}")
    return mp_pool.run_ranks(2, fn, *args, env=_TWO_RANKS_ENV, timeout=TWO_RANK_TIMEOUT_S)


def _rank_comm(**kwargs):
    """This rank's CUDA communicator, through the public entry point."""
    import datetime

    import dist_kernels

    comm = dist_kernels.Communicator(
        device="cuda:0", timeout=datetime.timedelta(seconds=COMM_TIMEOUT_S), **kwargs
    )
    assert isinstance(comm, _cuda_comm.CudaCommunicator), type(comm)
    return comm


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

    Every algorithm's all_reduce must equal NCCL's bitwise and the float64 reference.
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    comm = _rank_comm()
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
            results = {}
            for algorithm in algorithms:
                got = mine.clone()
                comm.all_reduce(got, op=op, algorithm=algorithm)
                torch.cuda.synchronize()
                results[algorithm] = got
                if not torch.equal(got, expected):
                    wrong.append(f"all_reduce {dtype} {op.name} {algorithm} vs float64")
                if not torch.equal(got, results["nccl"]):
                    wrong.append(f"all_reduce {dtype} {op.name} {algorithm} vs nccl")
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
    for name, call in (
        (
            "reduce_scatter",
            lambda: comm.reduce_scatter(mine[:half], mine[: 2 * half], op=op, algorithm="tree"),
        ),
        (
            "all_gather",
            lambda: comm.all_gather(
                torch.empty(4 * half, dtype=mine.dtype, device="cuda"),
                mine[: 2 * half],
                algorithm="tree",
            ),
        ),
    ):
        try:
            call()
            wrong.append(f"{name} algorithm='tree' ran (there is no tree {name})")
        except ValueError as e:
            if "no tree" not in str(e):
                wrong.append(f"{name} algorithm='tree': unclear error {e}")
    for algorithm in algorithms:
        copy = mine.clone()
        comm.broadcast(copy, src=1, algorithm=algorithm)
        torch.cuda.synchronize()
        if not torch.equal(copy, second):
            wrong.append(f"broadcast {mine.dtype} {algorithm}")
    return wrong


@pytest.mark.two_ranks
def test_two_ranks_every_collective_dtype_and_op_against_nccl_and_float64():
    results = _two_ranks(_two_rank_collectives, SEED, ALGORITHMS)
    assert results == [[], []], results


def _two_rank_async_streams_graphs(algorithms):
    """Async work, a side stream and graph capture, per algorithm; returns what went wrong."""
    rank = _rank_comm_rank()
    comm = _rank_comm()
    wrong = []
    n = 4099
    for algorithm in algorithms:
        # async_op: the result is the sum (3 * arange), not the input, once wait() returns.
        x = torch.arange(n, device="cuda", dtype=torch.float32) * (rank + 1)
        work = comm.all_reduce(x, algorithm=algorithm, async_op=True)
        work.wait(timeout=COMM_TIMEOUT_S)  # the host waits too, so is_completed() is now True
        if not work.is_completed():
            wrong.append(f"{algorithm}: is_completed() False after wait(timeout)")
        if not torch.equal(x, torch.arange(n, device="cuda", dtype=torch.float32) * 3):
            wrong.append(f"{algorithm}: async all_reduce")
        wrong += _side_stream_case(comm, rank, algorithm)
        wrong += _graph_case(comm, rank, algorithm)
    wrong += _graph_async_cases(comm, rank)
    wrong += _lanes_case(comm, rank)
    comm.close()
    return wrong


def _rank_comm_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _side_stream_case(comm, rank, algorithm):
    """A synchronous call on a side stream orders after that stream's earlier work (a fill
    held back by a sleep) and before its later work (a clone)."""
    side = torch.cuda.Stream()
    x = torch.zeros(1 << 16, device="cuda", dtype=torch.float32)
    side.wait_stream(torch.cuda.current_stream())  # x's zeros are written before the side works
    with torch.cuda.stream(side):
        torch.cuda._sleep(HOLD_CYCLES)
        x.fill_(rank + 1)
        comm.all_reduce(x, algorithm=algorithm)
        y = x.clone()
    torch.cuda.synchronize()
    return [] if torch.all(y == 3) else [f"{algorithm}: side-stream order, got {y[:4].tolist()}"]


def _graph_case(comm, rank, algorithm):
    """Capture (x = 2x + rank; all_reduce; x += 1) and replay: 4v + 2 on both ranks."""
    x = torch.zeros(1 << 12, device="cuda", dtype=torch.float32)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph, as torch's docs ask
        comm.all_reduce(x, algorithm=algorithm)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.mul_(2).add_(rank)
        comm.all_reduce(x, algorithm=algorithm)
        x.add_(1)
    wrong = []
    for value in (0.0, 3.0, -5.0):
        x.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        if not torch.all(x == 4 * value + 2):
            wrong.append(f"{algorithm}: graph replay at {value}: {x[:4].tolist()}")
    return wrong


@pytest.mark.two_ranks
def _graph_async_cases(comm, rank):
    """async_op=True inside a capture: waited inside, the graph replays right; a Work waited
    outside its capture is a RuntimeError (and the next call reports it)."""
    wrong = []
    x = torch.zeros(1 << 12, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        comm.all_reduce(x, algorithm="ring")  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(rank + 1)
        comm.all_reduce(x, algorithm="ring", async_op=True).wait()
        x.mul_(2)
    x.fill_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    if not torch.all(x == 2 * ((1 + 1) + (1 + 2))):
        wrong.append(f"async inside a graph: {x[:4].tolist()}")
    return wrong


def _two_rank_graph_staging():
    """A captured ring all-reduce allocates its own staging inside the graph (cudaMallocAsync:
    graph memory, which CUDA counts apart), so a replay never shares the eager calls' slots;
    the replay is right after the eager staging has been used with other data meanwhile."""
    rank = _rank_comm_rank()
    comm = _rank_comm()
    n = 3 * (_cuda_comm.DEFAULT_SLOT_BYTES // 4)  # several slots of staging
    g, e = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        comm.all_reduce(g, algorithm="ring")  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        comm.all_reduce(g, algorithm="ring")
    e.fill_(10 * (rank + 1))
    comm.all_reduce(e, algorithm="ring")  # the eager slots now hold other bytes
    g.fill_(rank + 1)
    graph.replay()
    torch.cuda.synchronize()
    wrong = [] if torch.all(g == 3) and torch.all(e == 30) else [f"replay {g[:2].tolist()}"]
    used = _graph_memory_high()
    staging = comm.lanes * (_cuda_comm.DEFAULT_NUM_SLOTS + 1) * _cuda_comm.DEFAULT_SLOT_BYTES
    if used is not None and used < staging:
        wrong.append(f"graph memory {used} B < one staging of {staging} B: not the graph's own")
    comm.close()
    return wrong


def _graph_memory_high():
    """cudaGraphMemAttrUsedMemHigh (bytes of graph-owned memory), through CuPy; None without."""
    try:
        import cupy

        return int(cupy.cuda.runtime.deviceGetGraphMemAttribute(0, 1))
    except (ImportError, AttributeError):
        return None


@pytest.mark.two_ranks
def test_two_ranks_captured_collective_has_its_own_staging():
    results = _two_ranks(_two_rank_graph_staging)
    assert results == [[], []], results


def _lanes_case(comm, rank):
    """One lane and two lanes give the same bits (ring and tree, several slices)."""
    one_lane = _rank_comm(lanes=1)
    gen = torch.Generator().manual_seed(SEED + rank)
    x = _random(5 * (_cuda_comm.DEFAULT_SLOT_BYTES // 4) + 3, torch.float32, gen)
    wrong = []
    for algorithm in ("ring", "tree"):
        a, b = x.clone(), x.clone()
        comm.all_reduce(a, algorithm=algorithm)
        one_lane.all_reduce(b, algorithm=algorithm)
        torch.cuda.synchronize()
        if comm.lanes != 2 or one_lane.lanes != 1 or not torch.equal(a, b):
            wrong.append(f"{algorithm}: 2 lanes ({comm.lanes}) differ from 1 ({one_lane.lanes})")
    one_lane.close()
    return wrong


@pytest.mark.two_ranks
def test_two_ranks_async_side_stream_and_graph_capture():
    results = _two_ranks(_two_rank_async_streams_graphs, ALGORITHMS)
    assert results == [[], []], results


class _ArrayInterfaceOnly:
    """Exposes only ``__cuda_array_interface__`` (no DLPack), as some libraries do."""

    def __init__(self, array):
        self.array = array
        self.__cuda_array_interface__ = array.__cuda_array_interface__


def _two_rank_cupy():
    """CuPy inputs (DLPack and __cuda_array_interface__) and their lifetime; what went wrong."""
    import cupy

    rank = _rank_comm_rank()
    comm = _rank_comm()
    wrong = []
    n = 1000
    a = cupy.arange(n, dtype=cupy.int64) * (rank + 1)
    comm.all_reduce(a)
    torch.cuda.synchronize()
    if not bool((a == cupy.arange(n, dtype=cupy.int64) * 3).all()):
        wrong.append("DLPack all_reduce")
    b = cupy.arange(n, dtype=cupy.float32) * (rank + 1)
    comm.all_reduce(_ArrayInterfaceOnly(b))
    torch.cuda.synchronize()
    if not bool((b == cupy.arange(n, dtype=cupy.float32) * 3).all()):
        wrong.append("__cuda_array_interface__ all_reduce")
    wrong += _cupy_kept_alive(comm, cupy, n)
    wrong += _cupy_stream_order(comm, cupy, rank, n)
    comm.close()
    return wrong


def _cupy_stream_order(comm, cupy, rank, n):
    """On a non-default CuPy stream, CuPy's next kernel sees the collective's result: the
    collective (held back by a sleep on torch's stream) orders CuPy's current stream after it,
    for DLPack and for __cuda_array_interface__ inputs."""
    wrong = []
    for how, wrap in (("DLPack", lambda a: a), ("__cuda_array_interface__", _ArrayInterfaceOnly)):
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            a = cupy.full(n, rank + 1, dtype=cupy.float32)
            torch.cuda._sleep(HOLD_CYCLES)  # the comm stream starts after torch's stream
            comm.all_reduce(wrap(a))
            seen = a.copy()  # on CuPy's stream: must wait for the all-reduce
            stream.synchronize()
        if not bool((seen == 3).all()):
            wrong.append(f"{how}: CuPy's stream read {float(seen[0])} before the all-reduce")
    return wrong


def _cupy_kept_alive(comm, cupy, n):
    """While a collective on a CuPy array is pending, dropping the array must not hand its
    memory back to CuPy's pool (which would give it to the next allocation at once)."""
    cupy.cuda.Device().synchronize()
    c = cupy.ones(1 << 20, dtype=cupy.float32)
    address = c.data.ptr
    torch.cuda._sleep(HOLD_CYCLES)  # the comm stream waits behind this: the call is pending
    comm.all_reduce(c)
    del c
    d = cupy.empty(1 << 20, dtype=cupy.float32)
    reused = d.data.ptr == address
    torch.cuda.synchronize()
    return ["a pending all_reduce's CuPy input was freed (its memory reused)"] if reused else []


@pytest.mark.two_ranks
def test_two_ranks_cupy_inputs():
    pytest.importorskip("cupy")
    results = _two_ranks(_two_rank_cupy)
    assert results == [[], []], results


def _two_rank_point_to_point(seed: int):
    """isend/irecv, send/recv and send_recv between the two ranks; returns what went wrong."""
    rank = _rank_comm_rank()
    comm = _rank_comm()
    peer = 1 - rank
    gen = torch.Generator().manual_seed(seed)
    messages = [
        _random(3 * (_cuda_comm.DEFAULT_SLOT_BYTES // 4) + 5, torch.int32, gen) + r
        for r in range(2)
    ]  # the same on both ranks: each knows what to expect
    wrong = []
    got = torch.full_like(messages[0], -1)
    if rank == 0:
        work = comm.isend(messages[0], 1)
    else:
        work = comm.irecv(got, 0)
    work.wait(timeout=COMM_TIMEOUT_S)
    if rank == 1 and not torch.equal(got, messages[0]):
        wrong.append("isend 0 -> irecv 1")
    got.fill_(-1)
    if rank == 1:
        comm.send(messages[1], 0)
    else:
        comm.recv(got, 1)
    torch.cuda.synchronize()
    if rank == 0 and not torch.equal(got, messages[1]):
        wrong.append("send 1 -> recv 0")
    got.fill_(-1)
    comm.send_recv(messages[rank], peer, got, peer)
    torch.cuda.synchronize()
    if not torch.equal(got, messages[peer]):
        wrong.append("send_recv exchange")
    comm.close()
    return wrong


@pytest.mark.two_ranks
def test_two_ranks_point_to_point():
    results = _two_ranks(_two_rank_point_to_point, SEED)
    assert results == [[], []], results


def _two_rank_timeout_aborts():
    """Rank 0 all-reduces, rank 1 never joins: wait(timeout) raises CommError and aborts."""
    from dist_kernels.errors import CommError

    rank = _rank_comm_rank()
    comm = _rank_comm()
    # The same all-reduce on both ranks first: NCCL connects lazily, on a collective's first call
    # of its kind, and that connection needs the peer; without the warm-up rank 0's timed call
    # would block on the host inside ncclAllReduce, never reaching wait(timeout).
    x = torch.ones(1 << 10, device="cuda")
    comm.all_reduce(x)
    comm.barrier()  # both have finished it before rank 1 stays away
    outcome = {}
    if rank == 0:
        work = comm.all_reduce(x, async_op=True)
        start = time.monotonic()
        try:
            work.wait(timeout=2.0)
            outcome["wait"] = "returned"
        except CommError as error:
            outcome["wait"] = str(error)
        outcome["seconds"] = time.monotonic() - start
        try:
            comm.all_reduce(x)
            outcome["after"] = "returned"
        except CommError as error:
            outcome["after"] = str(error)
        comm.close()
    else:
        time.sleep(4.0)
        comm.abort()
    return outcome


@pytest.mark.two_ranks
def test_two_ranks_wait_timeout_aborts_with_comm_error():
    rank0, rank1 = _two_ranks(_two_rank_timeout_aborts)
    assert rank1 == {}
    assert "[rank 0] all_reduce" in rank0["wait"] and "timeout" in rank0["wait"], rank0
    assert "aborted" in rank0["wait"], rank0
    assert 2.0 <= rank0["seconds"] < 10.0, rank0
    assert "earlier failure" in rank0["after"], rank0
