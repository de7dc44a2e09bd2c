// The avx512 build of the CPU reduce kernels (flags from CMakeLists.txt; see reduce_cpu_impl.h).
#define DK_CPU_ISA_NS avx512
#include "kernels/reduce_cpu_impl.h"
