// CPU AdamW: plain loops over each tensor; the float32 path vectorises at the x86-64 baseline
// (SSE sqrt and div), 16-bit types convert element by element.
#include <string>

#include "kernels/adamw.h"
#include "kernels/adamw_dispatch.h"

namespace dk::kernels {

namespace {

template <typename P, typename G, bool kMaster>
void adamwLoop(const AdamWTensor& t, const AdamWHyper& h) {
  P* param = static_cast<P*>(t.param);
  const G* grad = static_cast<const G*>(t.grad);
  for (size_t i = 0; i < t.count; ++i) {
    AdamWMoments s{t.exp_avg[i], t.exp_avg_sq[i], h.amsgrad ? t.max_exp_avg_sq[i] : 0.0f};
    const float p = kMaster ? t.master[i] : load(param[i]);
    const float updated = adamwUpdate(p, load(grad[i]), s, h);
    if (kMaster) t.master[i] = updated;
    param[i] = store<P>(updated);
    t.exp_avg[i] = s.m;
    t.exp_avg_sq[i] = s.v;
    if (h.amsgrad) t.max_exp_avg_sq[i] = s.vmax;
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
    const bool master = tensors[i].master != nullptr;
    DK_DISPATCH_FLOAT_PAIR(param_dtype, grad_dtype,
                           master ? adamwLoop<P, G, true>(tensors[i], hyper)
                                  : adamwLoop<P, G, false>(tensors[i], hyper));
  }
  return Status::Ok();
}

}  // namespace dk::kernels
