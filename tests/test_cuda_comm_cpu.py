"""CPU tier for the CUDA communicator: what it says and checks where it cannot run.

On a machine without a GPU (or with a CPU-only build) ``Communicator(device="cuda")`` must
fail with the reason; input checks must reject host memory before anything reaches C++.
"""

from __future__ import annotations

import datetime

import numpy as np
import pytest
import torch

import dist_kernels
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


class _FakeNcclComm:
    """Stands in for _C.NcclComm: an error that can be injected, aborts counted."""

    def __init__(self):
        self.error = None
        self.aborts = 0
        self.closes = 0
        self.closed = False

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


class _FakeEvent:
    def __init__(self, done=False):
        self.done = done
        self.recorded_on = None

    def record(self, stream):
        self.recorded_on = stream

    def query(self):
        return self.done


class _FakeStream:
    def __init__(self, name):
        self.name = name
        self.waited_events = []
        self.waited_streams = []
        self.cuda_stream = id(self)

    def wait_event(self, event):
        self.waited_events.append(event)

    def wait_stream(self, stream):
        self.waited_streams.append(stream)

    def __repr__(self):
        return f"_FakeStream({self.name})"


class _FakeCuda:
    """The part of torch.cuda that _cuda_comm uses; current streams per device index."""

    def __init__(self):
        self.current = {0: _FakeStream("current of cuda:0"), 1: _FakeStream("current of cuda:1")}
        self.current_device = 0  # the current device is NOT the communicator's (cuda:1)
        self.events = []
        self.new_events_done = False

    def current_stream(self, device=None):
        index = self.current_device if device is None else torch.device(device).index
        return self.current[index]

    def Event(self):  # noqa: N802 - torch's name
        event = _FakeEvent(done=self.new_events_done)
        self.events.append(event)
        return event

    def device(self, device):
        import contextlib

        return contextlib.nullcontext()

    def stream(self, stream):
        import contextlib

        return contextlib.nullcontext()

    def is_current_stream_capturing(self):
        return False


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
    return cuda


def _fake_communicator(cuda=None, device_index=1):
    """A CudaCommunicator built without CUDA: fake NCCL comm, fake streams."""
    comm = object.__new__(_cuda_comm.CudaCommunicator)
    comm.rank, comm.world_size = 0, 2
    comm.device = torch.device("cuda", device_index)
    comm.timeout = _cuda_comm.DEFAULT_TIMEOUT
    comm._comm = _FakeNcclComm()
    comm._watch = _cuda_comm.NcclWatch(comm._comm, 0)
    comm._held = []
    comm._algorithms = comm._transport = None
    comm.stream = _FakeStream("comm")
    return comm


def test_synchronous_call_orders_the_callers_stream_of_the_comm_device(fake_cuda):
    comm = _fake_communicator()
    tensor, launched = _FakeTensor(), []
    comm._run("all_reduce", [tensor], launched.append, async_op=False)
    caller = fake_cuda.current[1]  # the communicator's device, not the current device (0)
    (done,) = fake_cuda.events
    assert launched == [comm.stream.cuda_stream]
    assert comm.stream.waited_streams == [caller]  # the collective starts after the caller's work
    assert done.recorded_on is comm.stream
    assert caller.waited_events == [done]  # ... and the caller's later work after it
    assert fake_cuda.current[0].waited_events == []  # the current device's stream is untouched
    assert tensor.recorded == [comm.stream]  # record_stream on the synchronous path too


def test_foreign_inputs_are_held_until_the_collective_is_done(fake_cuda):
    comm = _fake_communicator()
    array = object()  # stands in for a CuPy array
    comm._run("all_reduce", [_FakeTensor()], lambda s: None, False, foreign=(array,))
    (first,) = fake_cuda.events
    assert comm._held == [(first, (array,))]
    comm._run("broadcast", [_FakeTensor()], lambda s: None, False)  # first still pending
    assert comm._held == [(first, (array,))]
    first.done = True
    comm._run("broadcast", [_FakeTensor()], lambda s: None, False)
    assert comm._held == []  # dropped once its event has completed


def test_work_wait_without_timeout_only_makes_the_stream_wait(fake_cuda):
    comm = _fake_communicator()
    work = comm._run("all_reduce", [_FakeTensor()], lambda s: None, async_op=True)
    (done,) = fake_cuda.events
    assert fake_cuda.current[1].waited_events == []  # async: the caller does not wait yet
    assert work.wait() is True  # never done, but no timeout: the host does not block
    assert fake_cuda.current[1].waited_events == [done]
    assert not work.is_completed()


def test_work_wait_timeout_aborts_and_raises_comm_error(fake_cuda):
    comm = _fake_communicator()
    work = comm._run("reduce_scatter", [_FakeTensor()], lambda s: None, async_op=True)
    with pytest.raises(dist_kernels.CommError, match=r"\[rank 0\] reduce_scatter: not finished"):
        work.wait(datetime.timedelta(seconds=0.05))  # dist_kernels.Work takes a timedelta too
    assert comm._comm.aborts == 1
    assert work.is_completed()  # finished, unsuccessfully
    with pytest.raises(dist_kernels.CommError, match="aborted after an earlier failure"):
        comm._run("all_gather", [_FakeTensor()], lambda s: None, async_op=False)


def test_async_error_surfaces_at_the_next_call(fake_cuda):
    comm = _fake_communicator()
    comm._comm.error = "NCCL error 6 (remote process exited or there was a network error)"
    launched = []
    with pytest.raises(dist_kernels.CommError) as info:
        comm._run("all_reduce", [_FakeTensor()], launched.append, async_op=False)
    message = str(info.value)
    assert message.startswith("[rank 0] all_reduce: NCCL reported an asynchronous error")
    assert "NCCL error 6" in message and "fake last error" in message
    assert launched == [] and comm._comm.aborts == 1  # nothing enqueued on a failed comm


def test_close_waits_for_the_stream_then_destroys_and_later_waits_are_no_error(fake_cuda):
    comm = _fake_communicator()
    work = comm._run("all_reduce", [_FakeTensor()], lambda s: None, async_op=True)
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
