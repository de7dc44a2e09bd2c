// CPU reduce / average / divide entry points: check the arguments once, then run the
// instruction-set build that activeCpuIsa() names (cpu_isa.h). Single-threaded: the communicator
// gives each rank one core; reduce_cpu_parallel.cc splits standalone calls across the thread pool.
#include <string>

#include "kernels/cpu_isa.h"
#include "kernels/reduce.h"
#include "kernels/reduce_cpu_isa.h"

namespace dk::kernels {

namespace {

Status checkDTypeAndOp(DType dtype, RedOp op) {
  if (!isValidDType(static_cast<int>(dtype))) {
    return TypeError("reduce: unsupported dtype code " + std::to_string(static_cast<int>(dtype)));
  }
  if (!isValidRedOp(static_cast<int>(op))) {
    return InvalidArgument("reduce: unsupported reduce op " + std::to_string(static_cast<int>(op)));
  }
  return Status::Ok();
}

}  // namespace

Status reduceCpu(void* dst, const void* a, const void* b, size_t count, DType dtype, RedOp op) {
  DK_RETURN_IF_ERROR(checkDTypeAndOp(dtype, op));
  switch (activeCpuIsa()) {
    case CpuIsa::kAvx512:
      return avx512::reduce(dst, a, b, count, dtype, op);
    case CpuIsa::kAvx2:
      return avx2::reduce(dst, a, b, count, dtype, op);
    case CpuIsa::kBaseline:
      break;
  }
  return baseline::reduce(dst, a, b, count, dtype, op);
}

Status reduceMultiCpu(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype,
                      RedOp op) {
  if (nsrcs < 1) return InvalidArgument("reduceMulti: needs at least one source");
  DK_RETURN_IF_ERROR(checkDTypeAndOp(dtype, op));
  switch (activeCpuIsa()) {
    case CpuIsa::kAvx512:
      return avx512::reduceMulti(dst, srcs, nsrcs, count, dtype, op);
    case CpuIsa::kAvx2:
      return avx2::reduceMulti(dst, srcs, nsrcs, count, dtype, op);
    case CpuIsa::kBaseline:
      break;
  }
  return baseline::reduceMulti(dst, srcs, nsrcs, count, dtype, op);
}

Status reduceAverageCpu(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype,
                        int64_t divisor) {
  if (nsrcs < 1) return InvalidArgument("reduceAverage: needs at least one source");
  if (divisor == 0) return InvalidArgument("reduceAverage: divisor is 0");
  DK_RETURN_IF_ERROR(checkDTypeAndOp(dtype, RedOp::kAvg));
  switch (activeCpuIsa()) {
    case CpuIsa::kAvx512:
      return avx512::reduceAverage(dst, srcs, nsrcs, count, dtype, divisor);
    case CpuIsa::kAvx2:
      return avx2::reduceAverage(dst, srcs, nsrcs, count, dtype, divisor);
    case CpuIsa::kBaseline:
      break;
  }
  return baseline::reduceAverage(dst, srcs, nsrcs, count, dtype, divisor);
}

// A divide on its own is an average of one source (the same DivideBy / ScaleBy math).
Status divideCpu(void* dst, const void* src, size_t count, DType dtype, int64_t divisor) {
  if (divisor == 0) return InvalidArgument("divide: divisor is 0");
  const void* srcs[1] = {src};
  return reduceAverageCpu(dst, srcs, 1, count, dtype, divisor);
}

}  // namespace dk::kernels
