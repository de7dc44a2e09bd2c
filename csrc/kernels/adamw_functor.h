// One definition of the AdamW update (Loshchilov & Hutter, decoupled weight decay), shared by the
// CPU and CUDA kernels so the CPU tests check the arithmetic the GPU runs.
//
// Numerics: every element is updated in FP32 whatever the parameter and gradient types (FP16 and
// BF16 are loaded into float and rounded once on store); the moments are always FP32. The order
// of operations follows torch.optim.AdamW's single-tensor path (mul, lerp, mul+addcmul, sqrt,
// div, add, addcdiv) so that results agree with it to FP32 rounding.
#pragma once

#include <cmath>

#include "common/macros.h"

#if !defined(__CUDACC__) && defined(__SSE2__)
#include <immintrin.h>
#endif

namespace dk::kernels {

// The update is written once over a value type V: float (CUDA threads, CPU tails) or Vec4, four
// floats in one SSE register (the CPU loop). GCC vector extensions give Vec4 the same +, -, *, /
// and ?: as float, so both compute the same IEEE operations in the same order.
#if !defined(__CUDACC__) && defined(__SSE2__)
typedef float Vec4 __attribute__((vector_size(16)));

// _mm_sqrt_ps is the correctly rounded square root, as sqrtf; the compiler cannot vectorise
// sqrtf itself because it may set errno.
inline Vec4 sqrtOf(Vec4 v) { return _mm_sqrt_ps(v); }
#endif

// The wider vectors of the AVX2 and AVX-512 builds (adamw_cpu_avx2.cc / _avx512.cc, compiled
// with -mavx2 / -mavx512f); declared before adamwUpdate so that its sqrtOf(V) finds them. Their
// square roots round correctly too, so every width computes the same bits.
#if !defined(__CUDACC__) && defined(__AVX2__)
typedef float Vec8 __attribute__((vector_size(32)));
inline Vec8 sqrtOf(Vec8 v) { return _mm256_sqrt_ps(v); }
#endif
#if !defined(__CUDACC__) && defined(__AVX512F__)
typedef float Vec16 __attribute__((vector_size(64)));
inline Vec16 sqrtOf(Vec16 v) { return _mm512_sqrt_ps(v); }
#endif

DK_HOST_DEVICE DK_INLINE float sqrtOf(float v) { return sqrtf(v); }

// Hyper-parameters of one step, identical for every element. Scalars that torch computes in
// double on the host (bias corrections, 1 - lr * wd) are computed in double by the caller, then
// rounded to float once, as torch's tensor ops do with Python-float scalars.
struct AdamWHyper {
  float step_size;              // lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  float decay;                  // 1 - lr * weight_decay (decoupled weight decay)
  float one_minus_beta1;        // lerp weight of the first moment
  float beta2;
  float one_minus_beta2;
  float eps;
  float grad_scale;  // multiplies the gradient first: 1 / loss scale; negated to maximise
  bool amsgrad;
};

// The moments of one element (or lane group). `vmax` is used only when amsgrad is on.
template <typename V>
struct AdamWMoments {
  V m;
  V v;
  V vmax;
};

// Returns the updated parameter; updates the moments in place.
template <bool kAmsgrad, typename V>
DK_HOST_DEVICE DK_INLINE V adamwUpdate(V param, V grad, AdamWMoments<V>& s, const AdamWHyper& h) {
  grad *= h.grad_scale;  // torch negates first when maximising: the same value, exactly
  param *= h.decay;
  // torch.lerp's two-sided formula keeps it exact at both ends of the weight range.
  const float w = h.one_minus_beta1;
  s.m = w < 0.5f ? s.m + w * (grad - s.m) : grad - (grad - s.m) * (1.0f - w);
  s.v = s.v * h.beta2 + h.one_minus_beta2 * grad * grad;
  V v = s.v;
  if (kAmsgrad) {
    s.vmax = s.vmax > v ? s.vmax : v;
    v = s.vmax;
  }
  const V denom = sqrtOf(v) / h.bias_correction2_sqrt + h.eps;
  return param + (-h.step_size) * s.m / denom;
}

}  // namespace dk::kernels
