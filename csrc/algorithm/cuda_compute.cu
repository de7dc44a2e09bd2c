// CudaCompute: see cuda_compute.h. Compiled only in CUDA builds (.cu).
#include "algorithm/cuda_compute.h"

#include <cuda_runtime_api.h>

#include "cuda/cuda_status.h"
#include "kernels/reduce.h"

namespace dk {

Status CudaCompute::reduce(void* dst, const void* a, const void* b, size_t count, DType dtype,
                           RedOp op) {
  if (count == 0) return Status::Ok();
  return kernels::reduceCuda(dst, a, b, count, dtype, op, stream_);
}

Status CudaCompute::reduceMulti(void* dst, const void* const* srcs, int nsrcs, size_t count,
                                DType dtype, RedOp op) {
  if (count == 0) return Status::Ok();
  return kernels::reduceMultiCuda(dst, srcs, nsrcs, count, dtype, op, stream_);
}

Status CudaCompute::reduceAverage(void* dst, const void* const* srcs, int nsrcs, size_t count,
                                  DType dtype, int64_t divisor) {
  if (count == 0) return Status::Ok();
  return kernels::reduceAverageCuda(dst, srcs, nsrcs, count, dtype, divisor, stream_);
}

Status CudaCompute::copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return Status::Ok();
  // cudaMemcpyDefault: with unified addressing the runtime tells device from pinned host memory,
  // so a staging slot or a caller's tensor may be either.
  DK_CHECK_CUDA(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream_)));
  return Status::Ok();
}

}  // namespace dk
