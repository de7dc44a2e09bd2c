// The avx2 build of the CPU reduce kernels (flags from CMakeLists.txt; see reduce_cpu_impl.h).
#define DK_CPU_ISA_NS avx2
#include "kernels/reduce_cpu_impl.h"
