"""The flight recorder: the ring keeps exactly the last N calls, states move scheduled ->
started -> completed, a dump taken while calls run is consistent and torch's analyzer reads
it, SIGUSR1 dumps without disturbing a running collective.

References: the calls each test makes itself (their order, kinds and sizes), torch's own
loader and analyzer (torch.distributed.flight_recorder) for the dump format.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from mp_pool import run_ranks

from dist_kernels import _C, CommError


def _entries_ok(entries):
    """The invariants every snapshot must satisfy, whatever runs meanwhile."""
    ids = [e["op_id"] for e in entries]
    assert ids == list(range(ids[0], ids[0] + len(ids))), ids  # consecutive, oldest first
    created = [e["created_ns"] for e in entries]
    assert created == sorted(created)
    for e in entries:
        assert e["created_ns"] > 0
        if e["state"] == "scheduled":
            assert e["started_ns"] == 0 and e["completed_ns"] == 0, e
        elif e["state"] == "started":
            assert e["started_ns"] >= e["created_ns"] and e["completed_ns"] == 0, e
        else:
            assert e["state"] == "completed", e
            assert e["completed_ns"] >= e["started_ns"] >= e["created_ns"], e


def test_ring_keeps_exactly_the_last_n_and_states_advance():
    recorder = _C.FlightRecorder(4)
    ids = []
    for i in range(10):
        op = "send" if i % 3 == 2 else "all_reduce"
        ids.append(recorder.schedule(op, 0, 0, 1 if op == "send" else -1, 0, i + 1, i + 1))
    assert ids == list(range(1, 11))
    entries = recorder.entries()
    assert [e["op_id"] for e in entries] == [7, 8, 9, 10]
    assert [e["in_count"] for e in entries] == [7, 8, 9, 10]
    assert all(e["state"] == "scheduled" for e in entries)
    # collectives and sends are numbered apart, as torch's collective_seq_id / p2p_seq_id
    assert [(e["collective_seq_id"], e["p2p_seq_id"]) for e in entries] == [
        (5, 2),
        (6, 2),
        (6, 3),
        (7, 3),
    ]
    recorder.started(9, 1)
    assert recorder.entries()[2]["state"] == "started"
    assert recorder.entries()[2]["algorithm"] == 1
    recorder.completed(9)
    recorder.started(3, 1)  # pushed out of the ring already: nothing changes
    entries = recorder.entries()
    assert [e["state"] for e in entries] == ["scheduled", "scheduled", "completed", "scheduled"]
    _entries_ok(entries)
    footprint = recorder.footprint()
    assert (footprint["last_scheduled"], footprint["last_p2p_scheduled"]) == (7, 3)
    assert (footprint["last_completed"], footprint["last_p2p_completed"]) == (0, 3)
    recorder.capacity = 2  # keeps the newest
    assert [e["op_id"] for e in recorder.entries()] == [9, 10]


def _ring_of_five(tmp):
    import dist_kernels as dk

    with dk.Communicator() as comm:
        t = torch.ones(3)
        for _ in range(7):
            comm.all_reduce(t)
        comm.broadcast(t, 0)
        entries = comm._debug_source.recorder.entries()
    return entries, t.tolist()


def test_communicator_records_its_last_n_calls(tmp_path):
    results = run_ranks(2, _ring_of_five, str(tmp_path), env={"DK_TRACE_BUFFER_SIZE": "5"})
    for entries, value in results:
        assert value == [2.0**7] * 3
        assert [e["op"] for e in entries] == ["all_reduce"] * 4 + ["broadcast"]
        assert [e["collective_seq_id"] for e in entries] == [4, 5, 6, 7, 8]
        assert all(e["state"] == "completed" and e["in_count"] == 3 for e in entries)
        assert entries[-1]["peer"] == 0
        _entries_ok(entries)


def _in_flight(path):
    """Rank 0 queues two all-reduces while rank 1 waits 1 s: the first is started (waiting for
    rank 1), the second scheduled behind it; a dump then must say so."""
    import torch.distributed as dist

    import dist_kernels as dk

    rank = dist.get_rank()
    with dk.Communicator(timeout=datetime.timedelta(seconds=60)) as comm:
        a, b = torch.ones(8), torch.ones(8)
        if rank == 1:
            time.sleep(1.0)
            comm.all_reduce(a)
            comm.all_reduce(b)
            return None
        first = comm.all_reduce(a, async_op=True)
        second = comm.all_reduce(b, async_op=True)
        time.sleep(0.3)
        during = comm._debug_source.recorder.entries()
        dumped = dk.debug.dump(path, [comm])
        first.wait()
        second.wait()
        after = comm._debug_source.recorder.entries()
        return during, dumped, after, a.tolist()


def test_states_in_flight_and_a_dump_meanwhile(tmp_path):
    path = str(tmp_path / "dk_trace_rank_0")
    (during, dumped, after, value), _ = run_ranks(2, _in_flight, path)
    assert value == [2.0] * 8
    assert [e["state"] for e in during] == ["started", "scheduled"]
    assert [e["state"] for e in after] == ["completed", "completed"]
    _entries_ok(during)
    _entries_ok(after)
    with open(dumped, "rb") as f:
        dump = pickle.load(f)
    assert [e["state"] for e in dump["entries"]] == ["started", "scheduled"]
    assert dump["entries"][0]["time_discovered_completed_ns"] is None
    assert dump["pg_status"]["0"]["last_started_collective"] == 1


def _all_ranks(comm, flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (a MIN all-reduce; this call is recorded too)."""
    value = torch.tensor([float(flag)])
    comm.all_reduce(value, "min")
    return bool(value.item())


