// CPU cast-and-scale: the baseline element loop (the shared functor, any x86-64), the choice
// of instruction set, and the split of big calls across threads.
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kernels/multi_tensor.h"
#include "kernels/multi_tensor_cpu_range.h"
#include "kernels/multi_tensor_functors.h"

namespace dk::kernels {

namespace {

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

bool cpuHasAvx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
}

CastScaleRangeFn initialRangeFn() {
  const char* forced = std::getenv("DK_CPU_ISA");
  if (forced != nullptr && std::strcmp(forced, "baseline") == 0) return &baseline::castScaleRange;
  return cpuHasAvx512() ? &avx512::castScaleRange : &baseline::castScaleRange;
}

CastScaleRangeFn& activeRangeFn() {
  static CastScaleRangeFn fn = initialRangeFn();
  return fn;
}

// Below this many elements per thread a thread is not worth starting: std::thread create + join
// costs tens of microseconds, while 1M float32 elements take about 0.5 ms on one core here
// (measured: 64 MiB of float32 packed into bfloat16 in 8.7 ms by the AVX-512 path).
constexpr int64_t kMinElementsPerThread = int64_t{1} << 20;

// Runs `ranges` on threads (the first on the calling thread); a range whose thread fails to
// start runs inline instead.
void runRanges(const TensorSegment* segments, int64_t num_segments, const int64_t* starts,
               const std::vector<CpuRange>& ranges, const CastScaleArgs& args, float scale,
               std::vector<CpuRangeResult>& results, std::vector<Status>& statuses) {
  const CastScaleRangeFn fn = activeRangeFn();
  std::vector<std::thread> threads;
  for (size_t t = 1; t < ranges.size(); ++t) {
    auto work = [&, t] {
      statuses[t] = fn(segments, num_segments, starts, ranges[t], args, scale, &results[t]);
    };
    try {
      threads.emplace_back(work);
    } catch (...) {  // std::system_error: no thread to spare, so run it here
      work();
    }
  }
  statuses[0] = fn(segments, num_segments, starts, ranges[0], args, scale, &results[0]);
  for (auto& thread : threads) thread.join();
}

std::vector<CpuRange> splitRanges(int64_t total, int num_threads) {
  int64_t parts = total / kMinElementsPerThread;
  if (parts > num_threads) parts = num_threads;
  if (parts < 1) parts = 1;
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

const char* multiTensorCpuIsa() {
  return activeRangeFn() == &avx512::castScaleRange ? "avx512" : "baseline";
}

Status setMultiTensorCpuIsa(const char* name) {
  if (std::strcmp(name, "baseline") == 0) {
    activeRangeFn() = &baseline::castScaleRange;
  } else if (std::strcmp(name, "avx512") == 0) {
    if (!cpuHasAvx512()) return InvalidArgument("this CPU lacks AVX-512 (F, BW, VL, DQ)");
    activeRangeFn() = &avx512::castScaleRange;
  } else {
    return InvalidArgument(std::string("unknown CPU ISA '") + name + "': baseline or avx512");
  }
  return Status::Ok();
}

Status castScaleMultiCpu(const TensorSegment* segments, int64_t num_segments,
                         const CastScaleArgs& args, int num_threads) {
  DK_RETURN_IF_ERROR(validateCastScaleArgs(segments, num_segments, args));
  std::vector<int64_t> starts(num_segments + 1, 0);
  for (int64_t i = 0; i < num_segments; ++i) starts[i + 1] = starts[i] + segments[i].count;
  const float scale = args.scale_ptr != nullptr ? *args.scale_ptr : args.scale;
  const std::vector<CpuRange> ranges = splitRanges(starts[num_segments], num_threads);

  const size_t num_sums = args.sum_squares_mode == SumSquares::kPerSegment ? num_segments
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
