// Element types and reduction ops as the C++ core sees them. The integer codes are part of the
// binding ABI: dist_kernels/_dtypes.py maps torch dtypes and ReduceOps onto them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dk {

enum class DType : int {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kInt8 = 6,
  kUInt8 = 7,
};
constexpr int kNumDTypes = 8;

enum class RedOp : int {
  kSum = 0,
  kProd = 1,
  kMax = 2,
  kMin = 3,
  kAvg = 4,  // sum, then divide by the number of contributions
};
constexpr int kNumRedOps = 5;

inline bool isValidDType(int d) { return d >= 0 && d < kNumDTypes; }
inline bool isValidRedOp(int op) { return op >= 0 && op < kNumRedOps; }

inline size_t dtypeSize(DType d) {
  switch (d) {
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kInt8:
    case DType::kUInt8:
      return 1;
  }
  return 0;
}

inline bool isFloating(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat64 || d == DType::kFloat16 ||
         d == DType::kBFloat16;
}

inline const char* dtypeName(DType d) {
  switch (d) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kInt8:
      return "int8";
    case DType::kUInt8:
      return "uint8";
  }
  return "unknown";
}

inline const char* redOpName(RedOp op) {
  switch (op) {
    case RedOp::kSum:
      return "sum";
    case RedOp::kProd:
      return "prod";
    case RedOp::kMax:
      return "max";
    case RedOp::kMin:
      return "min";
    case RedOp::kAvg:
      return "avg";
  }
  return "unknown";
}

}  // namespace dk
