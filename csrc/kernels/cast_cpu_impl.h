// Cast with scale, compiled once per instruction set (see reduce_cpu_impl.h for the scheme).
//
// Invariant: dst = (D)(float(src) * scale), the product computed in FP32 and rounded once to
// nearest even; beyond the destination's range it becomes +-inf, NaN stays NaN. The F16C
// builds convert FP16 with vcvtph2ps / vcvtps2ph (half.h), BF16 uses integer bit operations.
#pragma once

#ifndef DK_CPU_ISA_NS
#error "define DK_CPU_ISA_NS (baseline, avx2 or avx512) before including cast_cpu_impl.h"
#endif

#include <cstddef>
#include <string>

#include "common/dtype.h"
#include "common/half.h"
#include "kernels/cpu_widen_impl.h"
#include "kernels/reduce_cpu_isa.h"

namespace dk::kernels::DK_CPU_ISA_NS {

namespace {

// Elements per staged block: 2 x 4 KiB of FP32 stays in L1.
constexpr size_t kCastBlock = 1024;

// Widen a block of src into FP32, scale it, narrow it into dst (one rounding).
template <typename D, typename S>
void castScaleLoop(D* dst, const S* src, size_t count, float scale) {
  float x[kCastBlock];
  for (size_t begin = 0; begin < count; begin += kCastBlock) {
    const size_t n = count - begin < kCastBlock ? count - begin : kCastBlock;
    widen(x, src + begin, n);
    for (size_t j = 0; j < n; ++j) x[j] *= scale;
    narrow(dst + begin, x, n);
  }
}

template <typename D>
Status castScaleFrom(D* dst, const void* src, DType src_dtype, size_t count, float scale) {
  switch (src_dtype) {
    case DType::kFloat32:
      castScaleLoop(dst, static_cast<const float*>(src), count, scale);
      return Status::Ok();
    case DType::kFloat16:
      castScaleLoop(dst, static_cast<const Half*>(src), count, scale);
      return Status::Ok();
    case DType::kBFloat16:
      castScaleLoop(dst, static_cast<const BFloat16*>(src), count, scale);
      return Status::Ok();
    default:
      return TypeError(std::string("cast: unsupported source dtype ") + dtypeName(src_dtype));
  }
}

}  // namespace

Status castScale(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t count,
                 float scale) {
  switch (dst_dtype) {
    case DType::kFloat32:
      return castScaleFrom(static_cast<float*>(dst), src, src_dtype, count, scale);
    case DType::kFloat16:
      return castScaleFrom(static_cast<Half*>(dst), src, src_dtype, count, scale);
    case DType::kBFloat16:
      return castScaleFrom(static_cast<BFloat16*>(dst), src, src_dtype, count, scale);
    default:
      return TypeError(std::string("cast: unsupported destination dtype ") + dtypeName(dst_dtype));
  }
}

}  // namespace dk::kernels::DK_CPU_ISA_NS
