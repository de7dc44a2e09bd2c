"""python -m dist_kernels.bench: end to end at tiny sizes, and its reference and size policy.

The end-to-end runs spawn real ranks (the benchmark's own launcher) and read back its JSON:
every row must be correct (#wrong == 0 for our algorithms and the Gloo baseline), carry the
nccl-tests columns, and satisfy busbw = algbw * factor. Timings are never asserted.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from dist_kernels.bench import cli as bench
from dist_kernels.bench import ops

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLACEMENT_KEYS = {"time_us", "p50_us", "p99_us", "algbw", "busbw", "wrong", "vs_baseline"}
PLACEMENT_KEYS.add("error")
ROW_KEYS = {"algorithm", "size", "count", "type", "redop", "root", "iters", "warmup"}


def _run_bench(tmp_path, *argv: str) -> dict:
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    command = [sys.executable, "-m", "dist_kernels.bench", *argv, "--json", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    print(done.stdout)
    assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"
    return {"stdout": done.stdout, **json.loads(out.read_text())}


def _check_rows(
    result: dict, op: str, world_size: int, algorithms: list, baseline: str = "gloo"
) -> None:
    meta, rows = result["meta"], result["rows"]
    assert meta["world_size"] == world_size and meta["op"] == op
    factor = ops.bus_factor(op, world_size)
    assert meta["busbw_factor"] == pytest.approx(factor)
    assert {r["algorithm"] for r in rows} == {*algorithms, *([baseline] if baseline else [])}
    assert meta["placements"] == list(ops.placements(op))
    for row in rows:
        assert ROW_KEYS <= set(row), row
        for placement in ops.PLACEMENTS:
            cell = row[placement]
            assert PLACEMENT_KEYS <= set(cell), (row["algorithm"], placement, cell)
            if placement not in meta["placements"]:  # printed n/a, with the reason
                assert cell["error"] == ops.NO_PLACEMENT[op, placement]
                assert cell["wrong"] is None and cell["vs_baseline"] is None
                continue
            assert cell["error"] is None, (row["algorithm"], row["size"], placement, cell)
            assert cell["wrong"] == 0, (row["algorithm"], row["size"], placement, cell)
            assert 0 < cell["p50_us"] <= cell["p99_us"], (row["algorithm"], cell)
            assert cell["time_us"] > 0
            assert cell["algbw"] == pytest.approx(row["size"] / cell["time_us"] / 1e3)
            assert cell["busbw"] == pytest.approx(cell["algbw"] * factor)
    for placement in meta["placements"]:  # the ratio is the baseline's time over ours, same size
        gloo = {r["size"]: r[placement]["time_us"] for r in rows if r["algorithm"] == baseline}
        for row in rows if baseline else ():
            ratio = gloo[row["size"]] / row[placement]["time_us"]
            if row["algorithm"] != "gloo":
                assert row[placement]["vs_baseline"] == pytest.approx(ratio)


def test_all_reduce_end_to_end(tmp_path):
    plot = tmp_path / "busbw.png"
    argv = ["-b", "8", "-e", "4096", "-f", "8", "--iters", "3", "--warmup", "1"]
    result = _run_bench(tmp_path, *argv, "--plot", str(plot))
    # torchdk: dist.all_reduce on a "dk" group, on the same communicator
    _check_rows(result, "all_reduce", 2, ["ring", "tree", "auto", "torchdk"])
    assert "# ProcessGroup layer (torchdk over auto): <= 64 KiB:" in result["stdout"]
    assert sorted({r["size"] for r in result["rows"]}) == [8, 64, 512, 4096]
    assert all(r["iters"] == 3 and r["warmup"] == 1 for r in result["rows"])
    meta = result["meta"]
    assert meta["memcpy"]["best_gbps"] > 0 and meta["machine"]["cpus"] >= 1
    assert "build_info" in meta
    assert meta["command"].startswith("python -m dist_kernels.bench " + " ".join(argv))
    assert "memcpy ceiling" in result["stdout"] and "#wrong" in result["stdout"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "op, extra, expected",
    [
        # reduce_scatter has no tree (--algorithm all asks for one): no tree row
        ("reduce_scatter", ["--redop", "max", "--dtype", "bfloat16"], ["ring", "auto"]),
        # each run spawns ranks that import torch (~5 s quiet, ~25 s on a loaded machine)
        pytest.param(
            "all_gather",
            ["--dtype", "int32", "--algorithm", "ring,one_shot,auto"],
            ["ring", "one_shot", "auto"],
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "broadcast", ["--root", "2", "--dtype", "float16"], ["default"], marks=pytest.mark.slow
        ),
    ],
)
def test_other_ops_three_ranks(tmp_path, op, extra, expected):
    # three ranks on this 2-core machine: oversubscribed, and n does not divide the sizes
    argv = ["--nproc", "3", "--op", op, "-b", "8", "-e", "512", "-f", "64"]
    result = _run_bench(tmp_path, *argv, "--iters", "2", "--warmup", "1", *extra)
    algorithms = result["meta"]["algorithms"]
    # rows are named by what ran; the torch-API row (dist.* on a "dk" group) follows on CPU
    assert algorithms == expected + ["torchdk"], algorithms
    _check_rows(result, op, 3, algorithms)
    if op in ("reduce_scatter", "all_gather"):
        assert all(r["count"] % 3 == 0 for r in result["rows"])


@pytest.mark.parametrize(
    "nproc, extra",
    [
        (2, ["--dtype", "int8"]),  # registered buffers (the default)
        (3, ["--dtype", "bfloat16", "--buffers", "plain", "--redop", "max", "--root", "1"]),
    ],
)
def test_sendrecv_end_to_end(tmp_path, nproc, extra):
    argv = ["--nproc", str(nproc), "--op", "sendrecv", "-b", "8", "-e", "64K", "-f", "64"]
    result = _run_bench(tmp_path, *argv, "--iters", "2", "--warmup", "1", *extra)
    _check_rows(result, "sendrecv", nproc, ["default", "torchdk"])
    meta, rows = result["meta"], result["rows"]
    assert meta["placements"] == ["out_of_place"] and meta["summary_placement"] == "out_of_place"
    assert sorted({r["size"] for r in rows}) == [8, 512, 32768]
    assert all(r["redop"] == "none" and r["root"] == -1 for r in rows)  # both ignored
    assert "summary (out-of-place" in result["stdout"]
    assert "default: <= 64 KiB" in result["stdout"]


def test_reduce_scatter_rows_are_named_by_the_algorithm_that_ran():
    from dist_kernels.comm import algorithms

    cpu = {name: name for name in algorithms.ACCEPTED["cpu"]["all_gather"]}
    ring_only = {"auto": "ring", "ring": "ring"}
    cuda = {"auto": "nccl", "ring": "ring", "nccl": "nccl"}
    chosen, note = ops._table_choices("reduce_scatter", ring_only, ["ring", "tree", "auto"])
    assert chosen == ["ring"]
    assert "no tree algorithm" in note and "auto runs the ring" in note
    chosen, note = ops._table_choices("reduce_scatter", ring_only, ["auto"])
    assert chosen == ["ring"] and "labelled ring" in note
    chosen, note = ops._table_choices("all_gather", cuda, ["ring", "tree", "auto"])
    assert chosen == ["ring"] and "all_gather auto is NCCL's own" in note
    with pytest.raises(ValueError, match="no tree"):
        ops._table_choices("reduce_scatter", ring_only, ["tree"])
    # The CPU communicator runs ring, one-shot and auto's pick, each a row of its own.
    chosen, note = ops._table_choices("all_gather", cpu, ["ring", "tree", "auto", "one_shot"])
    assert chosen == ["ring", "auto", "one_shot"] and "all_gather has no tree" in note


def test_algorithm_lists():
    assert bench.parse_args(["--algorithm", "ring,one_shot,auto"]).algorithm == "ring,one_shot,auto"
    assert bench.parse_args(["--algorithm", "all"]).algorithm == "all"
    for bad in ("ring,ring", "ring,bogus", "all,ring", ""):
        with pytest.raises(SystemExit):
            bench.parse_args(["--algorithm", bad])


def test_sendrecv_needs_two_ranks():
    with pytest.raises(SystemExit):
        bench.parse_args(["--op", "sendrecv", "--nproc", "1"])
    assert bench.parse_args(["--op", "sendrecv", "--nproc", "2"]).op == "sendrecv"


def test_cuda_spawns_at_most_one_rank_per_gpu(monkeypatch, capsys):
    """World size 1 on one GPU is --nproc 1; two spawned ranks on it would make NCCL refuse
    ("Duplicate GPU detected"), so the benchmark says so before it starts."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("RANK", raising=False)
    assert bench.parse_args(["--device", "cuda", "--nproc", "1"]).nproc == 1
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cuda", "--nproc", "2"])
    assert "1 CUDA device(s)" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")  # under torchrun the launcher decides
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert bench.parse_args(["--device", "cuda"]).device == "cuda"


