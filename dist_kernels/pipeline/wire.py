"""How a tensor or a tuple of tensors crosses from one stage's rank to another's.

Every transfer is, on one channel (a peer and a direction) and in schedule order::

    header   int64[4]: kind (1 activation, 2 gradient), stage, micro-batch, metadata length
    metadata int64[n] only when shapes or dtypes differ from the last transfer on the channel:
             is_tuple, count, then per tensor: dtype code, ndim, shape...
    payload  one message per tensor

so shapes and dtypes are agreed once and re-agreed when they change, and a peer that runs a
different schedule is caught at the header ("expected stage 2 micro-batch 3, got micro-batch 4")
instead of corrupting data. Dtypes the communicator cannot carry go as their bytes (uint8).
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
# What the communicator moves natively (dist_kernels._dtypes.SUPPORTED_DTYPES); the rest as bytes.
_NATIVE = set(_WIRE_DTYPES[:8])

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


def _as_wire(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t if t.dtype in _NATIVE else t.reshape(-1).view(torch.uint8)


class Channels:
    """Per-peer metadata caches for one rank's sends and receives."""

    def __init__(self, comm) -> None:
        self.comm = comm
        self.sent: Dict[Tuple[int, int], Meta] = {}
        self.received: Dict[Tuple[int, int], Meta] = {}

    def send(self, tensors: Sequence[torch.Tensor], is_tuple: bool, dst: int, tag: Tuple) -> None:
        """Sends ``tensors`` to ``dst``; ``tag`` = (kind, stage, micro-batch)."""
        meta = meta_of(tensors, is_tuple)
        changed = self.sent.get((dst, tag[0])) != meta
        header = torch.tensor([*tag, len(meta) if changed else 0], dtype=torch.int64)
        self.comm.send(header, dst)
        if changed:
            self.comm.send(torch.tensor(meta, dtype=torch.int64), dst)
            self.sent[(dst, tag[0])] = meta
        for t in tensors:
            if t.numel():
                self.comm.send(_as_wire(t), dst)

    def recv(self, src: int, tag: Tuple) -> Tuple[List[torch.Tensor], bool]:
        """Receives what the matching :meth:`send` sent; checks it is ``tag``."""
        header = torch.empty(4, dtype=torch.int64)
        self.comm.recv(header, src)
        kind, stage, microbatch, meta_len = header.tolist()
        if (kind, stage, microbatch) != tuple(tag):
            raise RuntimeError(
                f"rank {src} sent the {_KIND_NAMES.get(kind, kind)} of stage {stage}, micro-batch "
                f"{microbatch} where this rank expected the {_KIND_NAMES[tag[0]]} of stage "
                f"{tag[1]}, micro-batch {tag[2]}: the ranks run different schedules"
            )
        if meta_len:
            buf = torch.empty(meta_len, dtype=torch.int64)
            self.comm.recv(buf, src)
            self.received[(src, kind)] = tuple(buf.tolist())
        meta = self.received[(src, kind)]
        tensors = [self._recv_one(dtype, shape, src) for dtype, shape in describe_meta(meta)]
        return tensors, bool(meta[0])

    def _recv_one(self, dtype: torch.dtype, shape: Tuple[int, ...], src: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        if out.numel() == 0:
            return out
        if dtype in _NATIVE:
            self.comm.recv(out, src)
            return out
        raw = torch.empty(out.numel() * out.element_size(), dtype=torch.uint8)
        self.comm.recv(raw, src)
        return raw.view(dtype).reshape(shape)
