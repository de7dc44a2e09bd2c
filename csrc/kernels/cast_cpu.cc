// CPU cast-with-scale entry point: runs the instruction-set build activeCpuIsa() names.
#include "kernels/cpu_isa.h"
#include "kernels/reduce.h"
#include "kernels/reduce_cpu_isa.h"

namespace dk::kernels {

Status castScaleCpu(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t count,
                    float scale) {
  switch (activeCpuIsa()) {
    case CpuIsa::kAvx512:
      return avx512::castScale(dst, dst_dtype, src, src_dtype, count, scale);
    case CpuIsa::kAvx2:
      return avx2::castScale(dst, dst_dtype, src, src_dtype, count, scale);
    case CpuIsa::kBaseline:
      break;
  }
  return baseline::castScale(dst, dst_dtype, src, src_dtype, count, scale);
}

}  // namespace dk::kernels