# -- the reference itself ---------------------------------------------------------------------


def _torch_collective(case: ops.Case, inputs: list) -> torch.Tensor:
    """Rank ``case.rank``'s correct output from torch ops on every rank's input tensor."""
    stack = torch.stack(inputs)
    if case.op == "sendrecv":
        return inputs[(case.rank - 1) % case.world_size].clone()
    if case.op == "broadcast":
        return inputs[case.root].clone()
    if case.op == "all_gather":
        return torch.cat(inputs)
    wide = stack.double() if case.dtype.is_floating_point else stack.long()
    reduced = {
        "sum": lambda: wide.sum(0),
        "prod": lambda: wide.prod(0),
        "max": lambda: wide.max(0).values,
        "min": lambda: wide.min(0).values,
        "avg": lambda: (
            wide.sum(0) / case.world_size
            if case.dtype.is_floating_point
            else torch.div(wide.sum(0), case.world_size, rounding_mode="trunc")
        ),
    }[case.redop]().to(case.dtype)
    if case.op == "reduce_scatter":
        return reduced[case.rank * case.shard : (case.rank + 1) * case.shard]
    return reduced


@pytest.mark.parametrize("dtype", list(ops.DTYPES.values()), ids=list(ops.DTYPES))
@pytest.mark.parametrize("redop", ops.REDOPS)
@pytest.mark.parametrize("world_size", [2, 5])
def test_reference_accepts_right_and_counts_wrong(dtype, redop, world_size):
    count = 3 * world_size * 7
    for op in ops.OPS:
        case = ops.Case(op, dtype, redop, world_size - 1, count, world_size - 1, world_size)
        inputs = []
        for rank in range(world_size):
            tensor = torch.empty(case.input_count(), dtype=dtype)
            ops.Case(op, dtype, redop, case.root, count, rank, world_size).fill_input(tensor)
            inputs.append(tensor)
        output = _torch_collective(case, inputs)
        assert case.wrong(output) == 0, (op, dtype, redop, world_size)
        corrupted = output.clone()
        corrupted[-1] = ops.sentinel(dtype)
        assert case.wrong(corrupted) == 1, (op, dtype, redop, world_size)
        for name, wrong in _wrong_outputs(output).items():
            assert case.wrong(wrong) > 0, (name, op, dtype, redop, world_size)


