"""CPU tier for the CUDA communicator: what it says and checks where it cannot run.

On a machine without a GPU (or with a CPU-only build) ``Communicator(device="cuda")`` must
fail with the reason; input checks must reject host memory before anything reaches C++.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import threading
import time
import types

import numpy as np
import pytest
import torch

import dist_kernels
from dist_kernels import _C
from dist_kernels.comm import algorithms
from dist_kernels.comm import cuda as _cuda_comm

CUDA_DEVICE = torch.device("cuda", 0)  # a device object; nothing is allocated on it


@pytest.mark.skipif(
    _cuda_comm.unavailable_reason() is None, reason="a CUDA communicator can be made here"
)
def test_cuda_communicator_unavailable_names_the_reason():
    reason = _cuda_comm.unavailable_reason()
    with pytest.raises(RuntimeError, match="unavailable") as info:
        dist_kernels.Communicator(device="cuda")
    assert reason in str(info.value)


def test_host_tensor_is_rejected_with_value_error():
    with pytest.raises(ValueError, match=r"grad: expected a tensor on cuda:0 .* got one on cpu"):
        _cuda_comm.as_cuda_tensor(torch.ones(3), CUDA_DEVICE, "grad")


def test_numpy_array_is_host_memory():
    with pytest.raises(ValueError, match="got one on cpu"):
        _cuda_comm.as_cuda_tensor(np.ones(3, dtype=np.float32), CUDA_DEVICE, "tensor")


def test_non_array_is_a_type_error():
    with pytest.raises(
        TypeError, match="tensor: expected a torch.Tensor or a CUDA array, got list"
    ):
        _cuda_comm.as_cuda_tensor([1.0, 2.0], CUDA_DEVICE, "tensor")


def test_store_needs_rank_and_world_size():
    with pytest.raises(ValueError, match="rank= and world_size="):
        _cuda_comm.CudaCommunicator(store=torch.distributed.HashStore())


# -- the CUDA communicator's plumbing on CPU, with fakes for NCCL and torch.cuda ---------------
#
# The fake CUDA layer below stands in for the part of torch.cuda that dist_kernels/comm/cuda.py
# uses: streams record what they waited on, events whether they completed, and a capture id
# says whether the current stream is inside a CUDA graph capture. With it the stream-order rules
# of the module docstring are checked on CPU; tests/test_gpu.py checks the same on a device.


class _FakeNcclCommunicator:
    """Stands in for _C.NcclCommunicator: calls recorded, an error that can be injected."""

    lanes = 2

    def __init__(self):
        self.error = None
        self.aborts = 0
        self.closes = 0
        self.closed = False
        self.calls = []

    def async_error(self):
        return self.error

    def last_error(self):
        return "fake last error" if self.error else ""

    def abort(self):
        self.aborts += 1
        self.closed = True

    def close(self):
        self.closes += 1
        self.closed = True

    def resolve(self, algorithm, nbytes):
        return algorithms.CODES["nccl"] if algorithm == algorithms.CODES["auto"] else algorithm

    def __getattr__(self, name):  # all_reduce, reduce_scatter, ...: recorded
        return lambda *args: self.calls.append((name, args))


class _FakeEvent:
    def __init__(self, done=False):
        self.done = done
        self.recorded_on = None

    def record(self, stream):
        self.recorded_on = stream

    def query(self):
        return self.done


class _FakeStream:
    def __init__(self, name, cuda_stream=None):
        self.name = name
        self.waited_events = []
        self.waited_streams = []
        self.cuda_stream = id(self) if cuda_stream is None else cuda_stream
        self.idle = True

    def wait_event(self, event):
        self.waited_events.append(event)

    def wait_stream(self, stream):
        self.waited_streams.append(stream)

    def query(self):
        return self.idle

    def __repr__(self):
        return f"_FakeStream({self.name})"


class _FakeCuda:
    """torch.cuda as cuda.py uses it: current streams per device index, events, external
    streams by handle, and the capture the current stream takes part in (0: none)."""

    def __init__(self):
        self.current = {0: _FakeStream("current of cuda:0"), 1: _FakeStream("current of cuda:1")}
        self.current_device = 0  # the current device is NOT the communicator's (cuda:1)
        self.events = []
        self.new_events_done = False
        self.external = {}
        self.capture = 0

    def current_stream(self, device=None):
        index = self.current_device if device is None else torch.device(device).index
        return self.current[index]

    def Event(self):  # noqa: N802 - torch's name
        event = _FakeEvent(done=self.new_events_done)
        self.events.append(event)
        return event

    def ExternalStream(self, handle, device=None):  # noqa: N802 - torch's name
        return self.external.setdefault(handle, _FakeStream(f"external {handle}", handle))

    @contextlib.contextmanager
    def device(self, device):
        saved, self.current_device = self.current_device, torch.device(device).index
        try:
            yield
        finally:
            self.current_device = saved

    @contextlib.contextmanager
    def stream(self, stream):
        index = self.current_device
        saved, self.current[index] = self.current[index], stream
        try:
            yield
        finally:
            self.current[index] = saved

    def Stream(self, device=None):  # noqa: N802 - torch's name
        return _FakeStream(f"new stream on {device}")

    def is_current_stream_capturing(self):
        return self.capture != 0


class _TorchWithFakeCuda:
    def __init__(self, cuda):
        self.cuda = cuda

    def __getattr__(self, name):
        return getattr(torch, name)


class _FakeTensor:
    def __init__(self):
        self.recorded = []

    def record_stream(self, stream):
        self.recorded.append(stream)


@pytest.fixture
def fake_cuda(monkeypatch):
    cuda = _FakeCuda()
    monkeypatch.setattr(_cuda_comm, "torch", _TorchWithFakeCuda(cuda))
    monkeypatch.setattr(_cuda_comm, "_capture_id", lambda device: cuda.capture)
    return cuda


def _fake_communicator(cuda=None, device_index=1):
    """A CudaCommunicator built without CUDA: fake NCCL communicator, fake streams."""
    comm = object.__new__(_cuda_comm.CudaCommunicator)
    comm.rank, comm.world_size = 0, 2
    comm.device = torch.device("cuda", device_index)
    comm.timeout = _cuda_comm.DEFAULT_TIMEOUT
    comm._comm = _FakeNcclCommunicator()
    comm._watch = _cuda_comm.NcclWatch(comm._comm, 0)
    comm._held, comm._captured = [], []
    comm._busy = threading.Lock()
    comm.stream = _FakeStream("comm")
    return comm


def _nothing():
    return None


def test_synchronous_call_orders_the_callers_stream_of_the_comm_device(fake_cuda):
    comm = _fake_communicator()
    tensor, launched = _FakeTensor(), []
    comm._run("all_reduce", [tensor], lambda: launched.append(True), async_op=False)
    caller = fake_cuda.current[1]  # the communicator's device, not the current device (0)
    (done,) = fake_cuda.events
    assert launched == [True]
    assert comm.stream.waited_streams == [caller]  # the collective starts after the caller's work
    assert done.recorded_on is comm.stream
    assert caller.waited_events == [done]  # ... and the caller's later work after it
    assert fake_cuda.current[0].waited_events == []  # the current device's stream is untouched
    assert tensor.recorded == [comm.stream]  # record_stream on the synchronous path too


def test_foreign_inputs_are_held_until_the_collective_is_done(fake_cuda):
    comm = _fake_communicator()
    array = object()  # stands in for a CuPy array
    comm._run("all_reduce", [_FakeTensor()], _nothing, False, foreign=(array,))
    (first,) = fake_cuda.events
    assert comm._held == [(first, (array,))]
    comm._run("broadcast", [_FakeTensor()], _nothing, False)  # first still pending
    assert comm._held == [(first, (array,))]
    first.done = True
    comm._run("broadcast", [_FakeTensor()], _nothing, False)
    assert comm._held == []  # dropped once its event has completed


class _InterfaceArray:
    """A foreign array whose __cuda_array_interface__ names its producer's stream."""

    def __init__(self, stream):
        self.__cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False),
                                         "version": 3, "stream": stream}  # fmt: skip


