"""CPU tier for the C++ communicator over NCCL (``_C.NcclCommunicator``), on a fake NCCL.

``tests/fake_nccl.c`` moves bytes between ranks that are threads of one process, over host
memory; ``device=-1`` makes the communicator use host staging and the CPU kernels. So the code the
GPU runs - resolving "auto", NCCL's own collectives, our ring and tree over NcclTransport, the
staging slots, the lanes, receiving final slices straight into the output, errors - runs here
against float64 references, in a fresh process (one NCCL per process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_nccl_loader import _build_fake_nccl

ROOT = Path(__file__).resolve().parent.parent
SEED = 20261204

# Runs in the fresh process: world_size threads, one communicator each, the same calls in the
# same order on every rank (the fake matches messages per communicator in issue order).
_SCRIPT = r"""
import ctypes, json, sys, threading
import torch
from dist_kernels import _C
from dist_kernels.comm import algorithms, nccl
from dist_kernels.dtypes import DTYPE_CODES, ReduceOp
from dist_kernels.errors import CommError

path, _ = nccl.load()
fake = ctypes.CDLL(path)
fake.fake_recvs_in.restype = ctypes.c_long
fake.fake_group_messages.restype = ctypes.c_long
SLOT = 256  # bytes: 64 float32 per slice, so small tensors cross many slices
CODE = algorithms.CODES
SEED = int(sys.argv[2])
WORLD = int(sys.argv[1])


def make(rank, ids):
    return _C.NcclCommunicator(ids, rank, WORLD, -1, 0, SLOT, 4)


def inputs(count, dtype, rank):
    gen = torch.Generator().manual_seed(SEED + 1000 * rank + count)
    return (torch.randint(-3, 4, (count,), generator=gen)).to(dtype)


def reference(count, dtype, op):
    xs = [inputs(count, dtype, r).to(torch.float64) for r in range(WORLD)]
    out = xs[0].clone()
    for x in xs[1:]:
        out = {"sum": out + x, "avg": out + x, "max": torch.maximum(out, x)}[op]
    if op == "avg":
        out = out / WORLD if dtype.is_floating_point else torch.trunc(out / WORLD)
    return out.to(dtype)


OPS = {"sum": int(ReduceOp.SUM), "max": int(ReduceOp.MAX), "avg": int(ReduceOp.AVG)}
DTYPES = {dtype: DTYPE_CODES[dtype] for dtype in (torch.float32, torch.int32)}


def collectives(comm, rank, wrong):
    for dtype, dcode in DTYPES.items():
        for op, ocode in OPS.items():
            for count in (1, 63, 2 * 64 + 5, 1000):
                want = reference(count, dtype, op)
                for name in ("ring", "tree", "nccl", "auto"):
                    x = inputs(count, dtype, rank)
                    comm.all_reduce(x.data_ptr(), x.data_ptr(), count, dcode, ocode, CODE[name])
                    if not torch.equal(x, want):
                        wrong.append(f"all_reduce {dtype} {op} {count} {name}")
                n = count // WORLD
                whole = [inputs(count, dtype, r)[: n * WORLD] for r in range(WORLD)]
                for name in ("ring", "nccl"):
                    out = torch.full((n,), 99, dtype=dtype)
                    x = whole[rank]
                    comm.reduce_scatter(x.data_ptr(), out.data_ptr(), n, dcode, ocode, CODE[name])
                    full = reference(count, dtype, op)[: n * WORLD]
                    if not torch.equal(out, full[rank * n : (rank + 1) * n]):
                        wrong.append(f"reduce_scatter {dtype} {op} {count} {name}")
            for count in (7, 5 * 64 + 3):
                for name in ("ring", "nccl"):
                    mine = inputs(count, dtype, rank)
                    out = torch.full((WORLD * count,), 99, dtype=dtype)
                    comm.all_gather(mine.data_ptr(), out.data_ptr(), count, dcode, CODE[name])
                    every = torch.cat([inputs(count, dtype, r) for r in range(WORLD)])
                    if not torch.equal(out, every):
                        wrong.append(f"all_gather {dtype} {count} {name}")
                for name in ("ring", "tree", "nccl"):  # one slot: heap tree; several: the chain
                    x = inputs(count, dtype, rank)
                    comm.broadcast(x.data_ptr(), count, dcode, 1, CODE[name])
                    if not torch.equal(x, inputs(count, dtype, 1)):
                        wrong.append(f"broadcast {dtype} {count} {name}")