def _dumps_while_running(directory, calls):
    """A thread dumps in a loop while the main thread runs ``calls`` all-reduces."""
    import torch.distributed as dist

    import dist_kernels as dk

    rank = dist.get_rank()
    with dk.Communicator() as comm:
        stop, snapshots = threading.Event(), []

        def dump_loop():
            while not stop.is_set():
                path = dk.debug.dump(os.path.join(directory, f"dk_trace_rank_{rank}"), [comm])
                with open(path, "rb") as f:
                    snapshots.append(pickle.load(f)["entries"])

        thread = threading.Thread(target=dump_loop)
        thread.start()
        t = torch.full((16,), float(rank))
        i = 0  # both ranks call until both have taken 10 dumps (decided by a collective)
        while i < calls or not _all_ranks(comm, len(snapshots) >= 10):
            # the average stays 0.5: every call checks the last one's bytes
            work = comm.all_reduce(t, dk.ReduceOp.AVG, async_op=i % 2 == 1)
            if work is not None:
                work.wait()
            i += 1
        stop.set()
        thread.join()
        # for the analyzer: this communicator alone (the pool's workers keep other tests')
        dk.debug.dump(os.path.join(directory, f"dk_trace_rank_{rank}"), [comm])
        return snapshots, t[0].item()


def test_dumps_taken_while_calls_run_are_consistent_and_parse(tmp_path):
    calls = 400
    results = run_ranks(
        2, _dumps_while_running, str(tmp_path), calls, env={"DK_TRACE_BUFFER_SIZE": "64"}
    )
    for snapshots, value in results:
        assert value == 0.5
        assert len(snapshots) >= 10
        for entries in snapshots:
            assert len(entries) <= 64
            seqs = [e["collective_seq_id"] for e in entries]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else True
            for e in entries:
                assert e["state"] in ("scheduled", "started", "completed")
                if e["state"] == "completed":
                    assert e["time_discovered_completed_ns"] >= e["time_discovered_started_ns"]
    # the last dumps (all calls completed) through torch's analyzer, unchanged
    analyzed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(tmp_path),
         "--prefix", "dk_trace_rank_", "-o", str(tmp_path / "db.pkl")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert analyzed.returncode == 0, analyzed.stderr
    with open(tmp_path / "db.pkl", "rb") as f:
        _, db = pickle.load(f)
    assert len(db.collectives) == 64 and all(c.pass_check for c in db.collectives)
    assert {c.collective_name for c in db.collectives} == {"gloo:all_reduce"}
    assert {c.collective_state for c in db.collectives} == {"completed"}


