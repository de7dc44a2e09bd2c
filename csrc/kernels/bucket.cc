// Bucket layouts -> cast-and-scale segments, with the checks that keep slices inside the bucket.
#include "kernels/bucket.h"

#include <algorithm>
#include <numeric>
#include <string>

#if DK_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace dk::kernels {

namespace {

#if DK_WITH_CUDA
Status cudaCheck(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status(Code::kCudaError, std::string(what) + ": " + cudaGetErrorString(err));
}
#endif

Status checkSlices(const BucketLayout& layout) {
  std::vector<int64_t> order(layout.num_tensors);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return layout.offsets[a] < layout.offsets[b]; });
  int64_t end_of_previous = 0;
  for (int64_t i : order) {
    const int64_t begin = layout.offsets[i], end = begin + layout.counts[i];
    if (begin < 0 || layout.counts[i] < 0 || end > layout.bucket_numel) {
      return InvalidArgument("tensor " + std::to_string(i) + ": slice [" + std::to_string(begin) +
                             ", " + std::to_string(end) + ") is outside the bucket of " +
                             std::to_string(layout.bucket_numel) + " elements");
    }
    if (layout.counts[i] > 0 && begin < end_of_previous) {
      return InvalidArgument("tensor " + std::to_string(i) + ": slice starting at " +
                             std::to_string(begin) + " overlaps the previous one ending at " +
                             std::to_string(end_of_previous));
    }
    end_of_previous = std::max(end_of_previous, end);
  }
  return Status::Ok();
}

}  // namespace

Status bucketSegments(const BucketLayout& layout, BucketDirection direction,
                      const CastScaleArgs& args, std::vector<TensorSegment>* segments) {
  DK_RETURN_IF_ERROR(checkSlices(layout));
  const bool pack = direction == BucketDirection::kPack;
  const size_t bucket_elem = dtypeSize(pack ? args.dst_dtype : args.src_dtype);
  segments->resize(layout.num_tensors);
  for (int64_t i = 0; i < layout.num_tensors; ++i) {
    char* slice = reinterpret_cast<char*>(layout.bucket) + layout.offsets[i] * bucket_elem;
    void* tensor = reinterpret_cast<void*>(layout.tensors[i]);
    (*segments)[i] = pack ? TensorSegment{tensor, slice, layout.counts[i]}
                          : TensorSegment{slice, tensor, layout.counts[i]};
  }
  return Status::Ok();
}

Status castScaleMulti(const std::vector<TensorSegment>& segments, const CastScaleArgs& args,
                      int device, void* stream, int num_threads) {
  if (device < 0) {
    return castScaleMultiCpu(segments.data(), static_cast<int64_t>(segments.size()), args,
                             num_threads);
  }
#if DK_WITH_CUDA
  // Launch on the tensors' device, then give the caller's thread its current device back.
  int previous = 0;
  DK_RETURN_IF_ERROR(cudaCheck(cudaGetDevice(&previous), "cudaGetDevice"));
  if (previous != device) DK_RETURN_IF_ERROR(cudaCheck(cudaSetDevice(device), "cudaSetDevice"));
  const Status status =
      castScaleMultiCuda(segments.data(), static_cast<int64_t>(segments.size()), args, stream);
  if (previous != device) DK_RETURN_IF_ERROR(cudaCheck(cudaSetDevice(previous), "cudaSetDevice"));
  return status;
#else
  return Unsupported("CUDA tensors need a CUDA build of dist_kernels (build_info() says none)");
#endif
}

}  // namespace dk::kernels
