// CUDA cast with scale: dst = (D)(float(src) * scale), rounded once to nearest even (half.h's
// device conversions), 8 elements per thread step: one 16-byte load or store on the 16-bit side,
// two on the FP32 side, for pointers aligned to 16 bytes; a bounds-checked scalar tail covers the
// rest.
#include <cuda_runtime.h>

#include <string>

#include "common/dtype.h"
#include "common/half.h"
#include "kernels/reduce.h"
#include "kernels/reduce_cuda.h"

namespace dk::kernels {

namespace {

using cuda::checkLaunch;
using cuda::gridFor;
using cuda::isAligned;
using cuda::kThreadsPerBlock;
using cuda::Pack;

constexpr int kCastVec = 8;

template <typename D, typename S>
__global__ void castScaleKernel(D* dst, const S* src, size_t count, float scale, bool vectorized) {
  using SrcPack = Pack<S, kCastVec>;
  using DstPack = Pack<D, kCastVec>;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t packs = vectorized ? count / kCastVec : 0;
  for (size_t p = first; p < packs; p += stride) {
    const SrcPack in = reinterpret_cast<const SrcPack*>(src)[p];
    DstPack out;
#pragma unroll
    for (int k = 0; k < kCastVec; ++k)
      out.v[k] = store<D>(static_cast<float>(load(in.v[k])) * scale);
    reinterpret_cast<DstPack*>(dst)[p] = out;
  }
  for (size_t i = packs * kCastVec + first; i < count; i += stride) {
    dst[i] = store<D>(static_cast<float>(load(src[i])) * scale);
  }
}

template <typename D, typename S>
Status launchCast(void* dst, const void* src, size_t count, float scale, cudaStream_t stream) {
  const bool vectorized = isAligned(dst, cuda::kPackAlignment<D, kCastVec>) &&
                          isAligned(src, cuda::kPackAlignment<S, kCastVec>);
  const size_t work = vectorized ? count / kCastVec : count;
  castScaleKernel<D, S><<<gridFor(work), kThreadsPerBlock, 0, stream>>>(
      static_cast<D*>(dst), static_cast<const S*>(src), count, scale, vectorized);
  return checkLaunch("castScaleKernel");
}

template <typename D>
Status launchCastTo(void* dst, const void* src, DType src_dtype, size_t count, float scale,
                    cudaStream_t stream) {
  switch (src_dtype) {
    case DType::kFloat32:
      return launchCast<D, float>(dst, src, count, scale, stream);
    case DType::kFloat16:
      return launchCast<D, Half>(dst, src, count, scale, stream);
    case DType::kBFloat16:
      return launchCast<D, BFloat16>(dst, src, count, scale, stream);
    default:
      return TypeError(std::string("cast: unsupported source dtype ") + dtypeName(src_dtype));
  }
}

}  // namespace

Status castScaleCuda(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t count,
                     float scale, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const bool supported_src =
      src_dtype == DType::kFloat32 || src_dtype == DType::kFloat16 || src_dtype == DType::kBFloat16;
  if (!supported_src) {
    return TypeError(std::string("cast: unsupported source dtype ") + dtypeName(src_dtype));
  }
  switch (dst_dtype) {
    case DType::kFloat32:
      return count == 0 ? Status::Ok() : launchCastTo<float>(dst, src, src_dtype, count, scale, s);
    case DType::kFloat16:
      return count == 0 ? Status::Ok() : launchCastTo<Half>(dst, src, src_dtype, count, scale, s);
    case DType::kBFloat16:
      return count == 0 ? Status::Ok()
                        : launchCastTo<BFloat16>(dst, src, src_dtype, count, scale, s);
    default:
      return TypeError(std::string("cast: unsupported destination dtype ") + dtypeName(dst_dtype));
  }
}

}  // namespace dk::kernels
