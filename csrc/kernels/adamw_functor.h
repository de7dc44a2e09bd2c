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

namespace dk::kernels {

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
  float grad_scale;  // multiplies the gradient first: 1 / loss scale, or 1
  bool maximize;
  bool amsgrad;
};

// The moments of one element. `vmax` is read and written only when amsgrad is on.
struct AdamWMoments {
  float m;
  float v;
  float vmax;
};

// Returns the updated parameter; updates the moments in place.
DK_HOST_DEVICE DK_INLINE float adamwUpdate(float param, float grad, AdamWMoments& s,
                                           const AdamWHyper& h) {
  grad *= h.grad_scale;
  if (h.maximize) grad = -grad;
  param *= h.decay;
  // torch.lerp's two-sided formula keeps it exact at both ends of the weight range.
  const float w = h.one_minus_beta1;
  s.m = w < 0.5f ? s.m + w * (grad - s.m) : grad - (grad - s.m) * (1.0f - w);
  s.v = s.v * h.beta2 + h.one_minus_beta2 * grad * grad;
  float v = s.v;
  if (h.amsgrad) {
    s.vmax = s.vmax > v ? s.vmax : v;
    v = s.vmax;
  }
  const float denom = sqrtf(v) / h.bias_correction2_sqrt + h.eps;
  return param + (-h.step_size) * s.m / denom;
}

}  // namespace dk::kernels
