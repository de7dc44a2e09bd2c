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
#include "kernels/cpu_isa.h"

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

#if defined(__AVX512BW__) || defined(__AVX2__)
// BF16 <-> FP32 a vector at a time: GCC's vectorisation of half.h's scalar code left the
// reduce at 0.76-0.82x torch's add_ (bench_kernels, 4 and 64 MiB). Widening is a shift of the
// 16 bits into the top of a 32-bit lane; narrowing is half.h's rounding (add 0x7FFF plus the
// kept bit's parity, shift down) with its NaN rule (quiet, sign kept), lane by lane, so the
// bits equal the scalar conversion's.
#if defined(__AVX512BW__)
constexpr size_t kBf16Lanes = 16;
using Bf16Wide = __m512i;
inline Bf16Wide bf16Load(const BFloat16* in) {
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in)));
}
inline void bf16Store(BFloat16* out, Bf16Wide v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(v));
}
inline Bf16Wide bf16Round(Bf16Wide u) {
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i bias =
      _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x0040));
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  return _mm512_mask_blend_epi32(nan, rounded, quiet);
}
inline void storeFloats(float* out, Bf16Wide v) { _mm512_storeu_ps(out, _mm512_castsi512_ps(v)); }
inline Bf16Wide loadFloats(const float* in) { return _mm512_castps_si512(_mm512_loadu_ps(in)); }
inline Bf16Wide shiftUp(Bf16Wide v) { return _mm512_slli_epi32(v, 16); }
inline Bf16Wide addFloats(Bf16Wide x, Bf16Wide y) {
  return _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(x), _mm512_castsi512_ps(y)));
}
#else
constexpr size_t kBf16Lanes = 8;
using Bf16Wide = __m256i;
inline Bf16Wide bf16Load(const BFloat16* in) {
  return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in)));
}
inline void bf16Store(BFloat16* out, Bf16Wide v) {
  // the low 16 bits of each 32-bit lane (all below 2^16 after the shift): pack, then
  // gather the two 128-bit halves' results
  const __m256i packed = _mm256_packus_epi32(v, v);
  const __m256i ordered = _mm256_permute4x64_epi64(packed, 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(ordered));
}
inline Bf16Wide bf16Round(Bf16Wide u) {
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i bias =
      _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), _mm256_and_si256(_mm256_srli_epi32(u, 16), one));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x0040));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(0x7F800000));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}
inline void storeFloats(float* out, Bf16Wide v) { _mm256_storeu_ps(out, _mm256_castsi256_ps(v)); }
inline Bf16Wide loadFloats(const float* in) { return _mm256_castps_si256(_mm256_loadu_ps(in)); }
inline Bf16Wide shiftUp(Bf16Wide v) { return _mm256_slli_epi32(v, 16); }
inline Bf16Wide addFloats(Bf16Wide x, Bf16Wide y) {
  return _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(x), _mm256_castsi256_ps(y)));
}
#endif

#if defined(__AVX512BW__)
// AVX512_BF16 (Zen 4, Sapphire Rapids): vcvtneps2bf16 rounds as bf16Round does (nearest even;
// a NaN made quiet, its sign kept) in one instruction instead of seven, but it flushes
// subnormal inputs to zero, so a vector holding one takes bf16Round: the bits stay the scalar
// conversion's. The functions below are compiled for that extension alone (the rest of this
// build does not assume it) and run where bf16InstructionsUsable() (cpu_isa.h).
#define DK_BF16_TARGET __attribute__((target("avx512bf16")))

DK_BF16_TARGET inline void bf16StoreRounded(BFloat16* out, __m512i u) {
  const __m512i magnitude = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  // subnormal: 0 < magnitude < 2^-126, i.e. magnitude - 1 below 0x007FFFFF unsigned
  const __mmask16 subnormal = _mm512_cmplt_epu32_mask(
      _mm512_sub_epi32(magnitude, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x007FFFFF));
  if (subnormal != 0) {
    bf16Store(out, bf16Round(u));
    return;
  }
  const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_castsi512_ps(u));
  std::memcpy(out, &rounded, sizeof(rounded));  // one unaligned 32-byte store
}