def _wrong_outputs(output: torch.Tensor) -> dict:
    """Outputs a broken collective could give; floats off by less than 1 included (a check
    that casts to int64 would truncate them back to the right integer)."""
    wrong = {"zeros": torch.zeros_like(output), "doubled": output * 2}
    wrong["doubled"][0] = 1  # some element nonzero, whatever the output held
    if output.dtype.is_floating_point:
        for delta in (0.9, -0.9):  # 2 -> 2.9, -3 -> -3.9: an int64 cast truncates them back
            nudged = output.clone()
            nudged[0] += delta
            wrong[f"one element {delta:+}"] = nudged
    # where the right answer is all zeros (integer AVG can be), "zeros" is not wrong
    return {name: w for name, w in wrong.items() if not torch.equal(w, output)}


@pytest.mark.parametrize("dtype", list(ops.DTYPES.values()), ids=list(ops.DTYPES))
@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_sendrecv_check_catches_wrong_peer_and_skipped_receive(dtype, world_size):
    """The benchmark's own check path (make_buffers, prepare_check, bind, wrong) on fake
    exchanges: only receiving the previous rank's input passes."""
    count, rank = 37, world_size - 1

    def input_of(peer: int) -> torch.Tensor:
        tensor = torch.empty(count, dtype=dtype)
        ops.Case("sendrecv", dtype, "sum", 0, count, peer, world_size).fill_input(tensor)
        return tensor

    exchanges = {
        "right": lambda op, out, inp: out.copy_(input_of((rank - 1) % world_size)),
        "own input": lambda op, out, inp: out.copy_(inp),
        "nothing received": lambda op, out, inp: None,
    }
    if world_size > 2:  # on 2 ranks the next rank is the previous one
        exchanges["from rank+1"] = lambda op, out, inp: out.copy_(input_of((rank + 1) % world_size))
    case = ops.Case("sendrecv", dtype, "sum", 0, count, rank, world_size)
    for name, exchange in exchanges.items():
        buffers = ops.make_buffers(case, "out_of_place", lambda n: torch.empty(n, dtype=dtype))
        ops.prepare_check(case, buffers)
        buffers.bind(exchange)()  # run("sendrecv", out, inp), as the benchmark calls it
        wrong = case.wrong(buffers.result)
        if name == "right":
            assert wrong == 0
        else:  # the inputs of two ranks differ in most elements
            assert wrong > count // 2, (name, wrong)
    with pytest.raises(ValueError, match="no in-place form"):
        ops.make_buffers(case, "in_place", lambda n: torch.empty(n, dtype=dtype))


