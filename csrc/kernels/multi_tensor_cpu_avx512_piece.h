// The AVX-512 element loop of the CPU cast-and-scale (multi_tensor_cpu_avx512.cc), included
// twice there: DK_BF16_INSTRUCTIONS 0 rounds FP32 to BF16 with integer operations, 1 (compiled
// for AVX512_BF16 as well) with vcvtneps2bf16 except in vectors holding a subnormal; the bits
// are the same. No include guard, on purpose.
//
// 16 lanes per step, the tail through lane masks, lane-wise the same expressions as
// CastScaleOp (multi_tensor_functors.h): float16 <-> float32 by vcvtph2ps / vcvtps2ph (round to
// nearest even, subnormals kept); bfloat16 -> float32 by a 16-bit shift; float32 -> bfloat16
// by the round-to-nearest-even of common/half.h.

namespace {

DK_INLINE __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
DK_INLINE __m512 load16(const Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
DK_INLINE __m512 load16(const BFloat16* p, __mmask16 m) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Stores the lanes of `v` rounded to the destination type; returns them as float (for the
// sum of squares).
DK_INLINE __m512 store16(float* p, __mmask16 m, __m512 v) {
  _mm512_mask_storeu_ps(p, m, v);
  return v;
}
DK_INLINE __m512 store16(Half* p, __mmask16 m, __m512 v) {
  const __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm256_mask_storeu_epi16(p, m, h);
  return _mm512_cvtph_ps(h);
}
DK_INLINE __m512 store16(BFloat16* p, __mmask16 m, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
#if DK_BF16_INSTRUCTIONS
  // vcvtneps2bf16: the same rounding and NaN rule in one instruction, but subnormal inputs
  // flush to zero: a vector holding one takes the integer rounding below.
  const __m512i magnitude = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  const __mmask16 subnormal = _mm512_mask_cmplt_epu32_mask(
      m, _mm512_sub_epi32(magnitude, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x007FFFFF));
  if (subnormal == 0) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    _mm256_mask_storeu_epi16(p, m, h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
#endif
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __m512i quiet_nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i bits = _mm512_mask_blend_epi32(is_nan, rounded, quiet_nan);
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bits));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}

// Sum-of-squares accumulators: sixteen float lanes, or two vectors of eight double lanes.
template <typename SumT>
struct Squares {
  DK_INLINE void add(__m512) {}
  DK_INLINE void finish(SumT&) const {}
};
template <>
struct Squares<float> {
  __m512 acc = _mm512_setzero_ps();
  DK_INLINE void add(__m512 r) { acc = _mm512_fmadd_ps(r, r, acc); }
  DK_INLINE void finish(float& sum) const { sum += _mm512_reduce_add_ps(acc); }
};
template <>
struct Squares<double> {
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  DK_INLINE void add(__m512 r) {
    const __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(r));
    const __m512d b =
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(r), 1)));
    lo = _mm512_fmadd_pd(a, a, lo);
    hi = _mm512_fmadd_pd(b, b, hi);
  }
  DK_INLINE void finish(double& sum) const { sum += _mm512_reduce_add_pd(_mm512_add_pd(lo, hi)); }
};

template <typename Src, typename Dst, bool kAccumulate, typename SumT>
struct Avx512Piece {
  static DK_INLINE void step(const Src* src, Dst* dst, __mmask16 m, __m512 scale, __m512 limit,
                             __mmask16& bad_lanes, Squares<SumT>& squares) {
    const __m512 x = load16(src, m);
    const __m512 v =
        kAccumulate ? _mm512_fmadd_ps(x, scale, load16(dst, m)) : _mm512_mul_ps(x, scale);
    bad_lanes |=
        static_cast<__mmask16>(~_mm512_cmp_ps_mask(_mm512_abs_ps(v), limit, _CMP_LT_OQ) & m);
    squares.add(store16(dst, m, v));
  }

  static void run(const Src* src, Dst* dst, int64_t count, float scale, bool& nonfinite,
                  SumT& sum) {
    const __m512 vscale = _mm512_set1_ps(scale);
    const __m512 limit = _mm512_set1_ps(overflowLimit<Dst>());
    __mmask16 bad_lanes = 0;
    Squares<SumT> squares;
    int64_t i = 0;
    for (; i + 16 <= count; i += 16) {
      step(src + i, dst + i, 0xFFFF, vscale, limit, bad_lanes, squares);
    }
    if (i < count) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (count - i)) - 1);
      step(src + i, dst + i, tail, vscale, limit, bad_lanes, squares);
    }
    nonfinite |= bad_lanes != 0;
    squares.finish(sum);
  }
};

}  // namespace
