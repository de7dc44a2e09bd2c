// Local arithmetic an algorithm step needs, behind one interface so that algorithms hold no
// kernel code: CpuCompute calls the CPU kernels directly; CudaCompute enqueues the CUDA kernels
// and copies on the communicator's stream. The dtype and reduce op are fixed per collective.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "common/status.h"

namespace dk {

class Compute {
 public:
  virtual ~Compute() = default;
  // dst[i] = op(a[i], b[i]); dst may alias a or b. AVG reduces as SUM (see reduceAverage()).
  virtual Status reduce(void* dst, const void* a, const void* b, size_t count, DType dtype,
                        RedOp op) = 0;
  // dst[i] = op(srcs[0][i], ...): one rounding for FP16/BF16 (FP32 accumulation).
  virtual Status reduceMulti(void* dst, const void* const* srcs, int nsrcs, size_t count,
                             DType dtype, RedOp op) = 0;
  // dst[i] = (srcs[0][i] + ...) / divisor: AVG's last reduce step, the one that completes the
  // sum, on the rank that owns the result; the divide rides in the same pass (AVG costs SUM's).
  virtual Status reduceAverage(void* dst, const void* const* srcs, int nsrcs, size_t count,
                               DType dtype, int64_t divisor) = 0;
  virtual Status copy(void* dst, const void* src, size_t bytes) = 0;
};

}  // namespace dk