def _sigusr1_during_a_collective(path):
    """Rank 0 is inside a synchronous all-reduce (rank 1 joins 1 s late) when a SIGUSR1
    arrives: the dump appears and the all-reduce ends with the right sum."""
    import torch.distributed as dist

    import dist_kernels as dk

    rank = dist.get_rank()
    with dk.Communicator(timeout=datetime.timedelta(seconds=60)) as comm:
        t = torch.full((1024,), float(rank + 1))
        if rank == 1:
            time.sleep(1.0)
            comm.all_reduce(t)
            return t[0].item(), None
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        comm.all_reduce(t)
        dumped = f"{path}{rank}"
        deadline = time.monotonic() + 10
        while not os.path.exists(dumped) and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(dumped, "rb") as f:  # every open communicator of the rank: this one's entries
            name = comm._debug_source.name
            entries = [e for e in pickle.load(f)["entries"] if e["process_group"][0] == name]
        return t[0].item(), entries


def test_sigusr1_dumps_without_disturbing_a_running_collective(tmp_path):
    prefix = str(tmp_path / "dk_trace_rank_")
    (value0, entries), (value1, _) = run_ranks(
        2, _sigusr1_during_a_collective, prefix, env={"DK_TRACE_FILE": prefix}
    )
    assert value0 == value1 == 3.0
    assert [(e["profiling_name"], e["state"]) for e in entries] == [("gloo:all_reduce", "started")]


@pytest.mark.parametrize("size", ["-1", "x"])
def test_bad_buffer_size_is_a_clear_error(monkeypatch, size):
    from dist_kernels.debug import flight_recorder

    monkeypatch.setenv("DK_TRACE_BUFFER_SIZE", size)
    with pytest.raises(ValueError, match="DK_TRACE_BUFFER_SIZE must be an integer >= 0"):
        flight_recorder.buffer_size()


class _Event:
    """A CUDA event stand-in: reached once the test says the stream passed it."""

    def __init__(self):
        self.reached = False

    def query(self):
        return self.reached


def test_stream_recorder_discovers_progress_from_events():
    from dist_kernels.debug.stream_recorder import StreamRecorder

    stream = StreamRecorder(_C.FlightRecorder(16))
    launches = []
    for calls in (
        [("all_reduce", 0, 0, -1, 8, 8)],
        [("send", 0, -1, 1, 4, 4), ("recv", 0, -1, 1, 4, 4)],
    ):
        ids = stream.schedule(calls)
        start, done = _Event(), _Event()
        stream.launched(ids, start, done)
        launches.append((ids, start, done))
    states = lambda: [e["state"] for e in stream.recorder.entries()]  # noqa: E731
    stream.refresh()
    assert states() == ["scheduled"] * 3
    launches[1][1].reached = True  # stream order: the second cannot be seen before the first
    stream.refresh()
    assert states() == ["scheduled"] * 3
    launches[0][1].reached = True
    stream.refresh()
    assert states() == ["started", "scheduled", "scheduled"]
    launches[0][2].reached = True
    stream.refresh()
    assert states() == ["completed", "started", "started"]
    stream.failed("NCCL error")  # charged to the oldest unfinished call
    footprint = stream.recorder.footprint()
    assert footprint["failed_op_id"] == 2 and footprint["failure"] == "NCCL error"
    _entries_ok(stream.recorder.entries())


def _dk_group_dump(directory):
    import torch.distributed as dist

    import dist_kernels as dk

    group = dist.new_group([1, 2], backend="dk")  # collective over the world
    rank = dist.get_rank()
    if rank == 0:
        return None
    t = torch.ones(5)
    dist.all_reduce(t, group=group)
    dist.broadcast(t, group_src=0, group=group)
    path = dk.debug.dump(os.path.join(directory, f"dk_trace_rank_{rank}"))
    name = group.group_name
    dist.destroy_process_group(group)
    with open(path, "rb") as f:
        return name, pickle.load(f), t.tolist()


