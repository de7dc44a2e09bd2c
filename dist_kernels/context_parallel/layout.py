"""Where each context-parallel rank's tokens lie in the sequence, and which part of the
attention matrix each ring step computes. Pure: no tensors move here.

Load-balanced (zig-zag) sharding cuts the sequence into 2 cp chunks; rank i holds chunks i and
2cp-1-i, back to back (Megatron-Core's and torch's head-tail layout)::

    cp = 4: 8 chunks of seq / 8
        sequence   | c0 | c1 | c2 | c3 | c4 | c5 | c6 | c7 |
        held by      r0   r1   r2   r3   r3   r2   r1   r0
        rank 1's shard: [c1, c6]   (local positions 0..2c-1 = global c1 then c6)

Without load balancing rank i holds the i-th contiguous seq / cp.

Ring attention puts query shard r against the key/value shard of every rank j. Under a
causal mask, query chunk a sees key chunk b fully when a > b, triangularly when a == b (the
mask ``tril``, top-left aligned) and not at all when a < b. For the zig-zag shards that gives,
with both shards cut into a first and a second half (one chunk each)::

    j == r   causal attention of the whole local shard (c_r before c_{2cp-1-r}: local order
             is global order)
    j <  r   every query, the first half of the keys (chunk j), no mask
    j >  r   the second half of the queries (chunk 2cp-1-r), every key, no mask

So every step but the first costs half a shard-by-shard block, on every rank: the work is even.
Contiguous shards give j == r causal, j < r the whole block unmasked, j > r nothing: rank r
works r + 1 steps out of cp. Without a causal mask every step is the whole block.

Heads are independent, so the ring runs once per group of heads, one group after another
(:func:`head_groups`): whatever the ring holds besides its inputs and results (the visiting
block, the travelling key/value gradients, the kernels' outputs) is one group's, at most
``1 / MAX_HEAD_GROUPS`` of a shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

# 8 groups bound the ring's transient memory to 1/8 of a shard per buffer, while one group's
# block (seq / cp rows of heads / 8 heads) is still ample compute to hide its transfer behind
MAX_HEAD_GROUPS = 8


@dataclass(frozen=True)
class Block:
    """One ring step's attention: local query rows ``q`` against local key rows ``kv`` of the
    visiting shard, with a top-left causal mask when ``causal``."""

    q: slice
    kv: slice
    causal: bool


def check_split(seq_len: int, cp: int, load_balance: bool, what: str, rank: int) -> int:
    """``seq_len / (2 cp)`` (load balance) or ``seq_len / cp``; ValueError with the arithmetic
    when it does not divide."""
    parts = 2 * cp if load_balance else cp
    if seq_len % parts:
        how = f"2 x cp({cp}) = {parts}" if load_balance else f"cp({cp})"
        why = " (load balancing cuts it into 2 cp chunks)" if load_balance else ""
        raise ValueError(
            f"[rank {rank}] {what}: sequence length {seq_len} is not divisible by {how}{why}: "
            f"{seq_len} % {parts} = {seq_len % parts}"
        )
    return seq_len // parts


def chunk_order(cp: int, load_balance: bool) -> List[int]:
    """The global chunks in shard order: rank 0's, then rank 1's, ... (``2 cp`` chunks with
    load balance, ``cp`` without)."""
    if not load_balance:
        return list(range(cp))
    return [c for rank in range(cp) for c in (rank, 2 * cp - 1 - rank)]


def positions(seq_len: int, rank: int, cp: int, load_balance: bool) -> List[int]:
    """The global positions of rank ``rank``'s tokens, in local order."""
    chunk = check_split(seq_len, cp, load_balance, "positions", rank)
    per_rank = 2 if load_balance else 1
    mine = chunk_order(cp, load_balance)[rank * per_rank : (rank + 1) * per_rank]
    return [c * chunk + i for c in mine for i in range(chunk)]


def block(
    q_rank: int, kv_rank: int, local_len: int, causal: bool, load_balance: bool
) -> Optional[Block]:
    """What query shard ``q_rank`` computes against key/value shard ``kv_rank`` (both
    ``local_len`` long); None when the mask hides the whole block (drawn above)."""
    whole = slice(0, local_len)
    if not causal:
        return Block(whole, whole, False)
    if q_rank == kv_rank:
        return Block(whole, whole, True)
    if not load_balance:
        return Block(whole, whole, False) if kv_rank < q_rank else None
    half = local_len // 2
    if kv_rank < q_rank:
        return Block(whole, slice(0, half), False)
    return Block(slice(half, local_len), whole, False)


def own_block_split(local_len: int, causal: bool) -> Tuple[List[Block], List[Block]]:
    """The backward's own block as ``(early, late)``: the query rows of the first half, done
    at the first ring step, and those of the second half, kept for the end so that the last
    hop of the travelling key/value gradients (home) hides behind them. Under a causal mask the
    second half's rows see the first half's keys unmasked and their own half causally::

        keys ->   first half   second half
        rows 0..h    tril          -          early
        rows h..L    full         tril        late (two blocks)
    """
    half = local_len // 2
    first, second, whole = slice(0, half), slice(half, local_len), slice(0, local_len)
    if not causal:
        early, late = [Block(first, whole, False)], [Block(second, whole, False)]
    else:
        early = [Block(first, first, True)]
        late = [Block(second, first, False), Block(second, second, True)]
    return _non_empty(early), _non_empty(late)


def _non_empty(blocks: List[Block]) -> List[Block]:
    return [b for b in blocks if b.q.stop > b.q.start and b.kv.stop > b.kv.start]


def head_groups(batch: int, heads: int) -> List[Tuple[int, slice]]:
    """``(sample, heads)`` pairs, one per pass of the ring: each sample's heads cut into
    ``min(heads, max(1, MAX_HEAD_GROUPS // batch))`` contiguous ranges, sizes within one (a
    group is a view of a ``[batch, heads, seq, dim]`` tensor, contiguous when the tensor is)."""
    per_sample = max(1, min(heads, MAX_HEAD_GROUPS // max(batch, 1)))
    size, extra = divmod(heads, per_sample)
    bounds = [i * size + min(i, extra) for i in range(per_sample + 1)]
    return [(b, slice(bounds[i], bounds[i + 1])) for b in range(batch) for i in range(per_sample)]
