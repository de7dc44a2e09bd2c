// The CPU AdamW loop of the AVX2 build: Vec8, 8 floats a step (adamw_cpu_impl.h).
#include <cstring>
#include <type_traits>

#include "kernels/adamw.h"
#include "kernels/adamw_cpu_isa.h"
#include "kernels/adamw_dispatch.h"

namespace dk::kernels::avx2 {
#define DK_ADAMW_VEC Vec8
#include "kernels/adamw_cpu_impl.h"
#undef DK_ADAMW_VEC
}  // namespace dk::kernels::avx2