def test_array_interface_stream_orders_the_collective_both_ways(fake_cuda):
    comm = _fake_communicator()
    array = _InterfaceArray(stream=1234)
    comm._run("all_reduce", [_FakeTensor()], _nothing, False, foreign=(array,))
    owner = fake_cuda.external[1234]
    (done,) = fake_cuda.events
    assert owner in comm.stream.waited_streams  # the producer's work comes first
    assert owner.waited_events == [done]  # its consumer (same stream) waits for the result
    assert _cuda_comm.owner_stream(_InterfaceArray(stream=None)) is None  # None: no sync needed
    assert _cuda_comm.owner_stream(_InterfaceArray(stream=1)) == 0  # legacy default: torch's 0


def test_cupy_array_through_dlpack_orders_cupys_current_stream(fake_cuda, monkeypatch):
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=777))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    array = type("ndarray", (), {"__module__": "cupy._core.core", "__dlpack__": None})()
    comm = _fake_communicator()
    work = comm._run("all_reduce", [_FakeTensor()], _nothing, True, foreign=(array,))
    owner = fake_cuda.external[777]
    assert owner in comm.stream.waited_streams and owner.waited_events == []  # async: not yet
    work.wait()
    (done,) = fake_cuda.events
    assert owner.waited_events == [done] and fake_cuda.current[1].waited_events == [done]