class _FakeWork:
    def __init__(self, calls: list, name: str) -> None:
        self.calls, self.name = calls, name

    def wait(self) -> bool:
        self.calls.append(("wait", self.name))
        return True


class _FakeCpuComm:
    """Records the point-to-point calls ours_runner makes (CPU: isend / irecv)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size, self.calls = rank, world_size, []

    def irecv(self, tensor, src):
        self.calls.append(("irecv", tensor, src))
        return _FakeWork(self.calls, "irecv")

    def isend(self, tensor, dst):
        self.calls.append(("isend", tensor, dst))
        return _FakeWork(self.calls, "isend")


class _FakeCudaComm(_FakeCpuComm):
    """The CUDA communicator also offers send_recv: one NCCL group for both directions."""

    def send_recv(self, send, dst, recv, src):
        self.calls.append(("send_recv", send, dst, recv, src))


def test_sendrecv_runner_posts_receive_first_and_waits_both():
    out, inp = torch.zeros(4), torch.ones(4)
    comm = _FakeCpuComm(rank=0, world_size=3)
    ops.ours_runner(comm, "default", ops.ReduceOp.SUM, 0)("sendrecv", out, inp)
    assert [c[0] for c in comm.calls] == ["irecv", "isend", "wait", "wait"]
    assert comm.calls[0][1] is out and comm.calls[0][2] == 2  # from rank - 1
    assert comm.calls[1][1] is inp and comm.calls[1][2] == 1  # to rank + 1
    assert {c[1] for c in comm.calls[2:]} == {"irecv", "isend"}
    cuda = _FakeCudaComm(rank=2, world_size=3)
    ops.ours_runner(cuda, "default", ops.ReduceOp.SUM, 0)("sendrecv", out, inp)
    assert cuda.calls == [("send_recv", inp, 0, out, 1)]


class _FakeCollectiveComm:
    """Records the collectives a runner's calls make, with their arguments."""

    def __init__(self) -> None:
        self.calls, self.rank, self.world_size = [], 0, 2

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


def _bound_args(op: str, call) -> dict:
    import inspect

    import dist_kernels as dk

    _, args, kwargs = call
    bound = inspect.signature(getattr(dk.Communicator, op)).bind(None, *args, **kwargs)
    bound.apply_defaults()
    return {k: id(v) if torch.is_tensor(v) else v for k, v in bound.arguments.items()}


