// onDevice(device, fn): runs fn with CUDA device `device` current and restores the previous
// one, so a kernel or an NCCL call lands on the tensors' device whatever the caller's current
// device is (every binding that takes device memory goes through it). device < 0 is host
// memory: fn runs as it is. In a CPU-only build a device >= 0 is Unsupported.
#pragma once

#include <string>

#include "common/status.h"

#if DK_WITH_CUDA
#include <cuda_runtime_api.h>

#include "cuda/cuda_status.h"
#endif

namespace dk {

template <typename Fn>
Status onDevice(int device, Fn&& fn) {
  if (device < 0) return fn();
#if DK_WITH_CUDA
  int previous = -1;
  DK_CHECK_CUDA(cudaGetDevice(&previous));
  if (previous != device) DK_CHECK_CUDA(cudaSetDevice(device));
  Status status = fn();
  if (previous != device) {
    const cudaError_t restored = cudaSetDevice(previous);
    if (restored != cudaSuccess && status.ok()) return cudaStatus(restored, "cudaSetDevice");
  }
  return status;
#else
  return Unsupported("CUDA device " + std::to_string(device) +
                     ": dist_kernels was built without CUDA (this build is CPU-only)");
#endif
}

}  // namespace dk
