// One definition of the reduction math, shared by the CPU and CUDA kernels (design: "CPU and
// CUDA versions share one definition of the math"). Operands arrive in the compute type
// (Accum<T>: float for FP16/BF16, T otherwise).
//
// Invariants:
//  - NaN propagates through MAX and MIN as in torch.maximum / torch.minimum.
//  - Signed integer SUM and PROD wrap modulo 2^bits as torch does (computed unsigned: no UB).
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/dtype.h"
#include "common/half.h"
#include "common/macros.h"

namespace dk::kernels {

template <typename A>
DK_HOST_DEVICE DK_INLINE bool isNan(A v) {
  if constexpr (std::is_floating_point<A>::value) {
    return v != v;
  } else {
    return false;
  }
}

// Wrapping arithmetic for integers: performed in the unsigned type of the same width.
template <typename A>
DK_HOST_DEVICE DK_INLINE A wrapAdd(A a, A b) {
  if constexpr (std::is_integral<A>::value) {
    using U = typename std::make_unsigned<A>::type;
    return static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}

template <typename A>
DK_HOST_DEVICE DK_INLINE A wrapMul(A a, A b) {
  if constexpr (std::is_integral<A>::value) {
    // Promote narrow types to unsigned int so the product cannot overflow a signed int.
    using U = typename std::conditional<(sizeof(A) < sizeof(unsigned)), unsigned,
                                        typename std::make_unsigned<A>::type>::type;
    return static_cast<A>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
  } else {
    return a * b;
  }
}

struct SumOp {
  template <typename A>
  DK_HOST_DEVICE DK_INLINE A operator()(A a, A b) const {
    return wrapAdd(a, b);
  }
};

struct ProdOp {
  template <typename A>
  DK_HOST_DEVICE DK_INLINE A operator()(A a, A b) const {
    return wrapMul(a, b);
  }
};

struct MaxOp {
  template <typename A>
  DK_HOST_DEVICE DK_INLINE A operator()(A a, A b) const {
    if (isNan(a)) return a;
    if (isNan(b)) return b;
    return a > b ? a : b;
  }
};

struct MinOp {
  template <typename A>
  DK_HOST_DEVICE DK_INLINE A operator()(A a, A b) const {
    if (isNan(a)) return a;
    if (isNan(b)) return b;
    return a < b ? a : b;
  }
};

// What a reduce does with each completed element before storing it, in the compute type (so
// FP16 / BF16 still round once). KeepSum: SUM, PROD, MAX, MIN and AVG's partial sums.
struct KeepSum {
  template <typename A>
  DK_HOST_DEVICE DK_INLINE A operator()(A sum) const {
    return sum;
  }
};

// AVG's last step, fused into the reduce that completes the sum. Integers truncate toward zero
// in int64 (so int8 / 300 is 0, not int8 / int8(300)); INT64_MIN / -1 wraps like torch instead
// of trapping. Floats divide (not multiply by a reciprocal, which is not correctly rounded).
//
// 8-bit integers divide in float, signed 32-bit ones in double: both vectorise (an int64
// divide does not) and truncate to the same quotient. With |x| < 2^b and a p-bit significand
// (b = 8, p = 24; b = 31, p = 53), the rounding error of x / d is below |x / d| 2^-p <
// 2^(b-p) / |d| < 1 / |d|, while a quotient that is not an integer lies at least 1 / |d| from
// every integer: the rounded quotient never reaches or crosses one, and integer quotients are
// exact. (Where d itself rounds, |d| > 2^p, |x / d| < 1 and both give 0.) |d| >= 2 keeps the
// quotient in int32. Measured on the AVX-512 VM, a 16 MiB two-source AVG / SUM time (one
// thread, min of 40): int32 9.9 -> 2.0, int8 25 -> 2.7 (was: a SUM pass, then an int64 divide
// pass); int64 keeps the int64 divide (4.6).
struct DivideBy {
  int64_t divisor;
  template <typename A>
  DK_HOST_DEVICE DK_INLINE A operator()(A sum) const {
    if constexpr (std::is_integral<A>::value) {
      if (divisor == -1) return wrapMul(sum, static_cast<A>(-1));
      if constexpr (sizeof(A) == 1) {
        const float q = static_cast<float>(sum) / static_cast<float>(divisor);
        return static_cast<A>(static_cast<int32_t>(q));
      } else if constexpr (sizeof(A) == 4 && std::is_signed<A>::value) {
        const double q = static_cast<double>(sum) / static_cast<double>(divisor);
        return static_cast<A>(static_cast<int32_t>(q));
      } else {
        return static_cast<A>(static_cast<int64_t>(sum) / divisor);
      }
    } else {
      return sum / static_cast<A>(divisor);
    }
  }
};

// AVG's divide by a power of two: x * 2^-k is the same real number as x / 2^k, rounded once the
// same way (subnormal results included), so the bits equal DivideBy's, while a multiply costs a
// fraction of a divide. Measured on the shared 2-core AVX-512 VM (load average ~6), a 16 MiB
// two-source reduce (cache-resident, one thread), AVG / SUM time, min of 40: BF16 1.72 and
// FP16 1.99 dividing by 2 (the divide unit is the limit), 1.03 and 1.08 multiplying by 0.5;
// FP32 1.00 either way (memory-bound). A divisor of 3 still divides: BF16 1.51, FP16 1.63.
template <typename A>
struct ScaleBy {
  A factor;
  DK_HOST_DEVICE DK_INLINE A operator()(A sum) const { return sum * factor; }
};

// Returns fn(finish) with AVG's finisher for storage type T: ScaleBy for a floating compute type
// and a power-of-two divisor (the common world sizes), DivideBy otherwise. Integers always
// divide (truncation toward zero of negative sums is not a shift).
template <typename T, typename Fn>
inline auto withAverageFinish(int64_t divisor, Fn&& fn) {
  using A = typename Accum<T>::type;
  if constexpr (std::is_floating_point<A>::value) {
    if (divisor > 0 && (divisor & (divisor - 1)) == 0) {
      return fn(ScaleBy<A>{static_cast<A>(1) / static_cast<A>(divisor)});
    }
  }
  return fn(DivideBy{divisor});
}

// Calls fn(FunctorInstance) for a runtime RedOp; AVG reduces as SUM (the caller divides once,
// with DivideBy in the reduce that completes the sum, so every rank divides the same value).
#define DK_DISPATCH_REDOP(op, ...)                                                        \
  switch (op) {                                                                           \
    case ::dk::RedOp::kSum:                                                               \
    case ::dk::RedOp::kAvg: {                                                             \
      using Op = ::dk::kernels::SumOp;                                                    \
      __VA_ARGS__;                                                                        \
      break;                                                                              \
    }                                                                                     \
    case ::dk::RedOp::kProd: {                                                            \
      using Op = ::dk::kernels::ProdOp;                                                   \
      __VA_ARGS__;                                                                        \
      break;                                                                              \
    }                                                                                     \
    case ::dk::RedOp::kMax: {                                                             \
      using Op = ::dk::kernels::MaxOp;                                                    \
      __VA_ARGS__;                                                                        \
      break;                                                                              \
    }                                                                                     \
    case ::dk::RedOp::kMin: {                                                             \
      using Op = ::dk::kernels::MinOp;                                                    \
      __VA_ARGS__;                                                                        \
      break;                                                                              \
    }                                                                                     \
    default:                                                                              \
      return ::dk::InvalidArgument("unsupported reduce op " + std::to_string((int)(op))); \
  }

}  // namespace dk::kernels
