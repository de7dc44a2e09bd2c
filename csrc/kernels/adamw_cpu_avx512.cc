// The CPU AdamW loop of the AVX-512 build: Vec16, 16 floats a step (adamw_cpu_impl.h).
#include <cstring>
#include <type_traits>

#include "kernels/adamw.h"
#include "kernels/adamw_cpu_isa.h"
#include "kernels/adamw_dispatch.h"

namespace dk::kernels::avx512 {
#define DK_ADAMW_VEC Vec16
#include "kernels/adamw_cpu_impl.h"
#undef DK_ADAMW_VEC
}  // namespace dk::kernels::avx512
