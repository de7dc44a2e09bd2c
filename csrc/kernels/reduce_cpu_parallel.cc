// Standalone CPU entry points: the single-threaded kernels run on slices of the range, one per
// pool thread (cpu_thread_pool.h). Results are identical to the serial calls: every element is
// computed by the same code, only the thread differs.
#include <atomic>
#include <cstdlib>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu_openmp.h"
#include "kernels/cpu_thread_pool.h"
#include "kernels/reduce.h"

namespace dk::kernels {

namespace {

// Below this many bytes touched (read + written), a standalone call runs on the caller alone.
//
// On the process's OpenMP runtime (torch's threads, cpu_openmp.h), 512 KiB: an fp32 sum
// dst += src alternating serial and split calls, quiet 2-core EPYC VM (2026-12-04 19:35, best of
// 3 rounds, operand size: serial / split GB/s): 128 KiB 83 / 67, 256 KiB 104 / 110, 512 KiB
// 109 / 153, 1 MiB 122 / 166, 4 MiB 136 / 244 (torch's add_ 242). Splitting pays from an operand
// of 256 KiB (768 KiB touched) and loses at 128 KiB (384 KiB).
//
// On our own pool (no OpenMP runtime in the process), 64 MiB. Measured with the same sum
// (AVX-512 build) on the shared 2-core Sapphire Rapids VM, serial time / pooled time, median
// (best) of 30-200 alternating calls, load average 15-20:
//   touched 0.75 MiB: 0.67-0.89 (0.68-0.88)   3 MiB: 0.76-0.85 (0.95)   12 MiB: 0.90-0.92
//   (0.92-0.95) 48 MiB: 0.20-0.26 (0.96-0.98)   192 MiB: 0.80-1.26 (0.81-0.92)
// and 1.2-1.3 at 192 MiB in a quieter moment (load average 2.5). A call of a few milliseconds
// or less loses a whole scheduler time slice whenever the OS preempts the worker in the middle
// of a part (the median collapses at 48 MiB); calls past 64 MiB span many time slices, so
// preemption evens out and the second core's bandwidth can show.
//
// DK_PARALLEL_MIN_BYTES sets either.
constexpr size_t kOpenmpParallelMinBytes = size_t{512} << 10;
constexpr size_t kOwnPoolParallelMinBytes = size_t{64} << 20;

size_t initialParallelMinBytes() {
  const char* env = std::getenv("DK_PARALLEL_MIN_BYTES");
  if (env != nullptr && env[0] != '\0') return static_cast<size_t>(std::strtoull(env, nullptr, 10));
  return openmpActive() ? kOpenmpParallelMinBytes : kOwnPoolParallelMinBytes;
}

std::atomic<size_t>& parallelMinBytes() {
  static std::atomic<size_t> min_bytes{initialParallelMinBytes()};
  return min_bytes;
}

const char* byteOffset(const void* base, size_t elements, size_t element_bytes) {
  return static_cast<const char*>(base) + elements * element_bytes;
}

// Runs kernel(dst slice, source slices, slice count) on the pool for an n-source call.
template <typename Kernel>
Status sourceSlices(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype,
                    Kernel kernel) {
  const size_t size = dtypeSize(dtype);
  const bool split = cpuWorthSplitting(count * size * (nsrcs + 1));
  return cpuParallelSlices(count, size, split, [&](size_t begin, size_t end) {
    // The sources' slice addresses: on the stack for the usual few (a heap vector per part
    // cost ~0.05 us each; our own pool cuts 8 parts per thread).
    constexpr int kOnStack = 8;
    const void* on_stack[kOnStack];
    std::vector<const void*> on_heap(nsrcs > kOnStack ? nsrcs : 0);
    const void** slice_srcs = nsrcs > kOnStack ? on_heap.data() : on_stack;
    for (int s = 0; s < nsrcs; ++s) slice_srcs[s] = byteOffset(srcs[s], begin, size);
    void* slice_dst = const_cast<char*>(byteOffset(dst, begin, size));
    return kernel(slice_dst, slice_srcs, end - begin);
  });
}

}  // namespace

size_t setCpuParallelMinBytes(size_t bytes) { return parallelMinBytes().exchange(bytes); }

bool cpuWorthSplitting(size_t touched_bytes) {
  return touched_bytes >= parallelMinBytes().load(std::memory_order_relaxed);
}

Status reduceMultiCpuParallel(void* dst, const void* const* srcs, int nsrcs, size_t count,
                              DType dtype, RedOp op) {
  if (nsrcs < 1 || !isValidDType(static_cast<int>(dtype))) {
    return reduceMultiCpu(dst, srcs, nsrcs, count, dtype, op);  // reports the error
  }
  return sourceSlices(dst, srcs, nsrcs, count, dtype, [&](void* d, const void* const* s, size_t n) {
    return reduceMultiCpu(d, s, nsrcs, n, dtype, op);
  });
}

Status reduceAverageCpuParallel(void* dst, const void* const* srcs, int nsrcs, size_t count,
                                DType dtype, int64_t divisor) {
  if (nsrcs < 1 || !isValidDType(static_cast<int>(dtype))) {
    return reduceAverageCpu(dst, srcs, nsrcs, count, dtype, divisor);  // reports the error
  }
  return sourceSlices(dst, srcs, nsrcs, count, dtype, [&](void* d, const void* const* s, size_t n) {
    return reduceAverageCpu(d, s, nsrcs, n, dtype, divisor);
  });
}

Status divideCpuParallel(void* dst, const void* src, size_t count, DType dtype, int64_t divisor) {
  if (!isValidDType(static_cast<int>(dtype))) return divideCpu(dst, src, count, dtype, divisor);
  const size_t size = dtypeSize(dtype);
  const bool split = cpuWorthSplitting(count * size * 2);
  return cpuParallelSlices(count, size, split, [&](size_t begin, size_t end) {
    void* slice_dst = const_cast<char*>(byteOffset(dst, begin, size));
    return divideCpu(slice_dst, byteOffset(src, begin, size), end - begin, dtype, divisor);
  });
}

Status castScaleCpuParallel(void* dst, DType dst_dtype, const void* src, DType src_dtype,
                            size_t count, float scale) {
  if (!isValidDType(static_cast<int>(dst_dtype)) || !isValidDType(static_cast<int>(src_dtype))) {
    return castScaleCpu(dst, dst_dtype, src, src_dtype, count, scale);
  }
  const size_t dst_size = dtypeSize(dst_dtype);
  const size_t src_size = dtypeSize(src_dtype);
  const bool split = cpuWorthSplitting(count * (dst_size + src_size));
  return cpuParallelSlices(count, dst_size, split, [&](size_t begin, size_t end) {
    void* slice_dst = const_cast<char*>(byteOffset(dst, begin, dst_size));
    return castScaleCpu(slice_dst, dst_dtype, byteOffset(src, begin, src_size), src_dtype,
                        end - begin, scale);
  });
}

}  // namespace dk::kernels
