// CPU cast-and-scale over one contiguous range of the concatenated segments. Each
// instruction-set build (multi_tensor_cpu.cc baseline, multi_tensor_cpu_avx2.cc,
// multi_tensor_cpu_avx512.cc) includes
// this file with its own element loop (`Piece`), so the dispatch and the walk over segments
// exist once. Everything here has internal linkage: an ISA build must not lend a
// vector-instruction copy of a shared inline function to the baseline build.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/multi_tensor.h"
#include "kernels/multi_tensor_dispatch.h"
#include "kernels/multi_tensor_functors.h"

namespace dk::kernels {

// Elements [begin, end) of the segments laid end to end; segment i starts at starts[i].
struct CpuRange {
  int64_t begin;
  int64_t end;
};

// Result of one range: the flag and partial sums of squares (one, or one per segment),
// combined by the caller in a fixed order.
struct CpuRangeResult {
  bool nonfinite = false;
  double* partial_sums = nullptr;
};

using CastScaleRangeFn = Status (*)(const TensorSegment* segments, int64_t num_segments,
                                    const int64_t* starts, CpuRange range,
                                    const CastScaleArgs& args, float scale, CpuRangeResult* result);

namespace baseline {
Status castScaleRange(const TensorSegment* segments, int64_t num_segments, const int64_t* starts,
                      CpuRange range, const CastScaleArgs& args, float scale,
                      CpuRangeResult* result);
}  // namespace baseline

namespace avx2 {
Status castScaleRange(const TensorSegment* segments, int64_t num_segments, const int64_t* starts,
                      CpuRange range, const CastScaleArgs& args, float scale,
                      CpuRangeResult* result);
}  // namespace avx2

namespace avx512 {
Status castScaleRange(const TensorSegment* segments, int64_t num_segments, const int64_t* starts,
                      CpuRange range, const CastScaleArgs& args, float scale,
                      CpuRangeResult* result);
}  // namespace avx512

namespace {

// The shared functor, one element at a time: the baseline build, and the AVX2 build where the
// compiler vectorises what it can of it.
template <typename Src, typename Dst, bool kAccumulate, typename SumT>
struct ScalarPiece {
  static void run(const Src* src, Dst* dst, int64_t count, float scale, bool& nonfinite,
                  SumT& sum) {
    const CastScaleOp<Src, Dst, kAccumulate> op{scale};
    for (int64_t i = 0; i < count; ++i) {
      dst[i] = op(src[i], kAccumulate ? dst[i] : Dst{}, nonfinite);
      if constexpr (!std::is_same<SumT, NoSum>::value) addSquare(sum, load(dst[i]));
    }
  }
};

// First segment whose elements reach past `begin` (segments are sorted by start).
int64_t firstSegmentAt(const int64_t* starts, int64_t num_segments, int64_t begin) {
  int64_t lo = 0, hi = num_segments;  // invariant: the answer lies in [lo, hi]
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (starts[mid + 1] <= begin) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

template <template <typename, typename, bool, typename> class Piece, typename Src, typename Dst,
          bool kAccumulate, typename SumT>
void castScaleRangeTyped(const TensorSegment* segments, int64_t num_segments, const int64_t* starts,
                         CpuRange range, float scale, bool per_segment, CpuRangeResult* result) {
  bool nonfinite = false;
  for (int64_t i = firstSegmentAt(starts, num_segments, range.begin);
       i < num_segments && starts[i] < range.end; ++i) {
    const int64_t lo = (range.begin > starts[i] ? range.begin : starts[i]) - starts[i];
    const int64_t hi = (range.end < starts[i + 1] ? range.end : starts[i + 1]) - starts[i];
    if (lo >= hi) continue;
    SumT sum{};
    Piece<Src, Dst, kAccumulate, SumT>::run(static_cast<const Src*>(segments[i].src) + lo,
                                            static_cast<Dst*>(segments[i].dst) + lo, hi - lo, scale,
                                            nonfinite, sum);
    if constexpr (!std::is_same<SumT, NoSum>::value) {
      result->partial_sums[per_segment ? i : 0] += sum;
    }
  }
  result->nonfinite |= nonfinite;
}

template <template <typename, typename, bool, typename> class Piece>
Status castScaleRangeWith(const TensorSegment* segments, int64_t num_segments,
                          const int64_t* starts, CpuRange range, const CastScaleArgs& args,
                          float scale, CpuRangeResult* result) {
  const bool per_segment = args.sum_squares_mode == SumSquares::kPerSegment;
  DK_DISPATCH_CAST_SCALE(args,
                         castScaleRangeTyped<Piece, Src, Dst, kAccumulate, SumT>(
                             segments, num_segments, starts, range, scale, per_segment, result));
  return Status::Ok();
}

}  // namespace

}  // namespace dk::kernels
