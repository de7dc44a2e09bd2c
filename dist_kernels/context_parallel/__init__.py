"""Context parallelism: the sequence of every sample split across ranks, attention exact.

    mesh = dk.ProcessMesh(dp=1, pp=1, tp=1, cp=2)
    from dist_kernels import context_parallel as cp
    x = cp.shard_sequence(x, mesh.cp_comm, dim=1)            # zig-zag: chunks i and 2cp-1-i
    out = cp.ring_attention(q, k, v, comm=mesh.cp_comm, causal=True)
    x_full = cp.gather_sequence(x_shard, mesh.cp_comm, dim=1)

Files: ``layout`` (pure: which tokens a rank holds, which blocks a ring step computes),
``block_attention`` (torch's flash kernels for one block, with the log-sum-exp),
``ring_attention`` (the ring, forward and backward), ``sequence`` (shard / gather, positions,
the loss over a sharded sequence). See docs/context_parallel.md.
"""

from .ring_attention import ring_attention
from .sequence import (
    SequenceSharding,
    gather_sequence,
    positions,
    sequence_mean,
    shard_sequence,
)

__all__ = [
    "ring_attention",
    "shard_sequence",
    "gather_sequence",
    "positions",
    "sequence_mean",
    "SequenceSharding",
]
