// CudaCompute: the Compute interface on device memory. Every call enqueues our CUDA kernels
// (csrc/kernels/reduce.h) or a cudaMemcpyAsync on the communicator's stream and returns at
// once; the algorithm's steps are thus ordered by the stream, not by the host.
#pragma once

#include "algorithm/compute.h"

namespace dk {

class CudaCompute final : public Compute {
 public:
  // `stream` is a cudaStream_t owned by the communicator; it must outlive this object.
  explicit CudaCompute(void* stream) : stream_(stream) {}

  Status reduce(void* dst, const void* a, const void* b, size_t count, DType dtype,
                RedOp op) override;
  // `srcs` is a host array of device pointers, as in reduceMultiCuda (also reduceAverage).
  Status reduceMulti(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype,
                     RedOp op) override;
  Status reduceAverage(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype,
                       int64_t divisor) override;
  Status copy(void* dst, const void* src, size_t bytes) override;

  void* stream() const { return stream_; }

 private:
  void* stream_;
};

}  // namespace dk