def test_dk_backend_groups_are_recorded_under_torchs_names(tmp_path):
    _, (name1, dump1, value1), (name2, dump2, _) = run_ranks(3, _dk_group_dump, str(tmp_path))
    assert name1 == name2 and value1 == [2.0] * 5
    for dump in (dump1, dump2):
        config = dump["pg_config"][name1]
        assert config["ranks"] == "[1, 2]"
        mine = [e for e in dump["entries"] if e["process_group"][0] == name1]
        assert [e["profiling_name"] for e in mine] == ["gloo:all_reduce", "gloo:broadcast"]
        assert [e["collective_seq_id"] for e in mine] == [1, 2]
        assert all(e["state"] == "completed" and e["input_sizes"] == [[5]] for e in mine)


def _stack_recorded(directory):
    import torch.distributed as dist

    import dist_kernels as dk

    with dk.Communicator() as comm:
        t = torch.ones(2)
        comm.all_reduce(t)  # the call site the stack must name
        entries = comm._debug_source.entries()
        path = dk.debug.dump(os.path.join(directory, f"dk_trace_rank_{dist.get_rank()}"), [comm])
    with open(path, "rb") as f:
        return entries, pickle.load(f)["entries"]


def test_python_stack_of_each_call_when_asked(tmp_path):
    import inspect

    line = next(
        i for i, text in enumerate(inspect.getsource(_stack_recorded).splitlines())
        if "the call site" in text
    ) + _stack_recorded.__code__.co_firstlineno  # fmt: skip
    for entries, dumped in run_ranks(
        2, _stack_recorded, str(tmp_path), env={"DK_TRACE_PYTHON_STACK": "1"}
    ):
        (entry,) = entries
        innermost = [f for f in entry["frames"] if f["filename"] == __file__][0]
        assert (innermost["name"], innermost["line"]) == ("_stack_recorded", line)
        assert dumped[0]["frames"][0] == entry["frames"][0]  # the dump carries them, torch's keys
        assert set(dumped[0]["frames"][0]) == {"name", "filename", "line"}


def test_cuda_communicator_records_its_launches_with_fakes(monkeypatch):
    """The CUDA communicator's plumbing on CPU (the fakes of test_cuda_comm_cpu): a launch is
    scheduled, gets a start and a done event around it, and is marked started / completed as
    the stream reaches them; an NCCL failure is recorded against the call that hung."""
    from test_cuda_comm_cpu import _fake_communicator, _FakeCuda, _FakeTensor, _TorchWithFakeCuda

    from dist_kernels.comm import cuda as cuda_comm
    from dist_kernels.debug.flight_recorder import Source
    from dist_kernels.debug.stream_recorder import StreamRecorder

    cuda = _FakeCuda()
    monkeypatch.setattr(cuda_comm, "torch", _TorchWithFakeCuda(cuda))
    comm = _fake_communicator()
    comm._recording = StreamRecorder(_C.FlightRecorder(8))
    comm._debug_source = Source(comm._recording.recorder, "dk:cuda:0", "undefined", [0, 1], 0,
                                None, 300.0, "nccl", comm._recording.refresh)  # fmt: skip
    comm._watch = cuda_comm.NcclWatch(comm._comm, 0, comm._record_failure)
    trace = [("all_reduce", 0, 0, -1, 16, 16)]
    comm._run("all_reduce", [_FakeTensor()], lambda: None, True, trace=trace)
    start, done = cuda.events
    assert start.recorded_on is comm.stream and done.recorded_on is comm.stream
    states = lambda: [e["state"] for e in comm._debug_source.entries()]  # noqa: E731
    assert states() == ["scheduled"]
    start.done = True
    assert states() == ["started"]
    done.done = True
    assert states() == ["completed"]
    comm._run(
        "broadcast", [_FakeTensor()], lambda: None, True, trace=[("broadcast", 0, -1, 1, 4, 4)]
    )
    comm._comm.error = "NCCL error 6"
    with pytest.raises(CommError):
        comm._run("all_reduce", [_FakeTensor()], lambda: None, True, trace=trace)
    footprint = comm._debug_source.footprint()
    assert footprint["failed_op_id"] == 2 and "NCCL error 6" in footprint["failure"]
    assert [e["op"] for e in comm._debug_source.entries()] == ["all_reduce", "broadcast"]
