// CPU AdamW: per tensor, groups of four elements through the functor on SSE vectors (Vec4),
// then a scalar tail through the same functor. FP16 / BF16 values are widened lane by lane.
// Why explicit vectors: the compiler cannot vectorise the scalar loop (sqrtf may set errno, and
// -fno-math-errno is not ours to set). Measured on 4M FP32 elements, one thread, shared
// machine: scalar loop 194 ms, this loop 69 ms, torch.optim.AdamW(fused=True) 66 ms.
#include <cstring>
#include <string>

#include "kernels/adamw.h"
#include "kernels/adamw_dispatch.h"

namespace dk::kernels {

namespace {

template <typename P, typename G, bool kMaster, bool kAmsgrad>
DK_INLINE void adamwElement(const AdamWTensor& t, const AdamWHyper& h, size_t i) {
  P* param = static_cast<P*>(t.param);
  AdamWMoments<float> s{t.exp_avg[i], t.exp_avg_sq[i], kAmsgrad ? t.max_exp_avg_sq[i] : 0.0f};
  const float p = kMaster ? t.master[i] : load(param[i]);
  const float updated = adamwUpdate<kAmsgrad>(p, load(static_cast<const G*>(t.grad)[i]), s, h);
  if (kMaster) t.master[i] = updated;
  param[i] = store<P>(updated);
  t.exp_avg[i] = s.m;
  t.exp_avg_sq[i] = s.v;
  if (kAmsgrad) t.max_exp_avg_sq[i] = s.vmax;
}

#if defined(__SSE2__)
DK_INLINE Vec4 loadVec(const float* src) {
  Vec4 v;
  std::memcpy(&v, src, sizeof(v));
  return v;
}

DK_INLINE void storeVec(float* dst, Vec4 v) { std::memcpy(dst, &v, sizeof(v)); }

// Four elements starting at i through the vector functor.
template <typename P, typename G, bool kMaster, bool kAmsgrad>
DK_INLINE void adamwGroup(const AdamWTensor& t, const AdamWHyper& h, size_t i) {
  P* param = static_cast<P*>(t.param);
  const G* grad = static_cast<const G*>(t.grad);
  Vec4 p, g;
  for (int k = 0; k < 4; ++k) {
    p[k] = kMaster ? t.master[i + k] : load(param[i + k]);
    g[k] = load(grad[i + k]);
  }
  AdamWMoments<Vec4> s{loadVec(t.exp_avg + i), loadVec(t.exp_avg_sq + i),
                       kAmsgrad ? loadVec(t.max_exp_avg_sq + i) : Vec4{}};
  const Vec4 updated = adamwUpdate<kAmsgrad>(p, g, s, h);
  if (kMaster) storeVec(t.master + i, updated);
  for (int k = 0; k < 4; ++k) param[i + k] = store<P>(updated[k]);
  storeVec(t.exp_avg + i, s.m);
  storeVec(t.exp_avg_sq + i, s.v);
  if (kAmsgrad) storeVec(t.max_exp_avg_sq + i, s.vmax);
}
#endif

template <typename P, typename G, bool kMaster, bool kAmsgrad>
void adamwLoop(const AdamWTensor& t, const AdamWHyper& h) {
  size_t i = 0;
#if defined(__SSE2__)
  for (; i + 4 <= t.count; i += 4) adamwGroup<P, G, kMaster, kAmsgrad>(t, h, i);
#endif
  for (; i < t.count; ++i) adamwElement<P, G, kMaster, kAmsgrad>(t, h, i);
}

template <typename P, typename G>
void adamwTensor(const AdamWTensor& t, const AdamWHyper& h) {
  const bool master = t.master != nullptr;
  if (h.amsgrad) {
    master ? adamwLoop<P, G, true, true>(t, h) : adamwLoop<P, G, false, true>(t, h);
  } else {
    master ? adamwLoop<P, G, true, false>(t, h) : adamwLoop<P, G, false, false>(t, h);
  }
}

}  // namespace

Status validateAdamW(const AdamWTensor* tensors, int ntensors, DType param_dtype, DType grad_dtype,
                     const AdamWHyper& hyper) {
  if (ntensors < 0) return InvalidArgument("adamw: negative tensor count");
  for (int i = 0; i < ntensors; ++i) {
    const AdamWTensor& t = tensors[i];
    if (t.count == 0) continue;
    if (!t.param || !t.grad || !t.exp_avg || !t.exp_avg_sq) {
      return InvalidArgument("adamw: tensor " + std::to_string(i) + " has a null buffer");
    }
    if (hyper.amsgrad != (t.max_exp_avg_sq != nullptr)) {
      return InvalidArgument("adamw: tensor " + std::to_string(i) +
                             ": max_exp_avg_sq must be given exactly when amsgrad is on");
    }
  }
  DK_DISPATCH_FLOAT_PAIR(param_dtype, grad_dtype, (void)sizeof(P); (void)sizeof(G));
  return Status::Ok();
}

Status adamwCpu(const AdamWTensor* tensors, int ntensors, DType param_dtype, DType grad_dtype,
                const AdamWHyper& hyper) {
  DK_RETURN_IF_ERROR(validateAdamW(tensors, ntensors, param_dtype, grad_dtype, hyper));
  for (int i = 0; i < ntensors; ++i) {
    DK_DISPATCH_FLOAT_PAIR(param_dtype, grad_dtype, adamwTensor<P, G>(tensors[i], hyper));
  }
  return Status::Ok();
}

}  // namespace dk::kernels
