// The CPU AdamW loop at one vector width, included by adamw_cpu.cc (SSE's Vec4: the x86-64
// baseline), adamw_cpu_avx2.cc (Vec8) and adamw_cpu_avx512.cc (Vec16), each inside its own
// namespace (baseline, avx2, avx512), as the reduce kernels are (reduce_cpu_impl.h).
//
// Every width runs the same functor (adamw_functor.h) lane by lane in IEEE order, and the ISA
// files are compiled without floating-point contraction (-ffp-contract=off, CMakeLists.txt): a
// fused multiply-add would round once where torch and the baseline round twice, and replicas
// on machines with different instruction sets would drift apart. So the bits do not depend on
// the width (tests/test_fused_adamw.py forces each build).
#include <cstring>
#include <type_traits>

#include "kernels/adamw.h"
#include "kernels/adamw_dispatch.h"

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

#if defined(DK_ADAMW_VEC)
using V = DK_ADAMW_VEC;
constexpr int kLanes = sizeof(V) / sizeof(float);

DK_INLINE V loadVec(const float* src) {
  V v;
  std::memcpy(&v, src, sizeof(v));
  return v;
}

DK_INLINE void storeVec(float* dst, V v) { std::memcpy(dst, &v, sizeof(v)); }

// kLanes values of a float (straight) or 16-bit (widened lane by lane) array.
template <typename T>
DK_INLINE V loadAny(const T* src) {
  if constexpr (std::is_same_v<T, float>) return loadVec(src);
  V v;
  for (int k = 0; k < kLanes; ++k) v[k] = load(src[k]);
  return v;
}

// kLanes elements starting at i through the vector functor.
template <typename P, typename G, bool kMaster, bool kAmsgrad>
DK_INLINE void adamwGroup(const AdamWTensor& t, const AdamWHyper& h, size_t i) {
  P* param = static_cast<P*>(t.param);
  const V p = kMaster ? loadVec(t.master + i) : loadAny(param + i);
  const V g = loadAny(static_cast<const G*>(t.grad) + i);
  AdamWMoments<V> s{loadVec(t.exp_avg + i), loadVec(t.exp_avg_sq + i),
                    kAmsgrad ? loadVec(t.max_exp_avg_sq + i) : V{}};
  const V updated = adamwUpdate<kAmsgrad>(p, g, s, h);
  if (kMaster) storeVec(t.master + i, updated);
  if constexpr (std::is_same_v<P, float>) {
    storeVec(param + i, updated);
  } else {
    for (int k = 0; k < kLanes; ++k) param[i + k] = store<P>(updated[k]);
  }
  storeVec(t.exp_avg + i, s.m);
  storeVec(t.exp_avg_sq + i, s.v);
  if (kAmsgrad) storeVec(t.max_exp_avg_sq + i, s.vmax);
}
#endif

template <typename P, typename G, bool kMaster, bool kAmsgrad>
void adamwLoop(const AdamWTensor& t, const AdamWHyper& h, size_t begin, size_t end) {
  size_t i = begin;
#if defined(DK_ADAMW_VEC)
  for (; i + kLanes <= end; i += kLanes) adamwGroup<P, G, kMaster, kAmsgrad>(t, h, i);
#endif
  for (; i < end; ++i) adamwElement<P, G, kMaster, kAmsgrad>(t, h, i);
}

template <typename P, typename G>
void adamwRange(const AdamWTensor& t, const AdamWHyper& h, size_t begin, size_t end) {
  const bool master = t.master != nullptr;
  if (h.amsgrad) {
    master ? adamwLoop<P, G, true, true>(t, h, begin, end)
           : adamwLoop<P, G, false, true>(t, h, begin, end);
  } else {
    master ? adamwLoop<P, G, true, false>(t, h, begin, end)
           : adamwLoop<P, G, false, false>(t, h, begin, end);
  }
}

// Elements [begin, end) of one tensor (arguments checked by validateAdamW).
Status adamwPiece(const AdamWTensor& t, size_t begin, size_t end, DType param_dtype,
                  DType grad_dtype, const AdamWHyper& hyper) {
  DK_DISPATCH_FLOAT_PAIR(param_dtype, grad_dtype, adamwRange<P, G>(t, hyper, begin, end));
  return Status::Ok();
}