// Element order for the 32-lane sum below: _mm512_cvtne2ps_pbh(odd, even) puts the 16 even
// elements' results in words 0-15 and the odd ones' in words 16-31; word 2i takes word i and
// word 2i + 1 takes word 16 + i.
// clang-format off
alignas(64) constexpr uint16_t kInterleaveEvenOdd[32] = {
    0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
// clang-format on

// dst = a + b, 32 elements a step, with no cross-lane shuffle to widen: the 32-bit lane holding
// elements 2i (low half) and 2i + 1 (high half) gives element 2i + 1 as a float by clearing its
// low half and element 2i by shifting it up. The 16-lane loop below widens with vpmovzxwd, a
// shuffle, and with the subnormal test and the two conversions it kept the 512-bit ALU ports
// busy ~11 uops per 16 elements: BF16 sums ran at half the FP32 sum's bytes per second in L2
// (28 against 55 GB/s, one thread, 2-core Sapphire Rapids VM). Here: ~13 uops per 32. Narrowing
// packs both halves in one vcvtne2ps2bf16, and one vpermw restores element order. A step whose
// sums hold a subnormal rounds them the exact way, as bf16StoreRounded does.
DK_BF16_TARGET size_t sumBf16PairsRounded(BFloat16* dst, const BFloat16* a, const BFloat16* b,
                                          size_t count) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512i order = _mm512_load_si512(kInterleaveEvenOdd);
  constexpr int kSubnormal = 0x20;  // vfpclassps: denormal, either sign
  size_t j = 0;
  for (; j + 2 * kBf16Lanes <= count; j += 2 * kBf16Lanes) {
    const __m512i x = _mm512_loadu_si512(a + j);
    const __m512i y = _mm512_loadu_si512(b + j);
    const __m512 even = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(x, 16)),
                                      _mm512_castsi512_ps(_mm512_slli_epi32(y, 16)));
    const __m512 odd = _mm512_add_ps(_mm512_castsi512_ps(_mm512_and_si512(x, high)),
                                     _mm512_castsi512_ps(_mm512_and_si512(y, high)));
    if ((_mm512_fpclass_ps_mask(even, kSubnormal) | _mm512_fpclass_ps_mask(odd, kSubnormal)) != 0) {
      for (size_t h = j; h < j + 2 * kBf16Lanes; h += kBf16Lanes) {
        bf16Store(dst + h,
                  bf16Round(addFloats(shiftUp(bf16Load(a + h)), shiftUp(bf16Load(b + h)))));
      }
      continue;
    }
    const __m512i packed = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even));
    _mm512_storeu_si512(dst + j, _mm512_permutexvar_epi16(order, packed));
  }
  return j;
}

DK_BF16_TARGET size_t sumBf16VectorsRounded(BFloat16* dst, const BFloat16* a, const BFloat16* b,
                                            size_t count) {
  size_t j = sumBf16PairsRounded(dst, a, b, count);
  for (; j + kBf16Lanes <= count; j += kBf16Lanes) {
    bf16StoreRounded(dst + j, addFloats(shiftUp(bf16Load(a + j)), shiftUp(bf16Load(b + j))));
  }
  return j;
}

DK_BF16_TARGET size_t narrowBf16VectorsRounded(BFloat16* out, const float* in, size_t n) {
  size_t j = 0;
  for (; j + kBf16Lanes <= n; j += kBf16Lanes) bf16StoreRounded(out + j, loadFloats(in + j));
  return j;
}
#endif

// dst = a + b for the leading whole vectors (widened, added in FP32, rounded once: the staged
// loop's arithmetic without its passes through L1, the common case of a BF16 all-reduce);
// returns how many elements it did.
[[maybe_unused]] size_t sumBf16Vectors(BFloat16* dst, const BFloat16* a, const BFloat16* b,
                                       size_t count) {
#if defined(__AVX512BW__)
  if (dk::kernels::bf16InstructionsUsable()) return sumBf16VectorsRounded(dst, a, b, count);
#endif
  size_t j = 0;
  for (; j + kBf16Lanes <= count; j += kBf16Lanes) {
    const Bf16Wide sum = addFloats(shiftUp(bf16Load(a + j)), shiftUp(bf16Load(b + j)));
    bf16Store(dst + j, bf16Round(sum));
  }
  return j;
}

template <>
[[maybe_unused]] void widen<BFloat16>(float* out, const BFloat16* in, size_t n) {
  size_t j = 0;
  for (; j + kBf16Lanes <= n; j += kBf16Lanes) storeFloats(out + j, shiftUp(bf16Load(in + j)));
  for (; j < n; ++j) out[j] = bfloat16ToFloat(in[j]);
}

template <>
[[maybe_unused]] void narrow<BFloat16>(BFloat16* out, const float* in, size_t n) {
  size_t j = 0;
#if defined(__AVX512BW__)
  if (dk::kernels::bf16InstructionsUsable()) j = narrowBf16VectorsRounded(out, in, n);
#endif
  for (; j + kBf16Lanes <= n; j += kBf16Lanes) bf16Store(out + j, bf16Round(loadFloats(in + j)));
  for (; j < n; ++j) out[j] = floatToBFloat16(in[j]);
}
#endif

}  // namespace

}  // namespace dk::kernels::DK_CPU_ISA_NS

#pragma GCC diagnostic pop
