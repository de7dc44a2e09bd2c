"""Tensor (model) parallelism: layers whose weights are split over a tensor-parallel group.

    from dist_kernels import tensor_parallel as tp
    mesh = dk.ProcessMesh(dp=2, tp=2, pp=2)
    tp.model_parallel_seed(1234, mesh.tp_comm)
    fc = tp.ColumnParallelLinear(512, 2048, comm=mesh.tp_comm)
    proj = tp.RowParallelLinear(2048, 512, comm=mesh.tp_comm)
    y = proj(F.gelu(fc(x)))                     # one all-reduce forward, one backward

Modules: ``mappings`` (the autograd pairs), ``layers``, ``cross_entropy``, ``random`` (per-rank
RNG), ``shard`` (``shard_module`` and its plan styles), ``desync`` (the ``DK_DEBUG=1`` guard).
See docs/tensor_parallel.md.
"""

from .cross_entropy import vocab_parallel_cross_entropy
from .desync import TensorParallelDesyncError
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    is_tensor_parallel_shard,
)
from .mappings import (
    copy_to_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from .random import RNGStatesTracker, get_rng_tracker, model_parallel_seed
from .shard import (
    ColumnParallel,
    ReplicatedOverShards,
    RowParallel,
    SequenceParallel,
    ShardedDropout,
    VocabParallel,
    shard_module,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "is_tensor_parallel_shard",
    "vocab_parallel_cross_entropy",
    "copy_to_parallel_region",
    "reduce_from_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region",
    "RNGStatesTracker",
    "get_rng_tracker",
    "model_parallel_seed",
    "ColumnParallel",
    "RowParallel",
    "VocabParallel",
    "SequenceParallel",
    "ReplicatedOverShards",
    "ShardedDropout",
    "shard_module",
    "TensorParallelDesyncError",
]
