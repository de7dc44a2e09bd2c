// Compute on host memory: the CPU kernels of csrc/kernels/, called directly on this thread.
#pragma once

#include "algorithm/compute.h"

namespace dk {

class CpuCompute : public Compute {
 public:
  Status reduce(void* dst, const void* a, const void* b, size_t count, DType dtype,
                RedOp op) override;
  Status reduceMulti(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype,
                     RedOp op) override;
  Status reduceAverage(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype,
                       int64_t divisor) override;
  Status copy(void* dst, const void* src, size_t bytes) override;
};

}  // namespace dk
