// CPU cast-and-scale: the baseline build of the element loop (the shared functor, any x86-64),
// the instruction-set build chosen by cpu_isa.h, and the split of big calls across the shared
// CPU pool.
#include <algorithm>
#include <vector>

#include "kernels/cpu_isa.h"
#include "kernels/cpu_thread_pool.h"
#include "kernels/multi_tensor.h"
#include "kernels/multi_tensor_cpu_range.h"
#include "kernels/reduce.h"

namespace dk::kernels {

namespace {

CastScaleRangeFn activeRangeFn() {
  switch (activeCpuIsa()) {
    case CpuIsa::kAvx512:
      return &avx512::castScaleRange;
    case CpuIsa::kAvx2:
      return &avx2::castScaleRange;
    default:
      return &baseline::castScaleRange;
  }
}

// Runs the ranges on the shared CPU pool (the caller takes part), each range exactly once.
void runRanges(const TensorSegment* segments, int64_t num_segments, const int64_t* starts,
               const std::vector<CpuRange>& ranges, const CastScaleArgs& args, float scale,
               std::vector<CpuRangeResult>& results, std::vector<Status>& statuses) {
  const CastScaleRangeFn fn = activeRangeFn();
  auto run = [&](int t) {
    statuses[t] = fn(segments, num_segments, starts, ranges[t], args, scale, &results[t]);
  };
  if (ranges.size() == 1) {
    run(0);
  } else {
    cpuPoolRun(static_cast<int>(ranges.size()), run);
  }
}

// One range per thread once the call touches enough bytes to gain from a split, by the same
// measured threshold as the other standalone kernels (cpuWorthSplitting, reduce.h: 512 KiB on
// OpenMP). It was 1M elements per thread, a rule from when each part started a std::thread:
// a 4 MiB float32 unscale then ran on one thread at 0.65x torch's two.
std::vector<CpuRange> splitRanges(int64_t total, const CastScaleArgs& args, int num_threads) {
  // read the source, write the destination, and read it too when accumulating
  const size_t per_element =
      dtypeSize(args.src_dtype) + dtypeSize(args.dst_dtype) * (args.accumulate ? 2 : 1);
  const bool split = num_threads > 1 && cpuWorthSplitting(static_cast<size_t>(total) * per_element);
  const int64_t parts = split ? std::min<int64_t>(num_threads, total) : 1;
  std::vector<CpuRange> ranges;
  for (int64_t t = 0; t < parts; ++t)
    ranges.push_back({total * t / parts, total * (t + 1) / parts});
  return ranges;
}

// Adds the partial sums in thread order (a fixed order: the same inputs give the same bits).
template <typename Out>
void addPartialSums(Out* out, const std::vector<std::vector<double>>& partials) {
  for (const auto& partial : partials) {
    for (size_t k = 0; k < partial.size(); ++k) out[k] += static_cast<Out>(partial[k]);
  }
}

}  // namespace

namespace baseline {
Status castScaleRange(const TensorSegment* segments, int64_t num_segments, const int64_t* starts,
                      CpuRange range, const CastScaleArgs& args, float scale,
                      CpuRangeResult* result) {
  return castScaleRangeWith<ScalarPiece>(segments, num_segments, starts, range, args, scale,
                                         result);
}
}  // namespace baseline

Status castScaleMultiCpu(const TensorSegment* segments, int64_t num_segments,
                         const CastScaleArgs& args, int num_threads) {
  DK_RETURN_IF_ERROR(validateCastScaleArgs(segments, num_segments, args));
  std::vector<int64_t> starts(num_segments + 1, 0);
  for (int64_t i = 0; i < num_segments; ++i) starts[i + 1] = starts[i] + segments[i].count;
  const float scale = args.scale_ptr != nullptr ? *args.scale_ptr : args.scale;
  const std::vector<CpuRange> ranges = splitRanges(starts[num_segments], args, num_threads);

  const int64_t num_sums = args.sum_squares_mode == SumSquares::kPerSegment ? num_segments
                           : args.sum_squares_mode == SumSquares::kTotal    ? 1
                                                                            : 0;
  std::vector<std::vector<double>> partials(ranges.size(), std::vector<double>(num_sums, 0.0));
  std::vector<CpuRangeResult> results(ranges.size());
  for (size_t t = 0; t < ranges.size(); ++t) results[t].partial_sums = partials[t].data();
  std::vector<Status> statuses(ranges.size());
  runRanges(segments, num_segments, starts.data(), ranges, args, scale, results, statuses);

  bool nonfinite = false;
  for (size_t t = 0; t < ranges.size(); ++t) {
    DK_RETURN_IF_ERROR(statuses[t]);
    nonfinite |= results[t].nonfinite;
  }
  if (nonfinite && args.flag != nullptr) *args.flag = args.flag_bits;
  if (num_sums == 0) return Status::Ok();
  if (args.sum_squares_dtype == DType::kFloat64) {
    addPartialSums(static_cast<double*>(args.sum_squares), partials);
  } else {
    addPartialSums(static_cast<float*>(args.sum_squares), partials);
  }
  return Status::Ok();
}

}  // namespace dk::kernels
