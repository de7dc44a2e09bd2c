"""CPU tier for the CUDA communicator: what it says and checks where it cannot run.

On a machine without a GPU (or with a CPU-only build) ``Communicator(device="cuda")`` must
fail with the reason; input checks must reject host memory before anything reaches C++.
"""

from __future__ import annotations

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
