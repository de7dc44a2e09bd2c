// Launch helpers shared by the CUDA element-wise kernels (reduce_cuda.cu, cast_cuda.cu): packed
// vector types for 16-byte loads, the grid size, and the launch check that turns a CUDA error
// into a Status. Include only from .cu files.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/status.h"

namespace dk::kernels::cuda {

// N elements loaded or stored with one vector instruction per 16 bytes (a pack of 32 bytes, 8
// FP32 values, is two 16-byte loads); the pointer must be aligned to min(sizeof(Pack), 16)
// (checked on the host by isAligned before the vector path is chosen). 16 bytes is what a
// vector load needs: asking 32 for an FP32 pack would send a 16-byte aligned tensor (a view at
// an offset of 4 elements) down the scalar path.
template <typename T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Pack {
  T v[N];
};

template <typename T, int N>
constexpr size_t kPackAlignment = alignof(Pack<T, N>);

// Elements per 16 bytes of T: 4 for FP32, 8 for FP16 / BF16, 16 for int8.
template <typename T>
constexpr int kVecElems = 16 / sizeof(T);

constexpr int kThreadsPerBlock = 256;
// Grid-stride loops cover any size; 1024 blocks x 256 threads fill an H100 / H200 (132 SMs x
// 2048 resident threads) and stop launch overhead growing with the buffer.
constexpr unsigned kMaxBlocks = 1024;

inline unsigned gridFor(size_t work_items) {
  const size_t blocks = (work_items + kThreadsPerBlock - 1) / kThreadsPerBlock;
  if (blocks == 0) return 1;
  return blocks < kMaxBlocks ? static_cast<unsigned>(blocks) : kMaxBlocks;
}

inline bool isAligned(const void* p, size_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

// Call right after a launch: configuration errors and earlier sticky errors surface here.
inline Status checkLaunch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return Status::Ok();
  return Status(Code::kCudaError, std::string(kernel) + " launch failed: " + cudaGetErrorName(err) +
                                      ": " + cudaGetErrorString(err));
}

}  // namespace dk::kernels::cuda
