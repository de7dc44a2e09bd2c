// CUDA cast-and-scale through the multi-tensor launcher: one block per chunk, 8 elements per
// thread per step (16-byte loads of 16-bit data, two of float32) when both sides are 16-byte
// aligned, a bounds-checked scalar tail otherwise. The flag and the sums of squares are written
// to device memory; nothing here waits for the device.
#include <cuda_runtime_api.h>

#include <type_traits>

#include "kernels/multi_tensor.h"
#include "kernels/multi_tensor_apply.cuh"
#include "kernels/multi_tensor_dispatch.h"
#include "kernels/multi_tensor_functors.h"

namespace dk::kernels {

namespace {

constexpr int kVec = 8;

template <typename T>
struct alignas(16) Vec {
  T v[kVec];
};

// Sum over the block, then one atomic add per chunk. The atomics make the last bits of a
// sum depend on the order blocks finish (fine for a clipping norm; not bitwise reproducible).
template <typename SumT>
__device__ void addBlockSum(SumT value, SumT* out) {
  __shared__ SumT warp_sums[kBlockThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_down_sync(0xFFFFFFFFu, value, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  if (warp != 0) return;
  value = lane < static_cast<int>(blockDim.x / 32) ? warp_sums[lane] : SumT(0);
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_down_sync(0xFFFFFFFFu, value, offset);
  if (lane == 0) atomicAdd(out, value);
}

template <typename Src, typename Dst, bool kAccumulate, typename SumT>
struct CastScaleChunk {
  float scale;
  const float* scale_ptr;
  uint32_t* flag;
  uint32_t flag_bits;
  SumT* sums;  // unused with NoSum
  bool per_segment;

  static constexpr bool kSum = !std::is_same<SumT, NoSum>::value;
  using Acc = typename std::conditional<kSum, SumT, float>::type;

  __device__ void operator()(const void* src_base, void* dst_base, int64_t begin, int64_t count,
                             int32_t index) const {
    const Src* src = static_cast<const Src*>(src_base) + begin;
    Dst* dst = static_cast<Dst*>(dst_base) + begin;
    const CastScaleOp<Src, Dst, kAccumulate> op{scale_ptr != nullptr ? *scale_ptr : scale};
    bool nonfinite = false;
    Acc sum = 0;
    int64_t tail = 0;
    if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) % 16) == 0) {
      tail = count / kVec * kVec;
      for (int64_t j = threadIdx.x; j < count / kVec; j += blockDim.x) {
        const Vec<Src> x = reinterpret_cast<const Vec<Src>*>(src)[j];
        Vec<Dst> y;
        if (kAccumulate) y = reinterpret_cast<const Vec<Dst>*>(dst)[j];
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          y.v[k] = op(x.v[k], kAccumulate ? y.v[k] : Dst{}, nonfinite);
          if constexpr (kSum) addSquare(sum, load(y.v[k]));
        }
        reinterpret_cast<Vec<Dst>*>(dst)[j] = y;
      }
    }
    for (int64_t i = tail + threadIdx.x; i < count; i += blockDim.x) {
      dst[i] = op(src[i], kAccumulate ? dst[i] : Dst{}, nonfinite);
      if constexpr (kSum) addSquare(sum, load(dst[i]));
    }
    if (__syncthreads_or(nonfinite) && flag != nullptr && threadIdx.x == 0) *flag = flag_bits;
    if constexpr (kSum) addBlockSum<Acc>(sum, sums + (per_segment ? index : 0));
  }
};

}  // namespace

Status castScaleMultiCuda(const TensorSegment* segments, int64_t num_segments,
                          const CastScaleArgs& args, void* stream) {
  DK_RETURN_IF_ERROR(validateCastScaleArgs(segments, num_segments, args));
  const bool per_segment = args.sum_squares_mode == SumSquares::kPerSegment;
  DK_DISPATCH_CAST_SCALE(
      args, return multiTensorApply(segments, num_segments,
                                    CastScaleChunk<Src, Dst, kAccumulate, SumT>{
                                        args.scale, args.scale_ptr, args.flag, args.flag_bits,
                                        static_cast<SumT*>(args.sum_squares), per_segment},
                                    static_cast<cudaStream_t>(stream)));
  return Status::Ok();
}

}  // namespace dk::kernels
