// Run-time choice of the CPU kernel build (see cpu_isa.h).
#include "kernels/cpu_isa.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace dk::kernels {

namespace {

// -1: not decided yet. Relaxed ordering suffices: every thread that races the first decision
// computes the same answer.
std::atomic<int> g_active_isa{-1};

bool cpuHasAvx512() {
  // The AVX-512 build is compiled with F, BW, VL and DQ (CMakeLists.txt), so the CPU must have
  // all of them even though the code asks only for F explicitly (Skylake-X and later).
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool cpuHasAvx2() {
  // F16C has no __builtin_cpu_supports name in GCC 12; every AVX2 CPU has it (Haswell+, Zen).
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

CpuIsa isaFromEnvironment() {
  const CpuIsa best = bestSupportedCpuIsa();
  const char* requested = std::getenv("DK_CPU_ISA");
  if (requested == nullptr || requested[0] == '\0') return best;
  CpuIsa isa;
  if (!parseCpuIsa(requested, &isa).ok() || static_cast<int>(isa) > static_cast<int>(best)) {
    std::fprintf(stderr, "dist_kernels: ignoring DK_CPU_ISA=%s (this CPU supports up to %s)\n",
                 requested, cpuIsaName(best));
    return best;
  }
  return isa;
}

}  // namespace

CpuIsa bestSupportedCpuIsa() {
  if (cpuHasAvx512()) return CpuIsa::kAvx512;
  if (cpuHasAvx2()) return CpuIsa::kAvx2;
  return CpuIsa::kBaseline;
}

CpuIsa activeCpuIsa() {
  int isa = g_active_isa.load(std::memory_order_relaxed);
  if (isa < 0) {
    isa = static_cast<int>(isaFromEnvironment());
    g_active_isa.store(isa, std::memory_order_relaxed);
  }
  return static_cast<CpuIsa>(isa);
}

Status setCpuIsa(CpuIsa isa) {
  if (static_cast<int>(isa) > static_cast<int>(bestSupportedCpuIsa())) {
    return InvalidArgument(std::string("isa: this CPU does not support ") + cpuIsaName(isa));
  }
  g_active_isa.store(static_cast<int>(isa), std::memory_order_relaxed);
  return Status::Ok();
}

const char* cpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kBaseline:
      return "baseline";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

Status parseCpuIsa(const std::string& name, CpuIsa* isa) {
  for (CpuIsa candidate : {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (name == cpuIsaName(candidate)) {
      *isa = candidate;
      return Status::Ok();
    }
  }
  return InvalidArgument("isa: unknown instruction set '" + name +
                         "'; expected baseline, avx2 or avx512");
}

bool bf16InstructionsUsable() {
  static const bool usable = [] {
    const char* env = std::getenv("DK_CPU_BF16");
    const bool off = env != nullptr && std::strcmp(env, "0") == 0;
    return !off && cpuHasAvx512() && __builtin_cpu_supports("avx512bf16");
  }();
  return usable;
}

}  // namespace dk::kernels
