// AVX-512 element loops for the CPU cast-and-scale (multi_tensor_cpu_avx512_piece.h), twice:
// as the rest of this build, and for CPUs with AVX512_BF16 too (its FP32 -> BF16 rounding in
// one instruction); castScaleRange picks by bf16InstructionsUsable() (cpu_isa.h).
#include <immintrin.h>

#include "kernels/cpu_isa.h"
#include "kernels/multi_tensor_cpu_range.h"
#include "kernels/multi_tensor_functors.h"

namespace dk::kernels {

namespace exact_bf16 {
#define DK_BF16_INSTRUCTIONS 0
#include "kernels/multi_tensor_cpu_avx512_piece.h"
#undef DK_BF16_INSTRUCTIONS
}  // namespace exact_bf16

#pragma GCC push_options
#pragma GCC target("avx512bf16")
namespace bf16_instructions {
#define DK_BF16_INSTRUCTIONS 1
#include "kernels/multi_tensor_cpu_avx512_piece.h"
#undef DK_BF16_INSTRUCTIONS
}  // namespace bf16_instructions
#pragma GCC pop_options

namespace avx512 {
Status castScaleRange(const TensorSegment* segments, int64_t num_segments, const int64_t* starts,
                      CpuRange range, const CastScaleArgs& args, float scale,
                      CpuRangeResult* result) {
  if (bf16InstructionsUsable()) {
    return castScaleRangeWith<bf16_instructions::Avx512Piece>(segments, num_segments, starts, range,
                                                              args, scale, result);
  }
  return castScaleRangeWith<exact_bf16::Avx512Piece>(segments, num_segments, starts, range, args,
                                                     scale, result);
}
}  // namespace avx512

}  // namespace dk::kernels
