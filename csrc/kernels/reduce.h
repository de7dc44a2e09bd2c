// Element-wise kernels on local memory: reduce, reduce-and-divide (AVG's last step), divide,
// cast with scale.
// They never communicate. CPU versions are single-threaded: the communicator gives each rank
// one core; ops.py parallelises standalone calls where that pays.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "common/status.h"

namespace dk::kernels {

// dst[i] = op(a[i], b[i]) for i < count. dst may alias a or b. AVG reduces as SUM.
Status reduceCpu(void* dst, const void* a, const void* b, size_t count, DType dtype, RedOp op);

// dst[i] = op(srcs[0][i], ..., srcs[nsrcs-1][i]); FP16/BF16 accumulate in FP32 and round once.
// dst may alias srcs[0]. AVG reduces as SUM.
Status reduceMultiCpu(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype,
                      RedOp op);

// dst[i] = (srcs[0][i] + ... + srcs[nsrcs-1][i]) / divisor in one pass: AVG's last reduce step,
// whose divisor (the world size) need not be nsrcs. The sum is reduceMultiCpu's SUM (integers
// wrap in the dtype; FP16 / BF16 accumulate in FP32); the division is divideCpu's (integers
// truncate toward zero in int64), done before FP16 / BF16 round once. dst may alias srcs[0].
Status reduceAverageCpu(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype,
                        int64_t divisor);

// dst[i] = src[i] / divisor, a pass of its own (ops.divide_). Integer types truncate toward zero.
Status divideCpu(void* dst, const void* src, size_t count, DType dtype, int64_t divisor);

// dst[i] = (dst_dtype)(src[i] * scale) for float32 / float16 / bfloat16 pairs, rounding once to
// nearest even; overflow becomes inf.
Status castScaleCpu(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t count,
                    float scale);

// Standalone entry points (dist_kernels.ops): the same results as the functions above, split
// across the CPU thread pool (cpu_thread_pool.h) when the call is large enough to gain from it.
Status reduceMultiCpuParallel(void* dst, const void* const* srcs, int nsrcs, size_t count,
                              DType dtype, RedOp op);
Status reduceAverageCpuParallel(void* dst, const void* const* srcs, int nsrcs, size_t count,
                                DType dtype, int64_t divisor);
Status divideCpuParallel(void* dst, const void* src, size_t count, DType dtype, int64_t divisor);
Status castScaleCpuParallel(void* dst, DType dst_dtype, const void* src, DType src_dtype,
                            size_t count, float scale);
// Calls touching fewer bytes (read + written) than this stay on the caller's thread; default
// 64 MiB or DK_PARALLEL_MIN_BYTES (see reduce_cpu_parallel.cc). Returns the previous value.
size_t setCpuParallelMinBytes(size_t bytes);
// True if a standalone call touching `touched_bytes` (read + written) is worth splitting.
bool cpuWorthSplitting(size_t touched_bytes);

#if DK_WITH_CUDA
// The same operations on device memory, enqueued on `stream` (a cudaStream_t); they return
// once enqueued.
Status reduceCuda(void* dst, const void* a, const void* b, size_t count, DType dtype, RedOp op,
                  void* stream);
Status reduceMultiCuda(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype,
                       RedOp op, void* stream);
Status reduceAverageCuda(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype,
                         int64_t divisor, void* stream);
Status divideCuda(void* dst, const void* src, size_t count, DType dtype, int64_t divisor,
                  void* stream);
Status castScaleCuda(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t count,
                     float scale, void* stream);
#endif

}  // namespace dk::kernels
