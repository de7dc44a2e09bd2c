// Standalone CPU entry points: the single-threaded kernels run on slices of the range, one per
// pool thread (cpu_thread_pool.h). Results are identical to the serial calls: every element is
// computed by the same code, only the thread differs.
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu_thread_pool.h"
#include "kernels/reduce.h"

namespace dk::kernels {

namespace {

// Below this many bytes touched (read + written), waking the pool costs more than it saves.
// Measured with an fp32 sum dst += src (AVX-512 build) on the shared 2-core Sapphire Rapids VM,
// median of 200 calls, serial time / pooled time:
//   touched   192 KiB: 0.75   768 KiB: 0.65-0.88   1.5 MiB: 0.65-0.73   3 MiB: 0.85-0.99
//   12 MiB: 0.93-0.97   48 MiB: 0.89   192 MiB: 0.76-1.26 (1.2-1.3 when the machine was quiet)
// The machine's other tenants (load average 8-18) kept the second core busy during most runs;
// on an idle machine the gain at large sizes is the second core's memory bandwidth. 2 MiB keeps
// the pool away from the sizes where it always lost.
constexpr size_t kParallelMinBytes = size_t{2} << 20;

const char* byteOffset(const void* base, size_t elements, size_t element_bytes) {
  return static_cast<const char*>(base) + elements * element_bytes;
}

}  // namespace

Status reduceMultiCpuParallel(void* dst, const void* const* srcs, int nsrcs, size_t count,
                              DType dtype, RedOp op) {
  if (nsrcs < 1 || !isValidDType(static_cast<int>(dtype))) {
    return reduceMultiCpu(dst, srcs, nsrcs, count, dtype, op);  // reports the error
  }
  const size_t size = dtypeSize(dtype);
  const bool split = count * size * (nsrcs + 1) >= kParallelMinBytes;
  return cpuParallelSlices(count, size, split, [&](size_t begin, size_t end) {
    std::vector<const void*> slice_srcs(nsrcs);
    for (int s = 0; s < nsrcs; ++s) slice_srcs[s] = byteOffset(srcs[s], begin, size);
    void* slice_dst = const_cast<char*>(byteOffset(dst, begin, size));
    return reduceMultiCpu(slice_dst, slice_srcs.data(), nsrcs, end - begin, dtype, op);
  });
}

Status divideCpuParallel(void* dst, const void* src, size_t count, DType dtype, int64_t divisor) {
  if (!isValidDType(static_cast<int>(dtype))) return divideCpu(dst, src, count, dtype, divisor);
  const size_t size = dtypeSize(dtype);
  const bool split = count * size * 2 >= kParallelMinBytes;
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
  const bool split = count * (dst_size + src_size) >= kParallelMinBytes;
  return cpuParallelSlices(count, dst_size, split, [&](size_t begin, size_t end) {
    void* slice_dst = const_cast<char*>(byteOffset(dst, begin, dst_size));
    return castScaleCpu(slice_dst, dst_dtype, byteOffset(src, begin, src_size), src_dtype,
                        end - begin, scale);
  });
}

}  // namespace dk::kernels
