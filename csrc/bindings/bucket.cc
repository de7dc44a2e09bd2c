// Python bindings of the bucket pack / unpack and multi-tensor unscale kernels. The Python layer
// (dist_kernels/bucketing.py) checks tensors and passes data pointers; these functions release
// the GIL while the CPU kernels run.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <vector>

#include "bindings/errors.h"
#include "bindings/registry.h"
#include "cuda/device_guard.h"
#include "kernels/bucket.h"

namespace py = pybind11;

namespace {

using dk::kernels::CastScaleArgs;
using dk::kernels::SumSquares;
using dk::kernels::TensorSegment;

// Scale, flag and sum-of-squares arguments shared by every entry point; pointers are 0 when
// absent.
CastScaleArgs makeArgs(int src_dtype, int dst_dtype, float scale, uintptr_t scale_ptr,
                       bool accumulate, uintptr_t flag_ptr, uint32_t flag_bits,
                       uintptr_t sum_squares_ptr, int sum_squares_mode, int sum_squares_dtype) {
  CastScaleArgs args;
  args.src_dtype = static_cast<dk::DType>(src_dtype);
  args.dst_dtype = static_cast<dk::DType>(dst_dtype);
  args.scale = scale;
  args.scale_ptr = reinterpret_cast<const float*>(scale_ptr);
  args.accumulate = accumulate;
  args.flag = reinterpret_cast<uint32_t*>(flag_ptr);
  args.flag_bits = flag_bits;
  args.sum_squares_mode = static_cast<SumSquares>(sum_squares_mode);
  args.sum_squares = reinterpret_cast<void*>(sum_squares_ptr);
  args.sum_squares_dtype = static_cast<dk::DType>(sum_squares_dtype);
  return args;
}

void runChecked(const std::vector<TensorSegment>& segments, const CastScaleArgs& args, int device,
                uintptr_t stream, int num_threads, const char* what) {
  dk::Status status;
  {
    py::gil_scoped_release release;
    // The bucket's device is current for the launch, whatever the caller's current device is.
    status = dk::onDevice(device, [&] {
      return dk::kernels::castScaleMulti(segments, args, device, reinterpret_cast<void*>(stream),
                                         num_threads);
    });
  }
  dk::bindings::check(status, what);
}

void bucketOp(dk::kernels::BucketDirection direction, const std::vector<uintptr_t>& tensors,
              const std::vector<int64_t>& counts, const std::vector<int64_t>& offsets,
              uintptr_t bucket, int64_t bucket_numel, const CastScaleArgs& args, int device,
              uintptr_t stream, int num_threads, const char* what) {
  if (counts.size() != tensors.size() || offsets.size() != tensors.size()) {
    dk::bindings::check(dk::InvalidArgument("tensors, counts and offsets differ in length"), what);
  }
  const dk::kernels::BucketLayout layout{tensors.data(), counts.data(),
                                         offsets.data(), static_cast<int64_t>(tensors.size()),
                                         bucket,         bucket_numel};
  std::vector<TensorSegment> segments;
  dk::bindings::check(dk::kernels::bucketSegments(layout, direction, args, &segments), what);
  runChecked(segments, args, device, stream, num_threads, what);
}

void bucketPack(const std::vector<uintptr_t>& tensors, const std::vector<int64_t>& counts,
                const std::vector<int64_t>& offsets, int grad_dtype, uintptr_t bucket,
                int64_t bucket_numel, int bucket_dtype, float scale, uintptr_t scale_ptr,
                uintptr_t flag_ptr, uint32_t flag_bits, int device, uintptr_t stream,
                int num_threads) {
  const CastScaleArgs args =
      makeArgs(grad_dtype, bucket_dtype, scale, scale_ptr, false, flag_ptr, flag_bits, 0, 0, 0);
  bucketOp(dk::kernels::BucketDirection::kPack, tensors, counts, offsets, bucket, bucket_numel,
           args, device, stream, num_threads, "pack");
}

void bucketUnpack(const std::vector<uintptr_t>& tensors, const std::vector<int64_t>& counts,
                  const std::vector<int64_t>& offsets, int grad_dtype, uintptr_t bucket,
                  int64_t bucket_numel, int bucket_dtype, float scale, uintptr_t scale_ptr,
                  bool accumulate, uintptr_t flag_ptr, uint32_t flag_bits,
                  uintptr_t sum_squares_ptr, int sum_squares_mode, int sum_squares_dtype,
                  int device, uintptr_t stream, int num_threads) {
  const CastScaleArgs args =
      makeArgs(bucket_dtype, grad_dtype, scale, scale_ptr, accumulate, flag_ptr, flag_bits,
               sum_squares_ptr, sum_squares_mode, sum_squares_dtype);
  bucketOp(dk::kernels::BucketDirection::kUnpack, tensors, counts, offsets, bucket, bucket_numel,
           args, device, stream, num_threads, "unpack");
}

void unscaleInPlace(const std::vector<uintptr_t>& tensors, const std::vector<int64_t>& counts,
                    int dtype, float scale, uintptr_t scale_ptr, uintptr_t flag_ptr,
                    uint32_t flag_bits, int device, uintptr_t stream, int num_threads) {
  if (counts.size() != tensors.size()) {
    dk::bindings::check(dk::InvalidArgument("tensors and counts differ in length"), "unscale_");
  }
  std::vector<TensorSegment> segments(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    void* data = reinterpret_cast<void*>(tensors[i]);
    segments[i] = TensorSegment{data, data, counts[i]};
  }
  const CastScaleArgs args =
      makeArgs(dtype, dtype, scale, scale_ptr, false, flag_ptr, flag_bits, 0, 0, 0);
  runChecked(segments, args, device, stream, num_threads, "unscale_");
}

}  // namespace

DK_REGISTER_BINDINGS(bucket) {
  m.def("bucket_pack", &bucketPack, "Casts and scales tensors into a flat bucket (one pass).");
  m.def("bucket_unpack", &bucketUnpack,
        "Casts and scales a flat bucket back into tensors, overwriting or accumulating.");
  m.def("multi_tensor_unscale", &unscaleInPlace,
        "Multiplies tensors in place by a scale and flags non-finite results.");
}
