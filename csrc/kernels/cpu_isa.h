// Which instruction-set build of the CPU kernels runs. Each hot loop is compiled three times
// (files *_avx512.cc, *_avx2.cc and a baseline x86-64 build, see CMakeLists.txt) and one is
// chosen at run time, so one wheel runs on any x86-64 machine and uses what the CPU has.
//
// Choice: the best level the CPU supports (__builtin_cpu_supports), unless the environment
// variable DK_CPU_ISA=baseline|avx2|avx512 asks for a lower one when first needed; tests force
// each compiled path with setCpuIsa().
#pragma once

#include <string>

#include "common/status.h"

namespace dk::kernels {

enum class CpuIsa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

// The level the kernels use now (decided once, on first call, unless set since).
CpuIsa activeCpuIsa();

// The best level this CPU supports.
CpuIsa bestSupportedCpuIsa();

// Forces a level; InvalidArgument if the CPU lacks it. Not meant to race with running kernels.
Status setCpuIsa(CpuIsa isa);

const char* cpuIsaName(CpuIsa isa);

// Parses "baseline" | "avx2" | "avx512"; InvalidArgument names the bad value.
Status parseCpuIsa(const std::string& name, CpuIsa* isa);

// Whether the AVX-512 build may round FP32 to BF16 with AVX512_BF16's vcvtneps2bf16: the CPU
// has it and DK_CPU_BF16 is not "0" (read once). The bits are the same either way (callers
// round vectors holding subnormals, which the instruction flushes, the exact way).
bool bf16InstructionsUsable();

}  // namespace dk::kernels
