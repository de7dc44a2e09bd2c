"""Ring attention: exact attention over a sequence sharded across the ranks of a communicator.

Every rank holds the queries, keys and values of its shard (``[batch, heads, seq / cp,
head_dim]``, the layout of :func:`~dist_kernels.context_parallel.shard_sequence`). Key/value
blocks travel around the ring of ranks by ``isend`` / ``irecv`` while each rank attends its
queries to the block it holds; the block results merge by their log-sum-exp::

    forward, cp steps (rank r, step s holds the keys/values of rank r - s):
        post the block's isend to r + 1 and the next block's irecv from r - 1
        attend the queries to the block held (layout.block: whole, half or nothing)
        merge:  out <- out + sigmoid(lse_b - lse) (out_b - out);  lse <- logaddexp(lse, lse_b)
        wait for the transfer
    backward, the ring in reverse (step s holds the keys/values of rank r + s):
        step 0      own block, first half of the query rows (its dk, dv stay on this rank)
        steps 1..   the visiting block's gradients (recomputed from the saved lse: no
                    probabilities are stored); add them to the block's dk, dv that arrived
                    from r + 1 (none at step 1: this rank is the block's first visitor);
                    pass them on to r - 1 (after the last step: the block's home)
        the end     own block, second half of the rows, while the other ranks' dk, dv of
                    the own block come home; add them

Heads are independent, so the ring runs once per group of heads, one group after another
(``layout.head_groups``: 8 groups for one sample of 8 or more heads, one per head or per sample
for fewer heads or more samples), on views of the shard, writing into one output. Whatever a
pass holds besides the inputs and the results (the visiting block and the next one, the
travelling key/value gradients and the next ones, the kernels' outputs) is one group's, so per
rank the peak of one attention's forward + backward is its results (out, lse; dq, dk, dv) plus
a few groups' worth of buffers (1/8 of a shard each): about half the single process's at
cp = 2.

Each transfer is posted before the computation it hides behind; the last hop home hides
behind the rows kept for the end (layout.own_block_split) and the next pass's first
computation; a pass's first hop (its own block, always there) is posted LOOKAHEAD passes
early. The passes are short (1/8 of the work), so this slack keeps ranks that drift apart
(time-sliced on a busy host) from waiting at every pass. Per rank the forward keeps q, k, v,
out and lse of its shard: memory grows with seq / cp. Block results merge in FP32 (FP64 for
FP64 inputs), as do the travelling key/value gradients.
"""

from __future__ import annotations

import math
from typing import Any, List, Optional

import torch
import torch.nn.functional as F
from torch.autograd.profiler import record_function

from ..dtypes import DTYPE_CODES
from . import block_attention, layout

__all__ = ["ring_attention"]

# record_function names; benchmarks/bench_cp.py sums the waits to measure exposed transfers
WAIT_EVENT = "cp.ring_wait"


