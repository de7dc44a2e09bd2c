#include "algorithm/cpu_compute.h"

#include <cstring>

#include "kernels/reduce.h"

namespace dk {

Status CpuCompute::reduce(void* dst, const void* a, const void* b, size_t count, DType dtype,
                          RedOp op) {
  if (count == 0) return Status::Ok();
  return kernels::reduceCpu(dst, a, b, count, dtype, op);
}

Status CpuCompute::reduceMulti(void* dst, const void* const* srcs, int nsrcs, size_t count,
                               DType dtype, RedOp op) {
  if (count == 0) return Status::Ok();
  return kernels::reduceMultiCpu(dst, srcs, nsrcs, count, dtype, op);
}

Status CpuCompute::reduceAverage(void* dst, const void* const* srcs, int nsrcs, size_t count,
                                 DType dtype, int64_t divisor) {
  if (count == 0) return Status::Ok();
  return kernels::reduceAverageCpu(dst, srcs, nsrcs, count, dtype, divisor);
}

Status CpuCompute::copy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0 && dst != src) std::memcpy(dst, src, bytes);
  return Status::Ok();
}

}  // namespace dk
