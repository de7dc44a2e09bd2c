"""The stage-to-stage wire protocol over an in-memory loopback (no processes)."""

import collections

import pytest
import torch

from dist_kernels.pipeline.wire import ACTIVATION, GRADIENT, Channels


class _Loopback:
    """Two ranks' mailboxes in one process; counts messages. Sends complete at once."""

    def __init__(self):
        self.queues = collections.defaultdict(collections.deque)
        self.messages = 0

    def endpoint(self, rank):
        hub = self

        class _End:
            def send(self, t, dst):
                hub.messages += 1
                hub.queues[(rank, dst)].append(t.clone())

            def recv(self, t, src):
                got = hub.queues[(src, rank)].popleft()
                assert got.shape == t.shape and got.dtype == t.dtype, (got.shape, t.shape)
                t.copy_(got)

        return _End()


def _roundtrip(a, b, tensors, is_tuple, tag, ranks=(0, 1)):
    a.send(tensors, is_tuple, ranks[1], tag)
    return b.recv(ranks[0], tag)


def test_shapes_agreed_once_and_again_when_they_change():
    seed = 7
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    hub = _Loopback()
    a, b = Channels(hub.endpoint(0)), Channels(hub.endpoint(1))
    x = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    mask = torch.rand(4, generator=gen) > 0.5
    ids = torch.randint(0, 9, (4, 2), generator=gen, dtype=torch.int16)
    half = torch.randn(2, 5, generator=gen).bfloat16()
    sent = (x, mask, ids, half)
    got, is_tuple = _roundtrip(a, b, sent, True, (ACTIVATION, 0, 0))
    assert is_tuple and [g.dtype for g in got] == [t.dtype for t in sent]
    assert all(torch.equal(g, t) for g, t in zip(got, sent))
    first = hub.messages
    assert first == 3  # announce (empty channel), metadata, the transfer
    got, _ = _roundtrip(a, b, sent, True, (ACTIVATION, 0, 1))
    assert hub.messages == first + 1  # unchanged shapes: one message
    smaller = (x[:2], mask[:2], ids[:2], half)
    got, _ = _roundtrip(a, b, smaller, True, (ACTIVATION, 0, 2))
    assert hub.messages == first + 4  # changed: announce, metadata, transfer
    assert all(torch.equal(g, t) for g, t in zip(got, smaller))
    grad = torch.randn(3, generator=gen)
    got, is_tuple = _roundtrip(b, a, [grad], False, (GRADIENT, 1, 0), (1, 0))  # the other direction
    assert not is_tuple and torch.equal(got[0], grad)


def test_empty_and_zero_dim_tensors():
    hub = _Loopback()
    a, b = Channels(hub.endpoint(0)), Channels(hub.endpoint(1))
    sent = (torch.empty(0, 4), torch.tensor(3.5), torch.arange(5))
    got, _ = _roundtrip(a, b, sent, True, (ACTIVATION, 2, 0))
    assert [g.shape for g in got] == [t.shape for t in sent]
    assert all(torch.equal(g, t) for g, t in zip(got, sent))


def test_schedule_mismatch_is_caught_at_the_header():
    hub = _Loopback()
    a, b = Channels(hub.endpoint(0)), Channels(hub.endpoint(1))
    a.send([torch.ones(2)], False, 1, (ACTIVATION, 0, 4))
    with pytest.raises(
        RuntimeError, match="micro-batch 4 where this rank expected .* micro-batch 3"
    ):
        b.recv(0, (ACTIVATION, 0, 3))


def test_unsupported_dtype_is_a_type_error():
    hub = _Loopback()
    with pytest.raises(TypeError, match="complex64"):
        Channels(hub.endpoint(0)).send([torch.zeros(2, dtype=torch.complex64)], False, 1, (1, 0, 0))
