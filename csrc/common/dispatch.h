// DK_DISPATCH_DTYPE(dtype, T, ...): runs the body with `T` bound to the storage type of `dtype`;
// an unknown dtype returns a TypeError Status from the enclosing function.
#pragma once

#include <cstdint>

#include "common/dtype.h"
#include "common/half.h"
#include "common/status.h"

#define DK_DTYPE_CASE(enumv, type, ...) \
  case ::dk::DType::enumv: {            \
    using T = type;                     \
    __VA_ARGS__;                        \
    break;                              \
  }

#define DK_DISPATCH_DTYPE(dtype, ...)                                                   \
  switch (dtype) {                                                                      \
    DK_DTYPE_CASE(kFloat32, float, __VA_ARGS__)                                         \
    DK_DTYPE_CASE(kFloat64, double, __VA_ARGS__)                                        \
    DK_DTYPE_CASE(kFloat16, ::dk::Half, __VA_ARGS__)                                    \
    DK_DTYPE_CASE(kBFloat16, ::dk::BFloat16, __VA_ARGS__)                               \
    DK_DTYPE_CASE(kInt32, int32_t, __VA_ARGS__)                                         \
    DK_DTYPE_CASE(kInt64, int64_t, __VA_ARGS__)                                         \
    DK_DTYPE_CASE(kInt8, int8_t, __VA_ARGS__)                                           \
    DK_DTYPE_CASE(kUInt8, uint8_t, __VA_ARGS__)                                         \
    default:                                                                            \
      return ::dk::TypeError("unsupported dtype code " + std::to_string((int)(dtype))); \
  }