def test_work_wait_without_timeout_only_makes_the_stream_wait(fake_cuda):
    comm = _fake_communicator()
    work = comm._run("all_reduce", [_FakeTensor()], _nothing, async_op=True)
    (done,) = fake_cuda.events
    assert fake_cuda.current[1].waited_events == []  # async: the caller does not wait yet
    assert work.wait() is True  # never done, but no timeout: the host does not block
    assert fake_cuda.current[1].waited_events == [done]
    assert not work.is_completed()


def test_work_wait_timeout_aborts_and_raises_comm_error(fake_cuda):
    comm = _fake_communicator()
    work = comm._run("reduce_scatter", [_FakeTensor()], _nothing, async_op=True)
    with pytest.raises(dist_kernels.CommError, match=r"\[rank 0\] reduce_scatter: not finished"):
        work.wait(datetime.timedelta(seconds=0.05))  # dist_kernels.Work takes a timedelta too
    assert comm._comm.aborts == 1
    assert work.is_completed()  # finished, unsuccessfully
    with pytest.raises(dist_kernels.CommError, match="aborted after an earlier failure"):
        comm._run("all_gather", [_FakeTensor()], _nothing, async_op=False)


def test_async_error_surfaces_at_the_next_call(fake_cuda):
    comm = _fake_communicator()
    comm._comm.error = "NCCL error 6 (remote process exited or there was a network error)"
    launched = []
    with pytest.raises(dist_kernels.CommError) as info:
        comm._run("all_reduce", [_FakeTensor()], lambda: launched.append(True), async_op=False)
    message = str(info.value)
    assert message.startswith("[rank 0] all_reduce: NCCL reported an asynchronous error")
    assert "NCCL error 6" in message and "fake last error" in message
    assert launched == [] and comm._comm.aborts == 1  # nothing enqueued on a failed comm


def test_close_waits_for_the_stream_then_destroys_and_later_waits_are_no_error(fake_cuda):
    comm = _fake_communicator()
    work = comm._run("all_reduce", [_FakeTensor()], _nothing, async_op=True)
    fake_cuda.events[0].done = True  # the comm stream has finished by the time close() looks
    fake_cuda.new_events_done = True
    nccl = comm._comm
    comm.close()
    assert comm.closed and nccl.closes == 1 and nccl.aborts == 0
    assert work.wait(timeout=1.0) is True  # nothing left to ask NCCL: no error


def test_close_times_out_and_aborts(fake_cuda):
    comm = _fake_communicator()
    comm.timeout = datetime.timedelta(seconds=0.05)
    nccl = comm._comm
    with pytest.raises(dist_kernels.CommError, match=r"\[rank 0\] close: not finished after"):
        comm.close()
    assert comm.closed and nccl.aborts == 1 and nccl.closes == 0


# -- CUDA graphs: a captured async Work is waited inside its capture ------------------------


def test_captured_async_work_waited_inside_its_capture_is_fine(fake_cuda):
    comm = _fake_communicator()
    fake_cuda.capture = 7
    tensor = _FakeTensor()
    work = comm._run("all_reduce", [tensor], _nothing, async_op=True)
    assert tensor.recorded == []  # inside a capture the memory is the graph's
    work.wait(timeout=5.0)  # no host wait inside a capture: only the stream waits
    fake_cuda.capture = 0
    comm._run("broadcast", [_FakeTensor()], _nothing, async_op=False)  # nothing pending


def test_captured_async_work_waited_outside_its_capture_raises(fake_cuda):
    comm = _fake_communicator()
    fake_cuda.capture = 7
    work = comm._run("all_reduce", [_FakeTensor()], _nothing, async_op=True)
    fake_cuda.capture = 0
    with pytest.raises(RuntimeError, match="started in CUDA graph capture 7 and is waited in eag"):
        work.wait()
    with pytest.raises(RuntimeError, match="never waited inside it"):  # and its graph is broken
        comm._run("all_reduce", [_FakeTensor()], _nothing, async_op=True)
    eager = comm._run("all_reduce", [_FakeTensor()], _nothing, async_op=True)
    fake_cuda.capture = 8
    with pytest.raises(RuntimeError, match="started in no graph capture and is waited in captu"):
        eager.wait()


