// Argument checks shared by the CPU and CUDA cast-and-scale entry points.
#include <string>

#include "kernels/multi_tensor.h"

namespace dk::kernels {

namespace {

bool isGradDType(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16;
}

}  // namespace

Status validateCastScaleArgs(const TensorSegment* segments, int64_t num_segments,
                             const CastScaleArgs& args) {
  if (!isGradDType(args.src_dtype) || !isGradDType(args.dst_dtype)) {
    return TypeError(std::string("cast-and-scale takes float32, float16 or bfloat16, got ") +
                     dtypeName(args.src_dtype) + " -> " + dtypeName(args.dst_dtype));
  }
  if (num_segments < 0) return InvalidArgument("negative number of tensors");
  if (args.sum_squares_mode != SumSquares::kNone) {
    if (args.sum_squares == nullptr) return InvalidArgument("sum of squares requested, no buffer");
    if (args.sum_squares_dtype != DType::kFloat32 && args.sum_squares_dtype != DType::kFloat64) {
      return TypeError("sum of squares is float32 or float64");
    }
  }
  for (int64_t i = 0; i < num_segments; ++i) {
    const TensorSegment& s = segments[i];
    if (s.count < 0) return InvalidArgument("tensor " + std::to_string(i) + ": negative count");
    if (s.count > 0 && (s.src == nullptr || s.dst == nullptr)) {
      return InvalidArgument("tensor " + std::to_string(i) + ": null pointer");
    }
  }
  return Status::Ok();
}

}  // namespace dk::kernels
