// Widening 16-bit floats to FP32 and narrowing back (RNE), a block at a time, for the per-ISA
// kernel builds (included by reduce_cpu_impl.h and cast_cpu_impl.h inside DK_CPU_ISA_NS).
//
// Why explicit F16C intrinsics: GCC 12 does not vectorise _Float16 <-> float conversions
// without AVX512-FP16 (checked with -fopt-info-vec: the scalar vcvtps2ph loop stays scalar),
// so the AVX2 / AVX-512 builds convert 8 / 16 halves per instruction here and fall back to
// half.h's scalar conversion for the tail. BF16 needs only integer shifts and adds, which GCC
// vectorises from the scalar code in half.h. Both round to nearest even and keep inf and NaN.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstring>

#include "common/half.h"

// GCC 12's F16C headers build results from _mm*_undefined_*(), which -Wmaybe-uninitialized
// reports as a false positive wherever the intrinsics inline.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace dk::kernels::DK_CPU_ISA_NS {

namespace {

template <typename T>
void widen(typename Accum<T>::type* out, const T* in, size_t n) {
  for (size_t j = 0; j < n; ++j) out[j] = load(in[j]);
}

template <typename T>
void narrow(T* out, const typename Accum<T>::type* in, size_t n) {
#pragma GCC ivdep
  for (size_t j = 0; j < n; ++j) out[j] = store<T>(in[j]);
}

template <>
[[maybe_unused]] void widen<Half>(float* out, const Half* in, size_t n) {
  size_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + j));
    _mm512_storeu_ps(out + j, _mm512_cvtph_ps(h));
  }
#elif defined(__F16C__)
  for (; j + 8 <= n; j += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + j));
    _mm256_storeu_ps(out + j, _mm256_cvtph_ps(h));
  }
#endif
  for (; j < n; ++j) out[j] = halfToFloat(in[j]);
}

template <>
[[maybe_unused]] void narrow<Half>(Half* out, const float* in, size_t n) {
  size_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) {
    const __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(in + j), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), h);
  }
#elif defined(__F16C__)
  for (; j + 8 <= n; j += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + j), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), h);
  }
#endif
  for (; j < n; ++j) out[j] = floatToHalf(in[j]);
}

}  // namespace

}  // namespace dk::kernels::DK_CPU_ISA_NS

#pragma GCC diagnostic pop
