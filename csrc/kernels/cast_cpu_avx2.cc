// The avx2 build of the CPU cast kernels (flags from CMakeLists.txt; see cast_cpu_impl.h).
#define DK_CPU_ISA_NS avx2
#include "kernels/cast_cpu_impl.h"