def point_to_point(comm, rank, wrong):
    count = 3 * (SLOT // 4) + 5  # crosses staging slots
    send = inputs(count, torch.int32, rank)
    recv = torch.full_like(send, -1)
    nxt, prv = (rank + 1) % WORLD, (rank - 1) % WORLD
    comm.send_recv(send.data_ptr(), 4 * count, nxt, recv.data_ptr(), 4 * count, prv)
    if not torch.equal(recv, inputs(count, torch.int32, prv)):
        wrong.append("send_recv ring shift")


def recvs_into_output(comm, rank, barrier, out):
    # In place, 4 slices per chunk: the all-gather phase's (n-1) receives per slice land in the
    # output itself; the reduce-scatter phase's go to staging.
    count = WORLD * 4 * (SLOT // 4)
    x = inputs(count, torch.float32, rank)
    lo, hi = x.data_ptr(), x.data_ptr() + 4 * count
    barrier.wait()
    if rank == 0:
        fake.fake_reset_stats()
    barrier.wait()
    comm.all_reduce(x.data_ptr(), x.data_ptr(), count, 0, 0, CODE["ring"])
    barrier.wait()
    out["ring_into_output"] = fake.fake_recvs_in(rank, ctypes.c_uint64(lo), ctypes.c_uint64(hi))
    out["ring_all"] = fake.fake_recvs_in(rank, ctypes.c_uint64(0), ctypes.c_uint64(2**64 - 1))
    out["groups_used"] = sum(fake.fake_group_messages(g) > 0 for g in range(64))


def errors(comm, rank, out):
    out["resolve_auto"] = comm.resolve(CODE["auto"], 1 << 20)
    x = torch.zeros(8)
    try:
        comm.reduce_scatter(x.data_ptr(), x.data_ptr(), 4, 0, 0, CODE["tree"])
    except ValueError as e:
        out["tree"] = str(e)
    comm.all_reduce(x.data_ptr(), x.data_ptr(), 8, 0, 0, CODE["ring"])  # still usable
    comm.close()
    try:
        comm.all_reduce(x.data_ptr(), x.data_ptr(), 8, 0, 0, CODE["ring"])
    except CommError as e:
        out["closed"] = str(e)


def run_rank(rank, lanes_ids, barrier, results):
    out, wrong = {"rank": rank}, []
    try:
        comm = make(rank, lanes_ids)
        out["lanes"] = comm.lanes
        collectives(comm, rank, wrong)
        point_to_point(comm, rank, wrong)
        recvs_into_output(comm, rank, barrier, out)
        errors(comm, rank, out)
    except BaseException as e:
        wrong.append(f"raised {type(e).__name__}: {e}")
        barrier.abort()
    out["wrong"] = wrong
    results[rank] = out


lanes = int(sys.argv[3])
ids = [_C.nccl_unique_id() for _ in range(lanes)]
barrier = threading.Barrier(WORLD)
results = [None] * WORLD
threads = [threading.Thread(target=run_rank, args=(r, ids, barrier, results)) for r in range(WORLD)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(results))
"""


def _run(tmp_path: Path, world_size: int, lanes: int):
    lib = _build_fake_nccl(tmp_path, f"fake-{world_size}-{lanes}", "VERSION=22805")
    env = {**os.environ, "DK_NCCL_LIBRARY": str(lib), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    print(f"seed {SEED}")
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(world_size), str(SEED), str(lanes)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("world_size,lanes", [(3, 2), (2, 1)])
def test_every_collective_against_float64_and_the_lanes(tmp_path, world_size, lanes):
    results = _run(tmp_path, world_size, lanes)
    slices = 4  # recvs_into_output: 4 slices per chunk
    for out in results:
        assert out["wrong"] == [], out
        assert out["lanes"] == lanes
        # The all-gather phase receives straight into the output; the reduce phase into staging.
        assert out["ring_into_output"] == (world_size - 1) * slices, out
        assert out["ring_all"] == 2 * (world_size - 1) * slices, out
        assert out["groups_used"] == lanes, out  # slices alternate over every lane
        assert out["resolve_auto"] == 4  # "auto" is NCCL's own collective on this route
        assert out["tree"].startswith(f"[rank {out['rank']}] reduce_scatter: algorithm must be")
        assert "no tree" in out["tree"]
        assert "closed" in out["closed"], out
