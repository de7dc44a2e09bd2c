"""Checks that run on every rank under torchrun across emulated hosts (tests/test_multihost.py).

    python tests/multihost_checks.py OUT_DIR check [check ...]      (one rank; torchrun's env)
    python tests/multihost_checks.py --driver [dist_kernels.train args]   (the driver, below)

Each check is a function below; its return value is pickled to ``OUT_DIR/<check>.<rank>.pkl``
or its traceback written to ``OUT_DIR/<check>.<rank>.err``, and the next check runs. The
engine checks reuse the rank functions of the single-host tests, so each is held to its
single-host test's reference and tolerance (the assertions are in tests/test_multihost.py).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import pickle
import sys
import time
import traceback
import warnings

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import dist_kernels as dk  # noqa: E402

SEED = 2027
TIMEOUT = datetime.timedelta(seconds=90)
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.int8,
    torch.uint8,
)
OPS = ("SUM", "AVG", "PROD", "MAX", "MIN")
KINDS = {"auto": "0", "replicated": "0", "multi_leader": "3", "flat": "0"}  # kind: chunks


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _values(rank: int, count: int, salt: int = 0) -> torch.Tensor:
    """Small integers 1..3, different per rank: sums, products (3^4 = 81) and averages of
    them are exact in every dtype, so a result must equal the float64 reference exactly."""
    return ((torch.arange(count, dtype=torch.int64) * 7 + 3 * rank + salt) % 3 + 1).double()


def _reference(op: str, stack: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n = stack.shape[0]
    if op == "AVG" and not dtype.is_floating_point:
        return torch.div(stack.sum(0).long(), n, rounding_mode="trunc").double()
    return {
        "SUM": stack.sum(0),
        "AVG": stack.sum(0) / n,
        "PROD": stack.prod(0),
        "MAX": stack.max(0).values,
        "MIN": stack.min(0).values,
    }[op]


def _all_reduce_matrix(comm, digests):
    n, r = comm.world_size, comm.rank
    for dtype in DTYPES:
        for op in OPS:
            for count in (1, 5, 1003):  # 1003 = 3 chunks of 334 (+ a tail of 1 element at R=2)
                t = _values(r, count).to(dtype)
                comm.all_reduce(t, op=op)
                ref = _reference(op, torch.stack([_values(q, count) for q in range(n)]), dtype)
                assert torch.equal(t.double(), ref), f"all_reduce {dtype} {op} {count}: {t}"
                digests.append(_digest(t))
    # random floats: bits identical on every rank (checked by the test), within rounding of
    # the float64 sum: at most n roundings (host partial sums, the cross-host sum, the final
    # cast), each within eps of the sum of magnitudes
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(SEED + r)
        x = torch.randn(4099, generator=gen).to(dtype)
        xs = [
            torch.randn(4099, generator=torch.Generator().manual_seed(SEED + q)).to(dtype)
            for q in range(n)
        ]
        t = x.clone()
        comm.all_reduce(t)
        exact = torch.stack([v.double() for v in xs]).sum(0)
        bound = n * torch.finfo(dtype).eps * torch.stack([v.double().abs() for v in xs]).sum(0)
        assert ((t.double() - exact).abs() <= bound).all(), f"random {dtype}"
        digests.append(_digest(t))


def _gather_scatter(comm, digests):
    n, r = comm.world_size, comm.rank
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
        for op in ("SUM", "AVG", "MAX"):
            for count in (1, 7, 501):
                out = torch.empty(count, dtype=dtype)
                comm.reduce_scatter(out, _values(r, n * count, 1).to(dtype), op=op)
                full = torch.stack([_values(q, n * count, 1) for q in range(n)])
                ref = _reference(op, full, dtype)[r * count : (r + 1) * count]
                assert torch.equal(out.double(), ref), f"reduce_scatter {dtype} {op} {count}"
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.float64):
        for count in (1, 7, 501):
            out = torch.empty(n * count, dtype=dtype)
            comm.all_gather(out, _values(r, count, 2).to(dtype))
            ref = torch.cat([_values(q, count, 2) for q in range(n)])
            assert torch.equal(out.double(), ref), f"all_gather {dtype} {count}"
            digests.append(_digest(out))
    for src in range(n):
        for dtype, count in ((torch.float32, 1), (torch.int32, 7), (torch.uint8, 1001)):
            t = _values(r, count, 3).to(dtype)
            comm.broadcast(t, src)
            assert torch.equal(t.double(), _values(src, count, 3)), f"broadcast {src} {dtype}"


def _all_to_all(comm):
    n, r = comm.world_size, comm.rank

    def count(src, dst):  # uneven, some empty, different per pair
        return (src + 2 * dst) % 3 + (src == dst)

    sends = [count(r, p) for p in range(n)]
    recvs = [count(p, r) for p in range(n)]
    inp = torch.cat([torch.arange(sends[p]) + 100 * r + 10 * p for p in range(n)]).float()
    out = torch.full((sum(recvs),), -1.0)
    comm.all_to_all(out, inp, sends, recvs)
    ref = torch.cat([torch.arange(recvs[p]) + 100 * p + 10 * r for p in range(n)]).float()
    assert torch.equal(out, ref), f"all_to_all uneven: {out} != {ref}"
    inp = torch.arange(3 * n, dtype=torch.int64) + 1000 * r
    out = torch.empty_like(inp)
    comm.all_to_all(out, inp)
    ref = torch.cat([torch.arange(3 * r, 3 * r + 3) + 1000 * p for p in range(n)])
    assert torch.equal(out, ref), "all_to_all equal blocks"


def _point_to_point_and_async(comm):
    n, r = comm.world_size, comm.rank
    peers = {"cross": (r + n // 2) % n, "local": r ^ 1} if n == 4 else {"cross": r ^ 1}
    got = {k: torch.empty(6) for k in peers}
    works = [comm.irecv(got[k], p) for k, p in peers.items()]  # receives posted first
    works += [comm.isend(torch.full((6,), float(r)), p) for p in peers.values()]
    for w in works:
        w.wait()
    for k, p in peers.items():
        assert torch.equal(got[k], torch.full((6,), float(p))), (k, got[k])
    if r < peers["cross"]:
        comm.send(torch.arange(5.0) + r, peers["cross"])
    else:
        t = torch.empty(5)
        comm.recv(t, peers["cross"])
        assert torch.equal(t, torch.arange(5.0) + peers["cross"])
    # tags received in the other order than sent: across hosts (gloo) and inside one (ours)
    for kind, p in peers.items():
        if r < p:  # isend: gloo may hold a send until its tag's receive is posted
            sent = [comm.isend(torch.full((4,), 10.0 * tag + r), p, tag=tag) for tag in (1, 2)]
            for w in sent:
                w.wait()
        else:
            for tag in (2, 1):
                t = torch.empty(4)
                comm.recv(t, p, tag=tag)
                assert torch.equal(t, torch.full((4,), 10.0 * tag + p)), (kind, tag, t)
    try:  # gloo takes nonnegative tags only: refused before anything is sent
        comm.send(torch.ones(1), peers["cross"], tag=-1)
        raise AssertionError("a negative tag across hosts was taken")
    except ValueError as e:
        assert "nonnegative" in str(e) and f"[rank {r}]" in str(e), e
    # several collectives in flight at once, then waited in reverse
    tensors = [torch.full((c,), float(r + 1)) for c in (3, 70000, 1)]
    gathered = torch.empty(n * 4)
    works = [comm.all_reduce(t, async_op=True) for t in tensors]
    works.append(comm.all_gather(gathered, torch.full((4,), float(r)), async_op=True))
    buf = comm.empty((1003,))  # registered memory through the same paths
    buf.fill_(float(r))
    works.append(comm.all_reduce(buf, async_op=True))
    for w in reversed(works):
        w.wait()
        assert w.is_completed()
    total = n * (n + 1) / 2
    for t in tensors:
        assert torch.equal(t, torch.full_like(t, total)), t
    assert torch.equal(gathered, torch.arange(n).float().repeat_interleave(4))
    assert torch.equal(buf, torch.full_like(buf, n * (n - 1) / 2))
    comm.barrier()


def _communicators():
    """(label, group) of the world (H hosts x R ranks) and of one rank per host (R = 1)."""
    world = dist.get_world_size()
    per_host = int(os.environ["LOCAL_WORLD_SIZE"])
    yield "x" + str(per_host), None
    if per_host > 1:
        groups = [dist.new_group(list(range(lr, world, per_host))) for lr in range(per_host)]
        yield "x1", groups[int(os.environ["LOCAL_RANK"])]


def collectives():
    """Every collective on the world and on one rank per host, in every hierarchical kind."""
    out = {}
    for label, group in list(_communicators()):
        for kind, chunks in KINDS.items():
            os.environ["DK_INTER_HOST_ALGO"], os.environ["DK_INTER_HOST_CHUNKS"] = kind, chunks
            digests = []
            with dk.Communicator(group=group, timeout=TIMEOUT) as comm:
                backend = type(comm._backend).__name__
                assert backend == "HierarchicalBackend", backend
                _all_reduce_matrix(comm, digests)
                _gather_scatter(comm, digests)
                _all_to_all(comm)
                _point_to_point_and_async(comm)
            out[(label, kind)] = digests
    os.environ.pop("DK_INTER_HOST_ALGO")
    os.environ.pop("DK_INTER_HOST_CHUNKS")
    return out


def dk_backend():
    """torch DDP and FSDP2 over a "dk" group spanning the hosts. DDP over dk against DDP
    over gloo: four ranks sum in another order than gloo's ring, so the parameters agree to
    FP32 rounding, not bit for bit (at two ranks, test_torch_backend's, they do)."""
    import test_torch_backend as tb

    gloo, ours = tb._ddp_train(dist.group.WORLD, 6), tb._ddp_train(tb._dk_group(), 6)
    torch.manual_seed(tb.SEED)
    initial = list(tb._Net().parameters())
    return {
        "ddp_moved": any(not torch.equal(a, b) for a, b in zip(ours, initial)),
        "ddp_vs_gloo": max(
            ((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours, gloo)
        ),
        "fsdp2": tb._fsdp2_vs_single(3),
    }


def ddp():
    import test_ddp as td

    td._init_comm()
    cases = {
        "mlp": td._run_case(td.MLP, "dense", bucket_cap_mb=0.004, first_bucket_mb=0.001),
        "transformer": td._run_case(td.TinyTransformer, "tokens", bucket_cap_mb=0.02),
        "no_sync": td._run_case(td.MLP, "dense", micro=3, bucket_cap_mb=0.004),
    }
    dk.get_default_communicator().close()
    return cases


ZERO_CASES = [(1, "adamw", {}), (2, "sgd", {}), (2, "fused", {"grad_dtype": torch.bfloat16})]
STAGE3_CASES = [("adamw", {}), ("sgd", {"dtype": torch.bfloat16, "clip": 0.05})]


def zero():
    import test_zero as tz
    import test_zero_stage3 as tz3

    return {"zero12": tz._equivalence_cases(ZERO_CASES), "zero3": tz3._stage3_cases(STAGE3_CASES)}


PIPELINE_CASES = [("1f1b", 8, False), ("interleaved-1f1b", 8, True)]
HYBRID_CASES = [("1f1b", False, None)]


def pipeline():
    """Four stages on four ranks (two per host), and data x pipeline (dp groups across)."""
    import test_pipeline_runtime as tp

    return {"stages": tp._rank_cases(PIPELINE_CASES), "hybrid": tp._rank_hybrid(HYBRID_CASES)}


def tensor_parallel():
    """tp groups kept on a host by the mesh (no warning), the layers exact against float64;
    a mesh whose tp group spans hosts warns, naming it."""
    import test_tensor_parallel as ttp

    with warnings.catch_warnings(record=True) as inside:
        warnings.simplefilter("always")
        mesh = dk.ProcessMesh(dp=2, tp=2)
    names = ("_check_pairs", "_column_cases", "_row_cases", "_cross_entropy_cases")
    diffs = {name: getattr(ttp, name)(mesh.tp_comm) for name in names}
    mesh.close()
    with warnings.catch_warnings(record=True) as across:
        warnings.simplefilter("always")
        dk.ProcessMesh(dp=1, tp=4).close()
    return {
        "diffs": diffs,
        "tp_ranks": mesh.tp_ranks,
        "warned_inside": [str(w.message) for w in inside],
        "warned_across": [str(w.message) for w in across],
    }


def host_loss():
    """Back-to-back all-reduces until a host is killed (the test does it once every rank has
    written its ready file); the survivors return what they raised and when."""
    out_dir = sys.argv[1]
    comm = dk.Communicator(timeout=datetime.timedelta(seconds=60))
    t = torch.ones(1 << 18)
    comm.all_reduce(t)
    open(os.path.join(out_dir, f"ready.{dist.get_rank()}"), "w").close()
    try:
        while True:
            comm.all_reduce(t)
    except dk.CommError as e:
        return {"error": str(e), "raised_at": time.time(), "type": type(e).__name__}


CHECKS = {
    f.__name__: f
    for f in (collectives, dk_backend, ddp, zero, pipeline, tensor_parallel, host_loss)
}


HOLD_ENV = "DK_TEST_HOLD_AFTER_CHECKPOINT"


def driver(argv) -> int:
    """``python -m dist_kernels.train argv``; with ``DK_TEST_HOLD_AFTER_CHECKPOINT=STEP:DIR``
    in the environment, this rank stops once that step's checkpoint is complete (every rank
    has passed its closing barrier), touches ``DIR/held.<rank>`` and sleeps until killed.

    The host-restart test gives it to the first launch of the host it kills: the other host's
    ranks then wait in step STEP + 1 for the held ones, so the kill always lands mid-run. With
    the driver running free, its last steps took less time than the test's poll and kill
    (tiny model), the job sometimes ended before the kill, and the host started again found
    no one to rendezvous with (host0's agent, its workers done, sat in its exit barrier)."""
    from dist_kernels.train import checkpoints, cli

    hold = os.environ.get(HOLD_ENV)
    if hold:
        step_text, hold_dir = hold.split(":", 1)
        save = checkpoints.save

        def save_then_hold(cfg, engine, ident, step, shard, barrier):
            path = save(cfg, engine, ident, step, shard, barrier)
            if step == int(step_text):
                open(os.path.join(hold_dir, f"held.{barrier.rank}"), "w").close()
                while True:
                    time.sleep(3600)
            return path

        checkpoints.save = save_then_hold  # the driver calls it as checkpoints.save
    return cli.main(argv)


def main(out_dir: str, names) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=TIMEOUT)
    rank = dist.get_rank()
    for name in names:
        path = os.path.join(out_dir, f"{name}.{rank}")
        try:
            value = CHECKS[name]()
        except BaseException:  # noqa: BLE001 - the test reads it
            with open(path + ".err", "w") as f:
                f.write(traceback.format_exc())
            continue
        with open(path + ".tmp", "wb") as f:
            pickle.dump(value, f)
        os.replace(path + ".tmp", path + ".pkl")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--driver":
        sys.exit(driver(sys.argv[2:]))
    sys.exit(main(sys.argv[1], sys.argv[2:]))
