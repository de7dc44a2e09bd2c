// Reduce and reduce-and-divide loops, compiled once per instruction set: a file defines
// DK_CPU_ISA_NS (baseline, avx2 or avx512) and includes this header; CMake gives *_avx2.cc /
// *_avx512.cc their -m flags, and GCC vectorises the loops for that set. Everything here has
// internal linkage or lives in the ISA's namespace, so the builds never merge at link time (an
// AVX-512 copy of a template must not be picked for the baseline build).
//
// Invariants:
//  - FP16 / BF16 are widened to FP32 (Accum<T>), combined, and rounded once on store (RNE).
//  - reduceMulti keeps one FP32 accumulator per element across all sources: one rounding total.
//  - reduceAverage is reduceMulti(SUM) whose completed sum is divided (reduce_functors.h:
//    DivideBy, or ScaleBy for a power of two: the same bits) before that one rounding, so AVG's
//    divide costs no pass of its own over memory. A divide alone is an average of one source.
//  - FP32, FP64 and integers compute in place; FP16 / BF16 are staged a block at a time through
//    FP32 buffers in L1 (cpu_widen_impl.h), which lets the conversions run as vector code.
//  - dst may alias a source exactly (same start); partial overlap is not supported. Exact
//    aliasing creates no dependence between iterations, which is why `#pragma GCC ivdep` is
//    correct and spares GCC's run-time overlap checks (which would reject dst == a).
#pragma once

#ifndef DK_CPU_ISA_NS
#error "define DK_CPU_ISA_NS (baseline, avx2 or avx512) before including reduce_cpu_impl.h"
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/dispatch.h"
#include "common/half.h"
#include "kernels/cpu_widen_impl.h"
#include "kernels/reduce_cpu_isa.h"
#include "kernels/reduce_functors.h"

namespace dk::kernels::DK_CPU_ISA_NS {

namespace {

// Elements per block in the staged loops: 1024 accumulators are 4 KiB in FP32 (8 KiB for 64-bit
// types), small enough for L1 while every source streams through them.
constexpr size_t kBlock = 1024;

template <typename T>
constexpr bool kComputesInStorageType = std::is_same<typename Accum<T>::type, T>::value;

// dst = finish(op(a, b)) directly in the storage type (FP32, FP64, integers).
template <typename T, typename Op, typename Finish>
void reduceLoop(T* dst, const T* a, const T* b, size_t count, Finish finish) {
  const Op op;
#pragma GCC ivdep
  for (size_t i = 0; i < count; ++i) dst[i] = finish(op(a[i], b[i]));
}

// acc = finish(op(acc, src)) over one block in L1.
template <typename A, typename Op, typename Finish>
void accumulate(A* acc, const A* src, size_t n, Finish finish) {
  const Op op;
  for (size_t j = 0; j < n; ++j) acc[j] = finish(op(acc[j], src[j]));
}

// One block of a multi-source reduce: acc = src0; acc = op(acc, src_s) for each further source;
// finish (AVG's divide, or nothing) rides in the last source's loop, on the FP32 sum; one
// rounding when acc is narrowed into dst.
template <typename T, typename Op, typename Finish>
void reduceMultiBlock(T* dst, const void* const* srcs, int nsrcs, size_t begin, size_t n,
                      Finish finish) {
  using A = typename Accum<T>::type;
  A acc[kBlock];
  widen(acc, static_cast<const T*>(srcs[0]) + begin, n);
  for (int s = 1; s < nsrcs; ++s) {
    const T* src = static_cast<const T*>(srcs[s]) + begin;
    const A* operand;
    A wide[kComputesInStorageType<T> ? 1 : kBlock];
    if constexpr (kComputesInStorageType<T>) {
      operand = src;
    } else {
      widen(wide, src, n);
      operand = wide;
    }
    if (s + 1 < nsrcs) {
      accumulate<A, Op>(acc, operand, n, KeepSum{});
    } else {
      accumulate<A, Op>(acc, operand, n, finish);
    }
  }
  if constexpr (!std::is_same<Finish, KeepSum>::value) {
    if (nsrcs == 1) {
      for (size_t j = 0; j < n; ++j) acc[j] = finish(acc[j]);
    }
  }
  narrow(dst + begin, acc, n);
}

template <typename T, typename Op, typename Finish>
void reduceMultiLoop(T* dst, const void* const* srcs, int nsrcs, size_t count, Finish finish) {
  constexpr bool kKeep = std::is_same<Finish, KeepSum>::value;
  if (nsrcs == 1 && kKeep) {
    if (srcs[0] != dst) std::memcpy(dst, srcs[0], count * sizeof(T));
    return;
  }
  if constexpr (kComputesInStorageType<T>) {
    if (nsrcs == 1) {  // a divide on its own (divideCpu)
      const T* src = static_cast<const T*>(srcs[0]);
#pragma GCC ivdep
      for (size_t i = 0; i < count; ++i) dst[i] = finish(src[i]);
      return;
    }
    if (nsrcs == 2) {
      reduceLoop<T, Op>(dst, static_cast<const T*>(srcs[0]), static_cast<const T*>(srcs[1]), count,
                        finish);
      return;
    }
  }
#if defined(__AVX512BW__) || defined(__AVX2__)
  const void* rest[2];
  if constexpr (std::is_same<T, BFloat16>::value && std::is_same<Op, SumOp>::value && kKeep) {
    if (nsrcs == 2) {  // the common BF16 all-reduce step: in registers, the tail below
      const auto* a = static_cast<const T*>(srcs[0]);
      const auto* b = static_cast<const T*>(srcs[1]);
      const size_t done = sumBf16Vectors(dst, a, b, count);
      rest[0] = a + done, rest[1] = b + done;
      srcs = rest, dst += done, count -= done;
    }
  }
#endif
  for (size_t begin = 0; begin < count; begin += kBlock) {
    reduceMultiBlock<T, Op>(dst, srcs, nsrcs, begin,
                            count - begin < kBlock ? count - begin : kBlock, finish);
  }
}

template <typename T, typename Op>
void reduceTwo(T* dst, const T* a, const T* b, size_t count) {
  if constexpr (kComputesInStorageType<T>) {
    reduceLoop<T, Op>(dst, a, b, count, KeepSum{});
  } else {
    const void* srcs[2] = {a, b};
    reduceMultiLoop<T, Op>(dst, srcs, 2, count, KeepSum{});
  }
}

}  // namespace

Status reduce(void* dst, const void* a, const void* b, size_t count, DType dtype, RedOp op) {
  DK_DISPATCH_DTYPE(
      dtype, DK_DISPATCH_REDOP(op, reduceTwo<T, Op>(static_cast<T*>(dst), static_cast<const T*>(a),
                                                    static_cast<const T*>(b), count)));
  return Status::Ok();
}

Status reduceMulti(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype,
                   RedOp op) {
  DK_DISPATCH_DTYPE(dtype, DK_DISPATCH_REDOP(op, reduceMultiLoop<T, Op>(static_cast<T*>(dst), srcs,
                                                                        nsrcs, count, KeepSum{})));
  return Status::Ok();
}

Status reduceAverage(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype,
                     int64_t divisor) {
  DK_DISPATCH_DTYPE(dtype, withAverageFinish<T>(divisor, [&](auto finish) {
                      reduceMultiLoop<T, SumOp>(static_cast<T*>(dst), srcs, nsrcs, count, finish);
                    }));
  return Status::Ok();
}

}  // namespace dk::kernels::DK_CPU_ISA_NS