class _Ring:
    """The two neighbours of this rank in the ring of ``comm``'s ranks."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank = 0 if comm is None else comm.rank
        self.size = 1 if comm is None else comm.world_size
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size

    def shift(self, send: torch.Tensor, recv: torch.Tensor, backward: bool = False) -> List:
        """Posts ``send`` to the next rank and a receive into ``recv`` from the previous one
        (the other way round when ``backward``)."""
        dst, src = (self.prev, self.next) if backward else (self.next, self.prev)
        return [self.comm.irecv(recv, src), self.comm.isend(send, dst)]

    @staticmethod
    def wait(works: List) -> None:
        if works:
            with record_function(WAIT_EVENT):
                for work in works:
                    work.wait()


def _merge(out, lse, rows: slice, out_b, lse_b):
    """Folds block results into the running ``out`` / ``lse`` rows (None: the first block)."""
    if out is None:
        return out_b.to(lse_b.dtype), lse_b
    o, m = out[:, :, rows], lse[:, :, rows]  # views: updated in place
    o.lerp_(out_b.to(o.dtype), torch.sigmoid(lse_b - m).unsqueeze(-1))
    m.sub_(F.logsigmoid(m - lse_b))  # = logaddexp(m, lse_b), without overflow
    return out, lse


def _attend(q, k, v, blk: layout.Block, scale: float):
    with record_function("cp.block_forward"):
        return block_attention.forward(
            q[:, :, blk.q], k[:, :, blk.kv], v[:, :, blk.kv], blk.causal, scale
        )


class _KeyValues:
    """The key/value block a rank holds, passed on around the ring: its own ``k``, ``v`` first
    (sent as they are, no copy when contiguous), then the blocks received, in at most two
    buffers that alternate (one at cp = 2)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, ring: _Ring, backward: bool) -> None:
        self.ring, self.backward = ring, backward
        self.held = (k, v)
        self._buffers: List[torch.Tensor] = []
        self._incoming: Optional[torch.Tensor] = None
        self._sending: List[torch.Tensor] = []

    def post(self) -> List:
        """Starts sending the held block on and receiving the next one."""
        held = self.held[0]
        free = [b for b in self._buffers if b.data_ptr() != held.data_ptr()]
        if not free:
            free = [torch.empty((2,) + tuple(held.shape), dtype=held.dtype)]
            self._buffers += free
        self._incoming = free[0]
        dst, src = (
            (self.ring.prev, self.ring.next) if self.backward else (self.ring.next, self.ring.prev)
        )
        comm = self.ring.comm
        self._sending = [part.contiguous() for part in self.held]  # kept until the sends end
        recvs = [comm.irecv(part, src) for part in self._incoming]
        return recvs + [comm.isend(part, dst) for part in self._sending]

    def take(self, pending: List) -> None:
        """Waits for :meth:`post`'s transfers; the received block is held from now on."""
        self.ring.wait(pending)
        self.held, self._sending = tuple(self._incoming), []

    def release(self) -> None:
        self._buffers, self._incoming, self.held = [], None, ()


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _group(t: torch.Tensor, group, per_kv: int = 1) -> torch.Tensor:
    """A view of one group of heads (``layout.head_groups``, over the key / value heads):
    ``[1, heads, seq, dim]``; ``per_kv``: query heads per key / value head, for a tensor of
    the queries' heads (grouped-query attention: query head ``h`` uses key / value head
    ``h // per_kv``, so a group of key / value heads serves a contiguous range of them)."""
    sample, heads = group
    return t[sample : sample + 1, heads.start * per_kv : heads.stop * per_kv]


def _passes(k, v, ring: _Ring, backward: bool):
    """The passes of the ring, one per group of heads: ``(group, its blocks)``."""
    groups = layout.head_groups(k.shape[0], k.shape[1])
    return [(g, _KeyValues(_group(k, g), _group(v, g), ring, backward)) for g in groups]


# a pass's first hop is posted this many passes early: slack for ranks that drift apart
LOOKAHEAD = 2


def _first_hop(blocks: Optional[_KeyValues]) -> List:
    """Posts a pass's first key/value hop (its own block: inputs, always there), LOOKAHEAD
    passes early (during the last computation of the pass LOOKAHEAD before it), so that it
    hides behind whole steps and the ranks need not arrive together at every pass. Nothing
    after the last pass or on one rank."""
    return [] if blocks is None or blocks.ring.size == 1 else blocks.post()


def _ahead(passes, i: int) -> Optional[_KeyValues]:
    """The blocks whose first hop pass ``i`` posts."""
    return passes[i + LOOKAHEAD][1] if i + LOOKAHEAD < len(passes) else None


def _forward(q, k, v, ring: _Ring, causal: bool, load_balance: bool, scale: float):
    """``(out, lse)`` of the shard: the ring once per group of heads, into one output."""
    out = torch.empty(q.shape, dtype=q.dtype)
    lse = torch.empty(q.shape[:3], dtype=_accumulate_dtype(q.dtype))
    passes = _passes(k, v, ring, backward=False)
    hops = [_first_hop(blocks) for _, blocks in passes[:LOOKAHEAD]]
    r = q.shape[1] // k.shape[1]
    for i, (group, blocks) in enumerate(passes):
        out_g, lse_g, posted = _forward_group(
            _group(q, group, r), blocks, hops[i], _ahead(passes, i), causal, load_balance, scale
        )
        hops.append(posted)
        _group(out, group, r).copy_(out_g)
        _group(lse, group, r).copy_(lse_g)
    return out, lse


def _forward_group(q, blocks: _KeyValues, pending, following, causal, load_balance, scale):
    """One pass: ``(out, lse, following's first hop)``; ``pending``: this pass's, posted."""
    ring, local = blocks.ring, q.shape[2]
    out = lse = ahead = None
    for step in range(ring.size):
        if step == ring.size - 1:
            ahead = _first_hop(following)
        elif step > 0:
            pending = blocks.post()
        blk = layout.block(ring.rank, (ring.rank - step) % ring.size, local, causal, load_balance)
        if blk is not None:
            out, lse = _merge(out, lse, blk.q, *_attend(q, *blocks.held, blk, scale))
        if step < ring.size - 1:
            blocks.take(pending)
    blocks.release()
    return out, lse, ahead


