// AVX2 + F16C + FMA build of the CPU cast-and-scale: the shared scalar functor loop compiled
// with those instruction sets (CMakeLists.txt gives *_avx2.cc the flags), which the compiler
// vectorises where it can. Chosen by cpu_isa.h on CPUs without AVX-512.
#include "kernels/multi_tensor_cpu_range.h"

namespace dk::kernels::avx2 {

Status castScaleRange(const TensorSegment* segments, int64_t num_segments, const int64_t* starts,
                      CpuRange range, const CastScaleArgs& args, float scale,
                      CpuRangeResult* result) {
  return castScaleRangeWith<ScalarPiece>(segments, num_segments, starts, range, args, scale,
                                         result);
}

}  // namespace dk::kernels::avx2
