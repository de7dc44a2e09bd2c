// CUDA reduce, reduce-and-divide (AVG) and divide: the functors of reduce_functors.h applied with
// 16-byte vector loads in a grid-stride loop, plus a bounds-checked scalar tail. Same numerics as
// the CPU kernels: FP16 / BF16 widen to FP32, combine across every source, and round once on store.
#include <cuda_runtime.h>

#include <string>

#include "common/dispatch.h"
#include "common/half.h"
#include "kernels/reduce.h"
#include "kernels/reduce_cuda.h"
#include "kernels/reduce_functors.h"

namespace dk::kernels {

namespace {

using cuda::checkLaunch;
using cuda::gridFor;
using cuda::isAligned;
using cuda::kThreadsPerBlock;
using cuda::kVecElems;
using cuda::Pack;

// Sources travel by value in the kernel's parameters (512 bytes, well under the 4 KiB limit).
constexpr int kMaxLaunchSources = 64;
struct SourceList {
  const void* ptr[kMaxLaunchSources];
};

template <typename T, typename Op, typename Finish>
__device__ void reduceElement(T* dst, const SourceList& srcs, int nsrcs, size_t i, Finish finish) {
  const Op op;
  auto acc = load(static_cast<const T*>(srcs.ptr[0])[i]);
  for (int s = 1; s < nsrcs; ++s) acc = op(acc, load(static_cast<const T*>(srcs.ptr[s])[i]));
  dst[i] = store<T>(finish(acc));
}

// Vector part over count / kVecElems packs when `vectorized`; the scalar tail covers the rest.
// `finish` (KeepSum, or AVG's DivideBy) acts on each completed FP32 / storage-type value.
template <typename T, typename Op, typename Finish>
__global__ void reduceMultiKernel(T* dst, SourceList srcs, int nsrcs, size_t count, bool vectorized,
                                  Finish finish) {
  using A = typename Accum<T>::type;
  using P = Pack<T, kVecElems<T>>;
  const Op op;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t packs = vectorized ? count / kVecElems<T> : 0;
  for (size_t p = first; p < packs; p += stride) {
    P in = static_cast<const P*>(srcs.ptr[0])[p];
    A acc[kVecElems<T>];
#pragma unroll
    for (int k = 0; k < kVecElems<T>; ++k) acc[k] = load(in.v[k]);
    for (int s = 1; s < nsrcs; ++s) {
      in = static_cast<const P*>(srcs.ptr[s])[p];
#pragma unroll
      for (int k = 0; k < kVecElems<T>; ++k) acc[k] = op(acc[k], load(in.v[k]));
    }
    P out;
#pragma unroll
    for (int k = 0; k < kVecElems<T>; ++k) out.v[k] = store<T>(finish(acc[k]));
    reinterpret_cast<P*>(dst)[p] = out;
  }
  for (size_t i = packs * kVecElems<T> + first; i < count; i += stride) {
    reduceElement<T, Op>(dst, srcs, nsrcs, i, finish);
  }
}

template <typename T, typename Op, typename Finish>
Status launchReduce(T* dst, const void* const* srcs, int nsrcs, size_t count, cudaStream_t stream,
                    Finish finish) {
  SourceList list{};
  bool vectorized = isAligned(dst, 16);
  for (int s = 0; s < nsrcs; ++s) {
    list.ptr[s] = srcs[s];
    vectorized = vectorized && isAligned(srcs[s], 16);
  }
  const size_t work = vectorized ? count / kVecElems<T> : count;
  reduceMultiKernel<T, Op>
      <<<gridFor(work), kThreadsPerBlock, 0, stream>>>(dst, list, nsrcs, count, vectorized, finish);
  return checkLaunch("reduceMultiKernel");
}

Status checkSources(int nsrcs) {
  if (nsrcs < 1) return InvalidArgument("reduceMulti: needs at least one source");
  if (nsrcs > kMaxLaunchSources) {
    return InvalidArgument("reduceMultiCuda: at most " + std::to_string(kMaxLaunchSources) +
                           " sources per call, got " + std::to_string(nsrcs));
  }
  return Status::Ok();
}

}  // namespace

Status reduceMultiCuda(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype,
                       RedOp op, void* stream) {
  DK_RETURN_IF_ERROR(checkSources(nsrcs));
  if (count == 0) return Status::Ok();
  auto s = static_cast<cudaStream_t>(stream);
  DK_DISPATCH_DTYPE(
      dtype, DK_DISPATCH_REDOP(op, return launchReduce<T, Op>(static_cast<T*>(dst), srcs, nsrcs,
                                                              count, s, KeepSum{})));
  return Status::Ok();
}

Status reduceAverageCuda(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype,
                         int64_t divisor, void* stream) {
  DK_RETURN_IF_ERROR(checkSources(nsrcs));
  if (divisor == 0) return InvalidArgument("reduceAverage: divisor is 0");
  if (count == 0) return Status::Ok();
  auto s = static_cast<cudaStream_t>(stream);
  DK_DISPATCH_DTYPE(dtype, return withAverageFinish<T>(divisor, [&](auto finish) {
                      return launchReduce<T, SumOp>(static_cast<T*>(dst), srcs, nsrcs, count, s,
                                                    finish);
                    }));
  return Status::Ok();
}

Status reduceCuda(void* dst, const void* a, const void* b, size_t count, DType dtype, RedOp op,
                  void* stream) {
  const void* srcs[2] = {a, b};
  return reduceMultiCuda(dst, srcs, 2, count, dtype, op, stream);
}

// A divide on its own is an average of one source (the same DivideBy / ScaleBy math).
Status divideCuda(void* dst, const void* src, size_t count, DType dtype, int64_t divisor,
                  void* stream) {
  if (divisor == 0) return InvalidArgument("divide: divisor is 0");
  const void* srcs[1] = {src};
  return reduceAverageCuda(dst, srcs, 1, count, dtype, divisor, stream);
}

}  // namespace dk::kernels
