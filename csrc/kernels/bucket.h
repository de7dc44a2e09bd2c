// Gradient bucket pack / unpack and multi-tensor unscale on top of the multi-tensor
// cast-and-scale (multi_tensor.h). A bucket is one flat buffer of the wire dtype; tensor i
// occupies elements [offsets[i], offsets[i] + counts[i]) of it.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/multi_tensor.h"

namespace dk::kernels {

// Where the tensors of one bucket live; pointers are device pointers for CUDA.
struct BucketLayout {
  const uintptr_t* tensors;  // data pointer of each gradient tensor
  const int64_t* counts;     // elements of each tensor
  const int64_t* offsets;    // element offset of each tensor in the bucket
  int64_t num_tensors;
  uintptr_t bucket;  // data pointer of the bucket
  int64_t bucket_numel;
};

enum class BucketDirection { kPack, kUnpack };

// Checks that every tensor's slice lies inside the bucket and that no two slices overlap,
// then lists the segments for `direction`; the element sizes come from the dtypes in `args`.
Status bucketSegments(const BucketLayout& layout, BucketDirection direction,
                      const CastScaleArgs& args, std::vector<TensorSegment>* segments);

// Runs the segments on the CPU (device < 0, `num_threads` threads) or on CUDA device
// `device` on `stream`.
Status castScaleMulti(const std::vector<TensorSegment>& segments, const CastScaleArgs& args,
                      int device, void* stream, int num_threads);

}  // namespace dk::kernels
