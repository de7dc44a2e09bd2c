"""DDP communication hooks with torch's contract, running on the dist_kernels Communicator.

``model.register_comm_hook(state, hook)`` then calls ``hook(state, bucket)`` for every bucket
of every synchronised backward, as torch DDP does; the hook returns a
``torch.futures.Future`` whose value is the bucket's reduced (averaged) buffer::

    model.register_comm_hook(None, dk.ddp_hooks.bf16_compress_hook)
    state = dk.ddp_hooks.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=10)
    model.register_comm_hook(state, dk.ddp_hooks.powerSGD_hook)

``bucket`` is a :class:`GradBucket` (torch's methods: ``index``, ``buffer``, ``set_buffer``,
``is_last``, ``parameters``, ``gradients``). The shipped hooks run their all-reduces on the
DDP's Communicator through :func:`all_reduce_future`; a hook may also use
``torch.distributed`` directly (its futures complete on their own).
"""

from __future__ import annotations

from typing import Any

import torch

from ..buckets.comm_hook import GradBucket, all_reduce_future, average_future, check_state
from ..buckets.kernels import pack, unpack
from .powersgd import PowerSGDState, powerSGD_hook

__all__ = [
    "GradBucket",
    "all_reduce_future",
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "PowerSGDState",
    "powerSGD_hook",
    "allreduce",
    "fp16_compress",
    "bf16_compress",
]


def allreduce_hook(state: Any, bucket: GradBucket) -> torch.futures.Future:
    """Averages the bucket: divide by the world size, all-reduce (torch's ``allreduce_hook``).

    Gives what DDP gives without a hook. ``state``: None, the DDP's Communicator or its group.
    """
    check_state(state, bucket, "allreduce_hook")
    return average_future(bucket, bucket.buffer())


def _compress_hook(dtype: torch.dtype, state: Any, bucket: GradBucket, what: str):
    check_state(state, bucket, what)
    reductions = bucket._reductions
    buffer = bucket.buffer()
    # One pass: divide by the world size in FP32 and round once to the wire dtype (torch
    # rounds, then divides in the wire dtype). The all-reduce accumulates in FP32.
    wire = reductions.scratch(("compress", bucket.index()), buffer.numel(), dtype)
    pack([buffer], wire, [0], 1.0 / reductions.comm.world_size)

    def decompress(future: torch.futures.Future) -> torch.Tensor:
        unpack(future.value(), [buffer], [0], 1.0)  # cast back into the bucket, one pass
        return buffer

    return all_reduce_future(bucket, wire).then(decompress)


def fp16_compress_hook(state: Any, bucket: GradBucket) -> torch.futures.Future:
    """Averages in FP16 on the wire (half the bytes of FP32), accumulating in FP32.

    Torch's ``fp16_compress_hook``: compress (cast, divide by the world size), all-reduce,
    decompress into the bucket. Ours divides before rounding and sums in FP32, so it rounds
    twice where torch's gloo path rounds at every step of the sum.
    """
    return _compress_hook(torch.float16, state, bucket, "fp16_compress_hook")


def bf16_compress_hook(state: Any, bucket: GradBucket) -> torch.futures.Future:
    """As :func:`fp16_compress_hook` with BF16 on the wire (torch's ``bf16_compress_hook``)."""
    return _compress_hook(torch.bfloat16, state, bucket, "bf16_compress_hook")


#: Short names (the same functions).
allreduce = allreduce_hook
fp16_compress = fp16_compress_hook
bf16_compress = bf16_compress_hook
