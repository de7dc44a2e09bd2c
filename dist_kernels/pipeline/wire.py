"""How a tensor or a tuple of tensors crosses from one stage's rank to another's.

On one channel (a peer and a kind: activations or gradients) transfers follow schedule order,
and each is normally ONE message of bytes::

    | header int64[4]: kind, stage, micro-batch, metadata length (0 = unchanged) | payload |
    payload: every tensor's bytes, each starting at a multiple of 16 bytes

The receiver knows the message size from the metadata it has cached for the channel, so shapes
and dtypes are agreed once and re-agreed only when they change: then the sender fills the
size the receiver expects with a header that announces new metadata (int64[n]: is_tuple, count,
then per tensor dtype code, ndim, shape...), sends the metadata, and sends the transfer again in
the new size. A fresh channel expects an empty payload, so its first transfer takes that path.
The header also catches ranks that run different schedules ("expected stage 2 micro-batch 3,
got micro-batch 4") before any data is misread. Received tensors are views of the message
buffer: no copy on the receiving side.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

ACTIVATION, GRADIENT = 1, 2
_KIND_NAMES = {ACTIVATION: "activation", GRADIENT: "gradient"}

# Wire dtype codes (this protocol's own; the communicator never sees them).
_WIRE_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.int16,
)
_WIRE_CODE = {dtype: code for code, dtype in enumerate(_WIRE_DTYPES)}

Meta = Tuple[int, ...]


def describe_meta(meta: Meta) -> List[Tuple[torch.dtype, Tuple[int, ...]]]:
    """``[(dtype, shape), ...]`` from a metadata tuple."""
    out, i = [], 2
    for _ in range(meta[1]):
        dtype, ndim = _WIRE_DTYPES[meta[i]], meta[i + 1]
        out.append((dtype, tuple(meta[i + 2 : i + 2 + ndim])))
        i += 2 + ndim
    return out


def meta_of(tensors: Sequence[torch.Tensor], is_tuple: bool) -> Meta:
    """The metadata tuple of ``tensors``; ``TypeError`` for a dtype the wire cannot carry."""
    meta = [int(is_tuple), len(tensors)]
    for t in tensors:
        if t.dtype not in _WIRE_CODE:
            names = ", ".join(str(d) for d in _WIRE_DTYPES)
            raise TypeError(f"cannot send a {t.dtype} tensor between stages; supported: {names}")
        meta += [_WIRE_CODE[t.dtype], t.dim(), *t.shape]
    return tuple(meta)


HEADER_BYTES = 32
_ALIGN = 16
_EMPTY_META: Meta = (0, 0)


def _layout(meta: Meta) -> Tuple[List[int], int]:
    """Byte offsets of each tensor in the message, and the message size."""
    offsets, size = [], HEADER_BYTES
    for dtype, shape in describe_meta(meta):
        offsets.append(size)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        size += -(-nbytes // _ALIGN) * _ALIGN
    return offsets, size


class Channels:
    """Per-peer metadata caches and message buffers for one rank's sends and receives.

    Sends go out with the communicator's ``isend`` when it has one (the caller keeps the
    returned works and waits for them before reusing anything), else with ``send``.
    """

    def __init__(self, comm) -> None:
        self.comm = comm
        self.sent: Dict[Tuple[int, int], Meta] = {}
        self.received: Dict[Tuple[int, int], Meta] = {}
        self._isend = getattr(comm, "isend", None)

    def send(self, tensors: Sequence[torch.Tensor], is_tuple: bool, dst: int, tag: Tuple) -> List:
        """Sends ``tensors`` to ``dst``; ``tag`` = (kind, stage, micro-batch).

        Returns the works of the messages still in flight (empty without ``isend``); each keeps
        its message alive. ``tensors`` themselves may be reused at once (they are copied).
        """
        meta = meta_of(tensors, is_tuple)
        expected = self.sent.get((dst, tag[0]), _EMPTY_META)
        works = []
        if meta != expected:
            announce = torch.zeros(_layout(expected)[1], dtype=torch.uint8)
            _write_header(announce, (*tag, len(meta)))
            works.append(self._post(announce, dst))
            works.append(self._post(torch.tensor(meta, dtype=torch.int64), dst))
            self.sent[(dst, tag[0])] = meta
        offsets, size = _layout(meta)
        message = torch.empty(size, dtype=torch.uint8)
        _write_header(message, (*tag, 0))
        for t, offset in zip(tensors, offsets):
            nbytes = t.numel() * t.element_size()
            if nbytes:
                flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
                message[offset : offset + nbytes].copy_(flat)
        works.append(self._post(message, dst))
        return [w for w in works if w is not None]

    def sent_bytes(self, dst: int, kind: int) -> int:
        """The size of the messages last sent to ``dst`` on channel ``kind`` (0: none yet)."""
        meta = self.sent.get((dst, kind))
        return _layout(meta)[1] if meta is not None else 0

    def _post(self, message: torch.Tensor, dst: int):
        if self._isend is not None:
            return self._isend(message, dst)
        self.comm.send(message, dst)
        return None

    def recv(self, src: int, tag: Tuple) -> Tuple[List[torch.Tensor], bool]:
        """Receives what the matching :meth:`send` sent; checks it is ``tag``."""
        meta = self.received.get((src, tag[0]), _EMPTY_META)
        message, meta_len = self._recv_message(src, tag, meta)
        if meta_len:
            buf = torch.empty(meta_len, dtype=torch.int64)
            self.comm.recv(buf, src)
            meta = self.received[(src, tag[0])] = tuple(buf.tolist())
            message, _ = self._recv_message(src, tag, meta)
        offsets, _ = _layout(meta)
        tensors = [
            message[o : o + torch.Size(shape).numel() * d.itemsize].view(d).reshape(shape)
            for o, (d, shape) in zip(offsets, describe_meta(meta))
        ]
        return tensors, bool(meta[0])

    def _recv_message(self, src: int, tag: Tuple, meta: Meta) -> Tuple[torch.Tensor, int]:
        message = torch.empty(_layout(meta)[1], dtype=torch.uint8)
        self.comm.recv(message, src)
        kind, stage, microbatch, meta_len = message[:HEADER_BYTES].view(torch.int64).tolist()
        if (kind, stage, microbatch) != tuple(tag):
            raise RuntimeError(
                f"rank {src} sent the {_KIND_NAMES.get(kind, kind)} of stage {stage}, micro-batch "
                f"{microbatch} where this rank expected the {_KIND_NAMES[tag[0]]} of stage "
                f"{tag[1]}, micro-batch {tag[2]}: the ranks run different schedules"
            )
        return message, meta_len


def _write_header(message: torch.Tensor, fields: Tuple[int, int, int, int]) -> None:
    message[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor(fields, dtype=torch.int64))
