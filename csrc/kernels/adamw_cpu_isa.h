// The CPU AdamW loop as each instruction-set build exports it (adamw_cpu_impl.h); adamw_cpu.cc
// picks one per call from activeCpuIsa() (cpu_isa.h). Arguments arrive checked.
#pragma once

#include <cstddef>

#include "common/dtype.h"
#include "common/status.h"
#include "kernels/adamw.h"

#define DK_DECLARE_ADAMW_KERNEL(isa)                                                   \
  namespace dk::kernels::isa {                                                         \
  Status adamwPiece(const AdamWTensor& t, size_t begin, size_t end, DType param_dtype, \
                    DType grad_dtype, const AdamWHyper& hyper);                        \
  }

DK_DECLARE_ADAMW_KERNEL(baseline)
DK_DECLARE_ADAMW_KERNEL(avx2)
DK_DECLARE_ADAMW_KERNEL(avx512)

#undef DK_DECLARE_ADAMW_KERNEL