class _BlockGrads:
    """The gradients of one ring step's blocks: ``dq`` rows and ``dk`` / ``dv`` rows."""

    def __init__(self, saved, blocks: List[layout.Block], k, v, scale: float) -> None:
        grad_out, q, out, lse = saved
        self.parts = []
        for blk in blocks:
            with record_function("cp.block_backward"):
                grads = block_attention.backward(
                    grad_out[:, :, blk.q],
                    q[:, :, blk.q],
                    k[:, :, blk.kv],
                    v[:, :, blk.kv],
                    out[:, :, blk.q],
                    lse[:, :, blk.q],
                    blk.causal,
                    scale,
                )
            self.parts.append((blk, grads))

    def add_to(self, dq: torch.Tensor, dkv: torch.Tensor) -> None:
        for blk, (dq_b, dk_b, dv_b) in self.parts:
            dq[:, :, blk.q] += dq_b
            dkv[0][:, :, blk.kv] += dk_b
            dkv[1][:, :, blk.kv] += dv_b


def _backward(grad_out, q, k, v, out, lse, ring: _Ring, causal, load_balance, scale):
    """``(dq, dk, dv)`` of the shard: the reverse ring once per group of heads. A pass's key/
    value gradients come home behind the next pass's first computation (``finish``)."""
    grads = [torch.empty(t.shape, dtype=t.dtype) for t in (q, k, v)]
    passes = _passes(k, v, ring, backward=True)
    hops = [_first_hop(blocks) for _, blocks in passes[:LOOKAHEAD]]
    finish = None
    r = q.shape[1] // k.shape[1]
    for i, (group, blocks) in enumerate(passes):
        saved = [_group(t, group, r) for t in (grad_out, q, out, lse)]
        results = [_group(t, group, per_kv) for t, per_kv in zip(grads, (r, 1, 1))]
        chain = (hops[i], _ahead(passes, i), finish)
        finish, posted = _backward_group(saved, results, blocks, chain, causal, load_balance, scale)
        hops.append(posted)
    finish()
    return grads


