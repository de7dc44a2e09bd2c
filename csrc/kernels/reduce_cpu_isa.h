// The CPU kernels as each instruction-set build exports them: the same functions, compiled from
// reduce_cpu_impl.h / cast_cpu_impl.h into one namespace per build. reduce_cpu.cc and
// cast_cpu.cc pick one per call from activeCpuIsa() (cpu_isa.h); arguments arrive checked.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "common/status.h"

#define DK_DECLARE_CPU_KERNELS(isa)                                                              \
  namespace dk::kernels::isa {                                                                   \
  Status reduce(void* dst, const void* a, const void* b, size_t count, DType dtype, RedOp op);   \
  Status reduceMulti(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype,   \
                     RedOp op);                                                                  \
  Status reduceAverage(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype, \
                       int64_t divisor);                                                         \
  Status castScale(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t count,   \
                   float scale);                                                                 \
  }

DK_DECLARE_CPU_KERNELS(baseline)
DK_DECLARE_CPU_KERNELS(avx2)
DK_DECLARE_CPU_KERNELS(avx512)

#undef DK_DECLARE_CPU_KERNELS
