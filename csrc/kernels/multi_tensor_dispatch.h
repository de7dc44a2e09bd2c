// Dispatch helpers for the multi-tensor cast-and-scale kernels: gradient and wire dtypes are
// float32, float16 or bfloat16; a sum of squares is accumulated in float32 or float64.
#pragma once

#include <string>

#include "common/dtype.h"
#include "common/half.h"
#include "common/status.h"

namespace dk::kernels {

// Stands in for the sum-of-squares accumulator when none was asked for.
struct NoSum {
  template <typename V>
  NoSum& operator+=(V) {
    return *this;
  }
};

}  // namespace dk::kernels

#define DK_GRAD_DTYPE_CASE(enumv, type, Alias, ...) \
  case ::dk::DType::enumv: {                        \
    using Alias = type;                             \
    __VA_ARGS__;                                    \
    break;                                          \
  }

// Runs the body with `Alias` bound to float, dk::Half or dk::BFloat16.
#define DK_DISPATCH_GRAD_DTYPE(dtype, Alias, ...)                                            \
  switch (dtype) {                                                                           \
    DK_GRAD_DTYPE_CASE(kFloat32, float, Alias, __VA_ARGS__)                                  \
    DK_GRAD_DTYPE_CASE(kFloat16, ::dk::Half, Alias, __VA_ARGS__)                             \
    DK_GRAD_DTYPE_CASE(kBFloat16, ::dk::BFloat16, Alias, __VA_ARGS__)                        \
    default:                                                                                 \
      return ::dk::TypeError(std::string("multi-tensor kernels take float32, float16 or ") + \
                             "bfloat16, got " + ::dk::dtypeName(dtype));                     \
  }

#define DK_DISPATCH_BOOL(value, Name, ...) \
  if (value) {                             \
    constexpr bool Name = true;            \
    __VA_ARGS__;                           \
  } else {                                 \
    constexpr bool Name = false;           \
    __VA_ARGS__;                           \
  }

// Binds `SumT` to NoSum, float or double after the requested sum of squares.
#define DK_DISPATCH_SUM_SQUARES(args, ...)                           \
  if ((args).sum_squares_mode == ::dk::kernels::SumSquares::kNone) { \
    using SumT = ::dk::kernels::NoSum;                               \
    __VA_ARGS__;                                                     \
  } else if ((args).sum_squares_dtype == ::dk::DType::kFloat64) {    \
    using SumT = double;                                             \
    __VA_ARGS__;                                                     \
  } else {                                                           \
    using SumT = float;                                              \
    __VA_ARGS__;                                                     \
  }

// The full nest: Src, Dst, kAccumulate and SumT for one call.
#define DK_DISPATCH_CAST_SCALE(args, ...)                                     \
  DK_DISPATCH_GRAD_DTYPE(                                                     \
      (args).src_dtype, Src,                                                  \
      DK_DISPATCH_GRAD_DTYPE((args).dst_dtype, Dst,                           \
                             DK_DISPATCH_BOOL((args).accumulate, kAccumulate, \
                                              DK_DISPATCH_SUM_SQUARES(args, __VA_ARGS__))))
