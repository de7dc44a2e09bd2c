// Fused AdamW step over a list of tensors (or flat buffers): one pass reads the parameter,
// gradient and moments of each element and writes them back. Kernels compute on local memory
// and never communicate.
#pragma once

#include <cstddef>

#include "common/dtype.h"
#include "common/status.h"
#include "kernels/adamw_functor.h"

namespace dk::kernels {

// One tensor's buffers, each of `count` elements. `param` and `grad` have the call's parameter
// and gradient dtypes (float32, float16 or bfloat16); the moments are float32.
struct AdamWTensor {
  void* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // non-null exactly when amsgrad is on
  float* master;          // optional FP32 master copy of `param`: updated, then rounded into it
  size_t count;
};

// Checks what both kernels need: floating dtypes, non-null buffers, vmax iff amsgrad.
Status validateAdamW(const AdamWTensor* tensors, int ntensors, DType param_dtype, DType grad_dtype,
                     const AdamWHyper& hyper);

// Updates every tensor in place on the calling thread.
Status adamwCpu(const AdamWTensor* tensors, int ntensors, DType param_dtype, DType grad_dtype,
                const AdamWHyper& hyper);

#if DK_WITH_CUDA
// The same update on device memory, enqueued on `stream` (a cudaStream_t); returns once enqueued.
Status adamwCuda(const AdamWTensor* tensors, int ntensors, DType param_dtype, DType grad_dtype,
                 const AdamWHyper& hyper, void* stream);
#endif

}  // namespace dk::kernels
