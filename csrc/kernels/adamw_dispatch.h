// DK_DISPATCH_FLOAT_PAIR(param_dtype, grad_dtype, ...): runs the body with P and G bound to the
// storage types of a floating (float32 / float16 / bfloat16) parameter and gradient dtype.
#pragma once

#include "common/dtype.h"
#include "common/half.h"
#include "common/status.h"

#define DK_FLOAT_CASE(enumv, type, alias, ...) \
  case ::dk::DType::enumv: {                   \
    using alias = type;                        \
    __VA_ARGS__;                               \
    break;                                     \
  }

#define DK_DISPATCH_FLOAT(dtype, alias, ...)                                                      \
  switch (dtype) {                                                                                \
    DK_FLOAT_CASE(kFloat32, float, alias, __VA_ARGS__)                                            \
    DK_FLOAT_CASE(kFloat16, ::dk::Half, alias, __VA_ARGS__)                                       \
    DK_FLOAT_CASE(kBFloat16, ::dk::BFloat16, alias, __VA_ARGS__)                                  \
    default:                                                                                      \
      return ::dk::TypeError(std::string("optimizer step: unsupported dtype ") +                  \
                             ::dk::dtypeName(dtype) + "; supported: float32, float16, bfloat16"); \
  }

#define DK_DISPATCH_FLOAT_PAIR(param_dtype, grad_dtype, ...) \
  DK_DISPATCH_FLOAT(param_dtype, P, DK_DISPATCH_FLOAT(grad_dtype, G, __VA_ARGS__))
