// One definition of the cast-and-scale math (multi_tensor.h), shared by the CPU loops and the
// CUDA kernel so that CPU tests check the arithmetic the GPU runs. The AVX-512 path
// (multi_tensor_cpu_avx512.cc) computes the same expressions lane-wise; tests compare them.
#pragma once

#include <cmath>

#include "common/half.h"
#include "common/macros.h"

namespace dk::kernels {

// Smallest magnitude that rounds to inf in T (round to nearest even): half's largest finite
// value 65504 has an odd mantissa, so the tie 65520 rounds up to inf; bfloat16 likewise at
// 0x7F7F8000 (largest finite 0x7F7F plus half an ulp). A value v stays finite in T exactly when
// |v| < limit, and NaN fails that comparison too: one compare checks inf, NaN and overflow.
template <typename T>
DK_HOST_DEVICE DK_INLINE float overflowLimit() {
  return bitsFloat(0x7F800000u);
}
template <>
DK_HOST_DEVICE DK_INLINE float overflowLimit<Half>() {
  return 65520.0f;
}
template <>
DK_HOST_DEVICE DK_INLINE float overflowLimit<BFloat16>() {
  return bitsFloat(0x7F7F8000u);
}

// Element op: returns the stored value; sets `nonfinite` if it is inf or NaN.
template <typename Src, typename Dst, bool kAccumulate>
struct CastScaleOp {
  float scale;

  DK_HOST_DEVICE DK_INLINE Dst operator()(Src x, Dst old, bool& nonfinite) const {
    float v;
    if constexpr (kAccumulate) {
#if defined(__CUDA_ARCH__)
      v = __fmaf_rn(load(x), scale, load(old));
#else
      v = std::fma(load(x), scale, load(old));
#endif
    } else {
      v = load(x) * scale;
    }
    nonfinite |= !(std::fabs(v) < overflowLimit<Dst>());
    return store<Dst>(v);
  }
};

// Sum-of-squares accumulator type per output dtype code; `void` when not requested.
template <typename Acc>
DK_HOST_DEVICE DK_INLINE void addSquare(Acc& acc, float stored) {
  acc += static_cast<Acc>(stored) * static_cast<Acc>(stored);
}

}  // namespace dk::kernels
