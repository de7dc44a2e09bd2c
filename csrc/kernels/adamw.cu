// CUDA AdamW: one grid-stride launch per tensor on the caller's stream, the same per-element
// functor as the CPU loop (adamw_functor.h).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>

#include "kernels/adamw.h"
#include "kernels/adamw_dispatch.h"

namespace dk::kernels {

namespace {

// 256 threads x up to 1024 blocks: enough to fill an H100's 132 SMs several times over; the
// grid-stride loop covers larger tensors.
constexpr int kThreads = 256;
constexpr size_t kMaxBlocks = 1024;

template <typename P, typename G, bool kMaster, bool kAmsgrad>
__global__ void adamwKernel(AdamWTensor t, AdamWHyper h) {
  P* param = static_cast<P*>(t.param);
  const G* grad = static_cast<const G*>(t.grad);
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < t.count;
       i += stride) {
    AdamWMoments<float> s{t.exp_avg[i], t.exp_avg_sq[i], kAmsgrad ? t.max_exp_avg_sq[i] : 0.0f};
    const float p = kMaster ? t.master[i] : load(param[i]);
    const float updated = adamwUpdate<kAmsgrad>(p, load(grad[i]), s, h);
    if (kMaster) t.master[i] = updated;
    param[i] = store<P>(updated);
    t.exp_avg[i] = s.m;
    t.exp_avg_sq[i] = s.v;
    if (kAmsgrad) t.max_exp_avg_sq[i] = s.vmax;
  }
}

template <typename P, typename G>
Status launchAdamW(const AdamWTensor& t, const AdamWHyper& h, cudaStream_t stream) {
  if (t.count == 0) return Status::Ok();
  const size_t blocks = std::min(kMaxBlocks, (t.count + kThreads - 1) / kThreads);
  const unsigned grid = static_cast<unsigned>(blocks);
  const bool master = t.master != nullptr;
  if (h.amsgrad) {
    master ? adamwKernel<P, G, true, true><<<grid, kThreads, 0, stream>>>(t, h)
           : adamwKernel<P, G, false, true><<<grid, kThreads, 0, stream>>>(t, h);
  } else {
    master ? adamwKernel<P, G, true, false><<<grid, kThreads, 0, stream>>>(t, h)
           : adamwKernel<P, G, false, false><<<grid, kThreads, 0, stream>>>(t, h);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return Status(Code::kCudaError, std::string("adamw kernel launch: ") + cudaGetErrorString(err));
  }
  return Status::Ok();
}

}  // namespace

Status adamwCuda(const AdamWTensor* tensors, int ntensors, DType param_dtype, DType grad_dtype,
                 const AdamWHyper& hyper, void* stream) {
  DK_RETURN_IF_ERROR(validateAdamW(tensors, ntensors, param_dtype, grad_dtype, hyper));
  auto s = static_cast<cudaStream_t>(stream);
  for (int i = 0; i < ntensors; ++i) {
    DK_DISPATCH_FLOAT_PAIR(param_dtype, grad_dtype,
                           DK_RETURN_IF_ERROR((launchAdamW<P, G>(tensors[i], hyper, s))));
  }
  return Status::Ok();
}

}  // namespace dk::kernels
