"""GPU tier guard: where the device check asks for the GPU tier (DK_REQUIRE_GPU=1), a tier that
cannot run fails here with the reason, instead of every GPU test skipping and the check passing.
"""

from __future__ import annotations

import os

import pytest

from dist_kernels.comm import cuda as _cuda_comm

pytestmark = pytest.mark.gpu


def test_gpu_tier_can_run_where_required():
    reason = _cuda_comm.unavailable_reason()
    if os.environ.get("DK_REQUIRE_GPU") != "1":
        pytest.skip("DK_REQUIRE_GPU is not 1 (benchmarks/device_check.sh sets it)")
    assert reason is None, f"the GPU tier cannot run here: {reason}"