def _backward_group(saved, results, blocks: _KeyValues, chain, causal, load_balance, scale):
    """One pass, into ``results`` (dq, dk, dv views). ``chain``: this pass's first hop
    (posted), the blocks whose first hop to post, the previous pass's ``finish`` (called
    once this pass's first computation is done). Returns ``(finish, the hop posted)``: finish
    waits for this pass's key/value gradients to come home and writes the results."""
    pending_kv, following, previous = chain
    ring, (k, v), q = blocks.ring, blocks.held, saved[1]
    local = q.shape[2]
    if ring.size == 1:  # one block: the kernel's gradients are the answer
        whole = layout.block(0, 0, local, causal, load_balance)
        for result, part in zip(results, _BlockGrads(saved, [whole], k, v, scale).parts[0][1]):
            result.copy_(part)
        return (lambda: None), []
    dq = torch.zeros(q.shape, dtype=saved[3].dtype)
    own = torch.zeros((2,) + tuple(k.shape), dtype=dq.dtype)  # the own block's dk, dv: stay
    early, late = layout.own_block_split(local, causal)
    _BlockGrads(saved, early, k, v, scale).add_to(dq, own)
    if previous is not None:
        previous()
    travelling = incoming = None
    pending_grads: List = []
    for step in range(1, ring.size):
        blocks.take(pending_kv)  # the block of rank + step
        pending_kv = blocks.post() if step < ring.size - 1 else []
        blk = layout.block(ring.rank, (ring.rank + step) % ring.size, local, causal, load_balance)
        grads = _BlockGrads(saved, [] if blk is None else [blk], *blocks.held, scale)
        if step == 1:  # this rank starts the visiting block's dk, dv
            travelling, incoming = torch.zeros_like(own), torch.empty_like(own)
        else:  # that block's dk, dv so far, from rank + 1
            ring.wait(pending_grads)
            travelling, incoming = incoming, travelling
        grads.add_to(dq, travelling)
        # on to rank - 1 (the block's home after the last step), while the next arrive
        pending_grads = ring.shift(travelling, incoming, backward=True)
    blocks.release()
    del grads
    posted = _first_hop(following)
    _BlockGrads(saved, late, k, v, scale).add_to(dq, own)
    results[0].copy_(dq)
    del dq

    def finish() -> None:
        ring.wait(pending_grads)  # every other rank's dk, dv of the own block
        own.add_(incoming)
        for result, part in zip(results[1:], own):
            result.copy_(part)

    return finish, posted


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, causal: bool, load_balance: bool, scale: float):
        out, lse = _forward(q, k, v, ring, causal, load_balance, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal, ctx.load_balance, ctx.scale = ring, causal, load_balance, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grads = _backward(
            grad_out, q, k, v, out, lse, ctx.ring, ctx.causal, ctx.load_balance, ctx.scale
        )
        return (*grads, None, None, None, None)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm: Any = None,
    *,
    causal: bool = False,
    load_balance: bool = True,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the keys and values of the whole sequence.

    Equals ``F.scaled_dot_product_attention`` on the unsharded ``q``, ``k``, ``v``, sharded
    the same way; gradients flow to this rank's ``q``, ``k`` and ``v``.

    Args:
        q, k, v: ``[batch, heads, seq / cp, head_dim]``, this rank's shard of the sequence
            (same dtype and device; CPU; float64, float32, bfloat16 or float16). k and v may
            have ``heads / r`` heads (grouped-query attention: query head ``h`` attends with
            key / value head ``h // r``): the ring then moves ``r`` times fewer bytes.
        comm: the context-parallel Communicator (``mesh.cp_comm``); None = one rank.
        causal: a causal mask over the global positions (``is_causal`` of the whole sequence).
        load_balance: the shards are zig-zag (:func:`shard_sequence`'s ``load_balance=True``:
            rank i holds chunks i and 2cp-1-i); False: contiguous. It only matters when causal.
        scale: softmax scale; default ``1 / sqrt(head_dim)``.

    Memory per rank: the forward saves q, k, v, out and lse of the shard; beyond them and the
    gradients, the ring holds one group of heads' buffers at a time (module docstring).

    Every rank of ``comm`` must call it with the same batch, heads, head_dim, shard length,
    dtype and options: they are exchanged first (one small all-gather) and a mismatch raises
    ``ValueError`` on every rank, showing each rank's values.
    """
    ring = _Ring(comm)
    _check_local(q, k, v, ring.rank)
    if ring.size > 1:
        _check_agree(q, k, ring, causal, load_balance)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _RingAttention.apply(q, k, v, ring, bool(causal), bool(load_balance), float(scale))


def _check_local(q, k, v, rank: int) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(
                f"[rank {rank}] ring_attention: {name} must be a 4-d tensor [batch, heads, "
                f"seq / cp, head_dim], got {getattr(t, 'shape', type(t).__name__)}"
            )
    grouped = q.shape[1] % k.shape[1] == 0 and (q.shape[0], *q.shape[2:]) == (
        k.shape[0],
        *k.shape[2:],
    )
    if not k.shape == v.shape or not (q.shape == k.shape or grouped):
        raise ValueError(
            f"[rank {rank}] ring_attention: q, k, v shapes differ: {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)} (one shard of one sequence each; k and v "
            "may have fewer heads than q, a divisor of them: grouped-query attention)"
        )
    if not q.dtype == k.dtype == v.dtype or not q.dtype.is_floating_point:
        raise TypeError(
            f"[rank {rank}] ring_attention: q, k, v must share one floating dtype, got "
            f"{q.dtype}, {k.dtype}, {v.dtype}"
        )
    block_attention.check_device(q, "ring_attention", rank)


_AGREE = (
    "batch", "heads", "seq / cp", "head_dim", "key / value heads", "dtype", "causal",
    "load_balance",
)  # fmt: skip


def _check_agree(q, k, ring: _Ring, causal: bool, load_balance: bool) -> None:
    """Every rank sees every rank's shape and options, so a mismatch raises everywhere."""
    mine = torch.tensor(
        [*q.shape, k.shape[1], DTYPE_CODES.get(q.dtype, -1), int(causal), int(load_balance)],
        dtype=torch.int64,
    )
    every = torch.empty(ring.size * mine.numel(), dtype=torch.int64)
    ring.comm.all_gather(every, mine)
    rows = every.view(ring.size, -1).tolist()
    for i, name in enumerate(_AGREE):
        values = [row[i] for row in rows]
        if len(set(values)) > 1:
            what = "shard lengths" if name == "seq / cp" else f"{name} values"
            raise ValueError(
                f"[rank {ring.rank}] ring_attention: {what} differ between ranks: {name} = "
                f"{values} on cp ranks 0..{ring.size - 1}; every rank must hold an equal shard "
                "of the same sequence (seq / cp tokens each) with the same options"
            )
    local = rows[0][2]
    if causal and load_balance and local % 2:
        raise ValueError(
            f"[rank {ring.rank}] ring_attention: a load-balanced shard is 2 chunks of "
            f"seq / (2 cp), but seq / cp = {local} is odd (seq = {local * ring.size} is not "
            f"divisible by 2 x cp({ring.size}) = {2 * ring.size})"
        )