@pytest.mark.parametrize(
    "op, algorithm",
    [(op, a) for op in ("all_reduce", "reduce_scatter", "all_gather") for a in ("default", "ring")]
    + [("broadcast", "default")],  # broadcast takes no algorithm
)
def test_bound_call_is_the_collective_as_the_runner_makes_it(op, algorithm):
    """bind() times the runner's direct call (no dispatch on the op per call): it must make
    the very call run(op, ...) makes, and that call must be the collective with this
    benchmark's arguments; the out-of-place copy-in form keeps run()."""
    direct, generic = _FakeCollectiveComm(), _FakeCollectiveComm()
    out, inp = torch.zeros(4), torch.ones(8)
    tensors = (out,) if op in ("all_reduce", "broadcast") else (out, inp)
    buffers = ops.Buffers(op, inp, out, tensors)
    call = buffers.bind(ops.ours_runner(direct, algorithm, ops.ReduceOp.MAX, 1))
    assert isinstance(call, functools.partial)
    call()
    ops.ours_runner(generic, algorithm, ops.ReduceOp.MAX, 1)(op, *tensors)
    assert len(direct.calls) == 1 and direct.calls[0][0] == op
    # the same arguments once bound to the Communicator method's signature (one may pass by
    # position what the other passes by keyword); tensors compared by identity
    assert _bound_args(op, direct.calls[0]) == _bound_args(op, generic.calls[0])
    extra = {} if algorithm == "default" else {"algorithm": algorithm}
    expected = {  # what a script would write
        "all_reduce": ((out,), {"op": ops.ReduceOp.MAX, **extra}),
        "reduce_scatter": ((out, inp), {"op": ops.ReduceOp.MAX, **extra}),
        "all_gather": ((out, inp), extra),
        "broadcast": ((out,), {"src": 1}),
    }[op]
    assert _bound_args(op, direct.calls[0]) == _bound_args(op, (op, *expected))
    copied = ops.Buffers(op, inp, out, tensors, copy_in=True).bind(
        ops.ours_runner(_FakeCollectiveComm(), algorithm, ops.ReduceOp.MAX, 1)
    )
    assert not isinstance(copied, functools.partial)


def test_inputs_vary_across_ranks_and_elements():
    first, second = (ops.rank_values(r, 0, 64, torch.float32, "sum", 2) for r in (0, 1))
    assert not torch.equal(first, second) and len(set(first.tolist())) > 3


def test_element_count_and_factors():
    assert ops.element_count("all_reduce", 8, 4, 3) == 2
    assert ops.element_count("all_gather", 8, 4, 3) == 3  # at least one element per rank
    assert ops.element_count("reduce_scatter", 4096, 4, 3) == 1023
    assert ops.bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert ops.bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert ops.bus_factor("broadcast", 4) == 1.0
    assert ops.bus_factor("sendrecv", 4) == 1.0  # nccl-tests: busbw = algbw
    assert ops.element_count("sendrecv", 8, 4, 3) == 2


def test_sizes_and_size_aware_iterations():
    args = bench.parse_args(["-b", "8", "-e", "64M", "-f", "4", "--iters", "40", "--warmup", "4"])
    assert bench.sizes(args) == [8 * 4**k for k in range(12)]
    assert bench.iterations(8, args) == (40, 4)
    iters, warmup = bench.iterations(64 << 20, args)
    assert iters == max(args.min_iters, math.ceil(args.iter_bytes / (64 << 20)))
    assert 1 <= warmup <= 4
    assert bench.parse_size("64KiB") == 65536 and bench.parse_size("16M") == 16 << 20
    with pytest.raises(SystemExit):
        bench.parse_args(["-b", "1M", "-e", "1K"])


