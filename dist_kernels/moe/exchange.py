"""The token all-to-all as an autograd function, and the registered buffers it sends from.

    forward:   send = x[index]  (rows gathered straight into a registered buffer)
               out  = all_to_all(send, send_rows -> recv_rows)
    backward:  g    = all_to_all(grad_out, recv_rows -> send_rows)     (the reverse exchange)
               grad_x = zeros.index_add_(0, index, g)

Gathering the rows into the communicator's registered memory (``comm.empty``) is the
permutation itself; the peer then copies its block out of that memory into its output, so a row
is copied once to leave and once to arrive (csrc/algorithm/all_to_all.h). The buffer is shared
by every exchange on one communicator (the calls are synchronous) and grows collectively: every
rank knows every rank's row counts from the count exchange, so all agree on the size.
"""

from __future__ import annotations

import weakref
from typing import Any, List, Sequence

import torch

__all__ = ["RowExchange", "exchange_rows"]

_buffers: weakref.WeakKeyDictionary[Any, torch.Tensor] = weakref.WeakKeyDictionary()


def send_buffer(comm: Any, elements: int, dtype: torch.dtype) -> torch.Tensor:
    """A registered 1-D buffer of at least ``elements`` (the same call on every rank)."""
    buf = _buffers.get(comm)
    if buf is None or buf.dtype != dtype or buf.numel() < elements:
        size = 1 << max(16, (max(elements, 1) - 1).bit_length())  # doubling: few regrowths
        buf = comm.empty(size, dtype) if hasattr(comm, "empty") else torch.empty(size, dtype=dtype)
        _buffers[comm] = buf
    return buf


def _all_to_all(
    comm: Any, rows: torch.Tensor, sends: Sequence[int], recvs: Sequence[int], buffer_elems: int
) -> torch.Tensor:
    """``rows`` [sum(sends), d] exchanged by row counts; through the registered buffer."""
    d = rows.shape[1]
    buf = send_buffer(comm, buffer_elems, rows.dtype)[: rows.numel()].view_as(rows)
    buf.copy_(rows)
    out = rows.new_empty(sum(recvs), d)
    comm.all_to_all(out.view(-1), buf.view(-1), [s * d for s in sends], [r * d for r in recvs])
    return out


class RowExchange(torch.autograd.Function):
    """``all_to_all(x[index])`` by row counts; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, index, comm, sends: List[int], recvs: List[int], buffer_rows: int):
        ctx.comm, ctx.sends, ctx.recvs = comm, sends, recvs
        ctx.buffer_elems, ctx.rows = buffer_rows * x.shape[1], x.shape[0]
        ctx.save_for_backward(index)
        d = x.shape[1]
        buf = send_buffer(comm, ctx.buffer_elems, x.dtype)[: index.numel() * d].view(-1, d)
        torch.index_select(x, 0, index, out=buf)  # the permutation, into registered memory
        out = x.new_empty(sum(recvs), d)
        comm.all_to_all(out.view(-1), buf.view(-1), [s * d for s in sends], [r * d for r in recvs])
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (index,) = ctx.saved_tensors
        g = _all_to_all(ctx.comm, grad_out.contiguous(), ctx.recvs, ctx.sends, ctx.buffer_elems)
        grad_x = g.new_zeros(ctx.rows, g.shape[1]).index_add_(0, index, g)
        return grad_x, None, None, None, None, None


def exchange_rows(
    x: torch.Tensor,
    index: torch.Tensor,
    comm: Any,
    sends: List[int],
    recvs: List[int],
    buffer_rows: int,
) -> torch.Tensor:
    """Rows ``x[index]`` sent by ``sends`` row counts per rank, ``recvs`` received; the
    registered buffer holds ``buffer_rows`` rows (the largest count of any rank, either way)."""
    return RowExchange.apply(x, index, comm, sends, recvs, buffer_rows)
