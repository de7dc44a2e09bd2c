// Reduce and divide loops, compiled once per instruction set: a file defines DK_CPU_ISA_NS
// (baseline, avx2 or avx512) and includes this header; CMake gives *_avx2.cc / *_avx512.cc their
// -m flags, and GCC vectorises the loops for that set. Everything here has internal linkage or
// lives in the ISA's namespace, so the builds never merge at link time (an AVX-512 copy of a
// template must not be picked for the baseline build).
//
// Invariants:
//  - FP16 / BF16 are widened to FP32 (Accum<T>), combined, and rounded once on store (RNE).
//  - reduceMulti keeps one FP32 accumulator per element across all sources: one rounding total.
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
#include "kernels/reduce_cpu_isa.h"
#include "kernels/reduce_functors.h"

namespace dk::kernels::DK_CPU_ISA_NS {

namespace {

// Elements per accumulator block in reduceMulti: 1024 FP32 accumulators are 4 KiB (8 KiB for
// 64-bit types), small enough to stay in L1 while every source streams through them.
constexpr size_t kMultiBlock = 1024;

template <typename T, typename Op>
void reduceLoop(T* dst, const T* a, const T* b, size_t count) {
  const Op op;
#pragma GCC ivdep
  for (size_t i = 0; i < count; ++i) dst[i] = store<T>(op(load(a[i]), load(b[i])));
}

// One block of reduceMulti: acc = src0; acc = op(acc, src_s) for each further source; store.
template <typename T, typename Op>
void reduceMultiBlock(T* dst, const void* const* srcs, int nsrcs, size_t begin, size_t n) {
  using A = typename Accum<T>::type;
  const Op op;
  A acc[kMultiBlock];
  const T* first = static_cast<const T*>(srcs[0]) + begin;
  for (size_t j = 0; j < n; ++j) acc[j] = load(first[j]);
  for (int s = 1; s < nsrcs; ++s) {
    const T* src = static_cast<const T*>(srcs[s]) + begin;
    for (size_t j = 0; j < n; ++j) acc[j] = op(acc[j], load(src[j]));
  }
  T* out = dst + begin;
#pragma GCC ivdep
  for (size_t j = 0; j < n; ++j) out[j] = store<T>(acc[j]);
}

template <typename T, typename Op>
void reduceMultiLoop(T* dst, const void* const* srcs, int nsrcs, size_t count) {
  if (nsrcs == 1) {
    const T* src = static_cast<const T*>(srcs[0]);
    if (src != dst) std::memcpy(dst, src, count * sizeof(T));
    return;
  }
  if (nsrcs == 2) {
    reduceLoop<T, Op>(dst, static_cast<const T*>(srcs[0]), static_cast<const T*>(srcs[1]), count);
    return;
  }
  for (size_t begin = 0; begin < count; begin += kMultiBlock) {
    const size_t n = count - begin < kMultiBlock ? count - begin : kMultiBlock;
    reduceMultiBlock<T, Op>(dst, srcs, nsrcs, begin, n);
  }
}

// Integers truncate toward zero in int64 (so int8 / 300 is 0, not int8 / int8(300)). The one
// overflowing case, INT64_MIN / -1, wraps like torch instead of trapping.
template <typename T>
void divideIntegerLoop(T* dst, const T* src, size_t count, int64_t divisor) {
  if (divisor == -1) {
#pragma GCC ivdep
    for (size_t i = 0; i < count; ++i) dst[i] = wrapMul(src[i], static_cast<T>(-1));
    return;
  }
#pragma GCC ivdep
  for (size_t i = 0; i < count; ++i) dst[i] = static_cast<T>(static_cast<int64_t>(src[i]) / divisor);
}

template <typename T>
void divideLoop(T* dst, const T* src, size_t count, int64_t divisor) {
  using A = typename Accum<T>::type;
  if constexpr (std::is_integral<A>::value) {
    divideIntegerLoop<T>(dst, src, count, divisor);
  } else {
    const A d = static_cast<A>(divisor);
#pragma GCC ivdep
    for (size_t i = 0; i < count; ++i) dst[i] = store<T>(load(src[i]) / d);
  }
}

}  // namespace

Status reduce(void* dst, const void* a, const void* b, size_t count, DType dtype, RedOp op) {
  DK_DISPATCH_DTYPE(
      dtype, DK_DISPATCH_REDOP(op, reduceLoop<T, Op>(static_cast<T*>(dst), static_cast<const T*>(a),
                                                     static_cast<const T*>(b), count)));
  return Status::Ok();
}

Status reduceMulti(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype,
                   RedOp op) {
  DK_DISPATCH_DTYPE(dtype, DK_DISPATCH_REDOP(op, reduceMultiLoop<T, Op>(static_cast<T*>(dst), srcs,
                                                                        nsrcs, count)));
  return Status::Ok();
}

Status divide(void* dst, const void* src, size_t count, DType dtype, int64_t divisor) {
  DK_DISPATCH_DTYPE(
      dtype, divideLoop<T>(static_cast<T*>(dst), static_cast<const T*>(src), count, divisor));
  return Status::Ok();
}

}  // namespace dk::kernels::DK_CPU_ISA_NS
