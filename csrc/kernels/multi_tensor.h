// Multi-tensor cast-and-scale: the one primitive behind bucket pack, bucket unpack and
// unscale-and-check. Each segment maps `count` elements of `src` onto `dst`:
//
//   pack:     grads[i]           -> bucket + offset[i]   (cast to the wire dtype, times scale)
//   unpack:   bucket + offset[i] -> grads[i]             (cast back, times scale, = or +=)
//   unscale:  tensors[i]         -> tensors[i]           (in place, times inv_scale)
//
// Math per element (multi_tensor_functors.h, shared by CPU and CUDA):
//   v = float(src) * scale                       (overwrite)
//   v = fma(float(src), scale, float(dst))       (accumulate: one rounding in float)
//   dst = round_to_nearest_even<dst dtype>(v)
// The non-finite flag is raised when a stored value is inf or NaN: a non-finite input, or a
// finite one that overflows the destination dtype. It is only ever set, never cleared, so one
// flag can collect several calls (as torch's found_inf does).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "common/status.h"

namespace dk::kernels {

struct TensorSegment {
  const void* src;
  void* dst;
  int64_t count;
};

enum class SumSquares : int { kNone = 0, kTotal = 1, kPerSegment = 2 };

struct CastScaleArgs {
  DType src_dtype = DType::kFloat32;  // float32, float16 or bfloat16
  DType dst_dtype = DType::kFloat32;  // float32, float16 or bfloat16
  float scale = 1.0f;
  // When set, the scale is read from this float32 (device memory on GPU: no host sync).
  const float* scale_ptr = nullptr;
  bool accumulate = false;
  // When set, receives `flag_bits` (1 for an int32 flag, 0x3F800000 for a float32 1.0) if any
  // stored value is not finite.
  uint32_t* flag = nullptr;
  uint32_t flag_bits = 1;
  // Sum of squares of the stored values (for gradient clipping), added into `sum_squares`:
  // one value in total, or one per segment (indexed like the segments).
  SumSquares sum_squares_mode = SumSquares::kNone;
  void* sum_squares = nullptr;
  DType sum_squares_dtype = DType::kFloat32;  // float32 or float64
};

// Checks dtypes and pointers (not memory contents); shared by the CPU and CUDA entry points.
Status validateCastScaleArgs(const TensorSegment* segments, int64_t num_segments,
                             const CastScaleArgs& args);

// Runs on the calling thread; `num_threads` > 1 splits the elements into up to that many
// contiguous ranges run on the shared CPU pool (cpu_thread_pool.h) for big standalone calls
// (engines give each rank one core). The instruction set follows cpu_isa.h.
Status castScaleMultiCpu(const TensorSegment* segments, int64_t num_segments,
                         const CastScaleArgs& args, int num_threads = 1);

#if DK_WITH_CUDA
// The same on device memory: one kernel launch per table of segments (multi_tensor_apply.cuh),
// enqueued on `stream` (a cudaStream_t); returns once enqueued.
Status castScaleMultiCuda(const TensorSegment* segments, int64_t num_segments,
                          const CastScaleArgs& args, void* stream);
#endif

}  // namespace dk::kernels