def test_captured_async_work_never_waited_is_reported_at_the_next_call(fake_cuda):
    comm = _fake_communicator()
    fake_cuda.capture = 7
    comm._run("reduce_scatter", [_FakeTensor()], _nothing, async_op=True)
    fake_cuda.capture = 0  # the capture ended without a wait (torch's capture_end failed)
    with pytest.raises(RuntimeError, match=r"never waited inside it: reduce_scatter \(capture 7"):
        comm._run("all_reduce", [_FakeTensor()], _nothing, async_op=False)
    comm._run("all_reduce", [_FakeTensor()], _nothing, async_op=False)  # reported once


# -- threads and interpreter exit -------------------------------------------------------------


def test_a_second_thread_is_refused_while_a_call_runs(fake_cuda):
    comm = _fake_communicator()
    inside, release, errors = threading.Event(), threading.Event(), []

    def slow_launch():
        inside.set()
        release.wait(10)

    thread = threading.Thread(target=comm._run, args=("all_reduce", [], slow_launch, False))
    thread.start()
    assert inside.wait(10)
    try:
        comm._run("broadcast", [], _nothing, False)
    except RuntimeError as e:
        errors.append(str(e))
    release.set()
    thread.join(10)
    assert len(errors) == 1 and "another thread is calling this communicator" in errors[0]
    comm._run("broadcast", [], _nothing, False)  # free again once the first call returned


def test_interpreter_exit_closes_an_idle_and_aborts_a_busy_cuda_communicator(fake_cuda):
    from dist_kernels.comm import base

    idle, busy = _fake_communicator(), _fake_communicator()
    busy.stream.idle = False  # a collective still on its stream (a peer that never came)
    fake_cuda.new_events_done = True  # close() finds the stream done
    idle_nccl, busy_nccl = idle._comm, busy._comm
    for comm in (idle, busy):
        comm._track_open()
    base._close_open_communicators()
    assert idle.closed and idle_nccl.closes == 1 and idle_nccl.aborts == 0
    assert busy.closed and busy_nccl.aborts == 1 and busy_nccl.closes == 0


# -- the "dk" torch backend's CUDA route: futures complete after the GPU, with devices ---------


class _FakeFuture:
    """torch.futures.Future as the torch backend uses it: devices, and the stream current when
    the result was set (where a real CUDA-aware future records its events)."""

    def __init__(self, cuda, devices=None):
        self.cuda, self.devices = cuda, list(devices or [])
        self.result = self.error = self.stream = None
        self.set = threading.Event()

    def set_result(self, value):
        self.result, self.stream = value, self.cuda.current_stream(self.devices[0])
        self.set.set()

    def set_exception(self, error):
        self.error = error
        self.set.set()


def test_torch_backend_cuda_future_completes_after_the_gpu_with_its_devices(fake_cuda, monkeypatch):
    from dist_kernels.torch_backend import work as backend_work

    futures = []
    fake_torch = _TorchWithFakeCuda(fake_cuda)
    fake_torch.futures = types.SimpleNamespace(
        Future=lambda devices=None: futures.append(_FakeFuture(fake_cuda, devices)) or futures[-1]
    )
    monkeypatch.setattr(backend_work, "torch", fake_torch)
    cuda1 = torch.device("cuda", 1)
    monkeypatch.setattr(backend_work, "_cuda_devices", lambda tensors: [cuda1])  # no CUDA here
    comm = _fake_communicator()
    handle = comm._run("all_reduce", [_FakeTensor()], _nothing, async_op=True)
    (done,) = fake_cuda.events
    copied_on = []
    completions = backend_work.Completions(datetime.timedelta(seconds=20))
    work = backend_work.DkWork(
        [handle], ["result"], lambda: copied_on.append(fake_cuda.current_stream(cuda1)), completions
    )
    assert work.device == cuda1
    future = work.get_future()
    (fake_future,) = futures
    assert fake_future.devices == [cuda1]  # CUDA-aware, as ProcessGroupNCCL's futures are
    time.sleep(0.3)
    assert not fake_future.set.is_set()  # the GPU has not finished: the future waits
    done.done = True
    assert fake_future.set.wait(10) and fake_future.error is None, fake_future.error
    private = fake_future.stream  # the watcher's own stream, not the caller's
    assert private is not fake_cuda.current[1] and private.waited_events[0] is done
    assert copied_on == [private] and fake_future.result == ["result"]  # copy-outs, then result
    assert future is fake_future
    work.wait()  # the caller's stream continues after the copy-outs made on the watcher's stream
    assert fake_cuda.current[1].waited_events == [work._ready]
    completions.close()