def test_report_prints_refused_combinations_as_na():
    from dist_kernels.bench import report

    ok = {"time_us": 10.0, "p50_us": 9.0, "p99_us": 30.0, "algbw": 0.8, "busbw": 0.8}
    ok.update(wrong=0, vs_baseline=50.0)
    refused = {"time_us": None, "algbw": None, "busbw": None, "wrong": None}
    refused["error"] = "RuntimeError: no integer avg"
    common = {"size": 8, "count": 2, "type": "int32", "redop": "avg", "root": -1}
    common.update(iters=3, warmup=1, busbw_factor=1.0)
    rows = [
        {**common, "algorithm": "gloo", "out_of_place": refused, "in_place": refused},
        {**common, "algorithm": "ring", "out_of_place": ok, "in_place": {**ok, "error": None}},
    ]
    assert "n/a" in report.format_row(rows[0], "gloo")
    assert "50.0x" in report.format_row(rows[1], "gloo")
    assert any("no integer avg" in line for line in report.error_lines(rows))
    meta = {"baseline": "gloo", "algorithms": ["ring"], "memcpy": {"best_gbps": 4.0}}
    meta["machine"] = {"load_average": [0.1, 0.1, 0.1], "cpus": 2}
    summary = "\n".join(report.summary_lines(rows, meta))
    assert "ring: <= 64 KiB: 10.0 us" in summary and "total #wrong: 0" in summary


def test_percentile_is_a_measured_sample_by_nearest_rank():
    samples = torch.tensor([5.0, 1.0, 4.0, 2.0, 3.0])
    assert bench.percentile(samples, 50) == 3.0
    assert bench.percentile(samples, 99) == 5.0 and bench.percentile(samples, 0) == 1.0
    hundred = torch.arange(100, 0, -1, dtype=torch.float64)  # 100 .. 1, shuffled order
    assert bench.percentile(hundred, 99) == 99.0 and bench.percentile(hundred, 50) == 50.0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_busy_load_runs_at_its_niceness_and_is_stopped():
    from dist_kernels.bench.load import BusyLoad

    with BusyLoad(2, nice=19) as load:
        assert len(load.pids) == 2 and all(_alive(p) for p in load.pids)
        pids = load.pids
        deadline = time.monotonic() + 30  # the child renices itself once Python has started
        while time.monotonic() < deadline and any(os.getpriority(0, p) != 19 for p in pids):
            time.sleep(0.05)
        assert [os.getpriority(os.PRIO_PROCESS, p) for p in pids] == [19, 19]
    assert not any(_alive(p) for p in pids)
    with pytest.raises(ValueError, match="--load-nice 20"):
        BusyLoad(1, nice=20)


def test_busy_load_outlives_no_killed_benchmark():
    # the benchmark's process dies by SIGKILL (no clean-up runs): its busy processes notice
    script = (
        "import os, signal, sys; from dist_kernels.bench.load import BusyLoad\n"
        "load = BusyLoad(1).__enter__(); print(load.pids[0], flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == -9, done.stderr
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid)


def test_gloo_both_under_load_end_to_end(tmp_path):
    argv = ["-b", "8", "-e", "512", "-f", "64", "--iters", "5", "--warmup", "1"]
    argv += ["--algorithm", "auto", "--gloo", "both", "--load", "1", "--load-nice", "19"]
    result = _run_bench(tmp_path, *argv)
    meta, rows = result["meta"], result["rows"]
    assert meta["passes"] == ["without gloo", "with gloo"] and meta["gloo_in_process"]
    assert meta["load"]["processes"] == 1 and meta["load"]["nice"] == 19
    assert not any(_alive(p) for p in meta["load"]["pids"])  # stopped with the benchmark
    without = [r for r in rows if not r["gloo_in_process"]]
    with_gloo = [r for r in rows if r["gloo_in_process"]]
    _check_rows({"meta": meta, "rows": with_gloo}, "all_reduce", 2, ["auto", "torchdk"])
    _check_rows({"meta": meta, "rows": without}, "all_reduce", 2, ["auto", "torchdk"], None)
    assert "# Gloo in the process (in-place" in result["stdout"]
    assert (
        "Gloo in the process: no; competing load: 1 busy process(es) at nice 19"
        in (result["stdout"])
    )
