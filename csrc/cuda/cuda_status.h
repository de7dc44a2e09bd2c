// CUDA runtime errors as dk::Status (CUDA builds only). The lead may move this to common/.
#pragma once

#if DK_WITH_CUDA
#include <cuda_runtime_api.h>

#include <string>

#include "common/status.h"

namespace dk {

// "cudaMemcpyAsync(...) failed: an illegal memory access was encountered (700)".
inline Status cudaStatus(cudaError_t error, const char* what) {
  return Status(Code::kCudaError, std::string(what) + " failed: " + cudaGetErrorString(error) +
                                      " (" + std::to_string(static_cast<int>(error)) + ")");
}

}  // namespace dk

#ifndef DK_CHECK_CUDA
// Checks a CUDA runtime call; returns a kCudaError Status naming the call when it fails.
#define DK_CHECK_CUDA(call)                                                \
  do {                                                                     \
    cudaError_t dk_cuda_error_ = (call);                                   \
    if (dk_cuda_error_ != cudaSuccess) {                                   \
      cudaGetLastError(); /* clear a non-sticky error for the next call */ \
      return ::dk::cudaStatus(dk_cuda_error_, #call);                      \
    }                                                                      \
  } while (0)
#endif

#endif  // DK_WITH_CUDA