# -- one algorithm table; "auto" resolved in C++ ------------------------------------------------


def test_the_algorithm_table_is_the_extensions():
    assert algorithms.CODES == _C.ALGORITHMS  # the bindings build it from the C++ enum
    for table in algorithms.ACCEPTED.values():
        assert all(set(names) <= set(algorithms.CODES) for names in table.values())


def test_collectives_pass_the_codes_and_cpp_resolves_auto(fake_cuda, monkeypatch):
    comm = _fake_communicator()
    monkeypatch.setattr(_cuda_comm, "as_cuda_tensor", lambda obj, device, arg: obj)
    monkeypatch.setattr(_cuda_comm, "dtype_code", lambda dtype, arg=None: 0)

    def tensor(numel):
        return types.SimpleNamespace(data_ptr=lambda: 64, numel=lambda: numel,
                                     dtype=torch.float32, record_stream=lambda s: None)  # fmt: skip

    t, whole = tensor(8), tensor(16)
    comm.all_reduce(t)  # auto travels as its code: C++ resolves it
    comm.all_reduce(t, algorithm="tree")
    comm.broadcast(t, 1, algorithm="ring")
    assert [c[1][-1] for c in comm._comm.calls] == [0, 2, 1]
    with pytest.raises(ValueError, match="reduce_scatter has no tree"):
        comm.reduce_scatter(t, whole, algorithm="tree")
    with pytest.raises(ValueError, match="algorithm must be one of"):
        comm.all_reduce(t, algorithm="one_shot")  # shared memory's, not NCCL's
    runs = comm.algorithm_runs("all_gather")  # what the bench labels its rows by
    assert runs == {"auto": "nccl", "ring": "ring", "nccl": "nccl"}


def test_lanes_come_from_rank_0_and_the_environment(monkeypatch):
    monkeypatch.setenv("DK_NCCL_LANES", "1")
    assert _cuda_comm.default_lanes() == 1
    monkeypatch.setenv("DK_NCCL_LANES", "two")
    with pytest.raises(ValueError, match="DK_NCCL_LANES"):
        _cuda_comm.default_lanes()
    ids = iter(bytes([i]) * 128 for i in range(10))
    monkeypatch.setattr(_cuda_comm, "_C", types.SimpleNamespace(nccl_unique_id=lambda: next(ids)))
    store, timeout = torch.distributed.HashStore(), datetime.timedelta(seconds=5)
    first = _cuda_comm._unique_ids(store, 0, 2, timeout)
    assert first == [bytes([0]) * 128, bytes([1]) * 128]  # one id per lane, made by rank 0
    assert _cuda_comm._unique_ids(store, 1, 2, timeout) == first
    with pytest.raises(ValueError, match=r"\[rank 1\].*lanes=1, but rank 0 has 2"):
        _cuda_comm._unique_ids(store, 1, 1, timeout)


def test_both_communicators_share_one_base():
    from dist_kernels.comm.base import BaseCommunicator

    assert issubclass(dist_kernels.Communicator, BaseCommunicator)
    assert issubclass(_cuda_comm.CudaCommunicator, BaseCommunicator)


def test_module_level_api_reaches_a_cuda_communicator(monkeypatch):
    """dk.init(device="cuda"); dk.all_reduce(t): the default communicator may be a CUDA one."""
    from dist_kernels.comm import communicator

    calls = []

    def fake_init(self, group=None, device="cuda", timeout=None):
        fake = _fake_communicator(device_index=0)
        self.__dict__.update(fake.__dict__)

    def fake_all_reduce(self, tensor, op, algorithm, async_op):
        calls.append((tensor, op, algorithm, async_op))

    monkeypatch.setattr(communicator, "_default", None)
    monkeypatch.setattr(_cuda_comm.CudaCommunicator, "__init__", fake_init)
    monkeypatch.setattr(_cuda_comm.CudaCommunicator, "all_reduce", fake_all_reduce)
    comm = dist_kernels.init(device="cuda")
    assert isinstance(comm, _cuda_comm.CudaCommunicator) and not comm.closed
    t = torch.ones(3)
    dist_kernels.all_reduce(t, op=dist_kernels.ReduceOp.MAX)
    assert calls == [(t, dist_kernels.ReduceOp.MAX, "auto", False)]
    assert dist_kernels.get_default_communicator() is comm
    comm.abort()
    assert comm.closed and comm._comm is None
    with pytest.raises(RuntimeError, match="call dist_kernels.init"):
        dist_kernels.all_reduce(t)
