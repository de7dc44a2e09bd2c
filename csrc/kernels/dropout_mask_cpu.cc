#include "kernels/dropout_mask.h"

#include "kernels/cpu_thread_pool.h"

namespace dk::kernels {

namespace {

// Below this many elements one thread is faster than waking the pool (~1 ns an element).
constexpr size_t kParallelElements = size_t{1} << 16;

}  // namespace

Status dropoutKeepMaskCpu(uint8_t* out, const int64_t* rows_hash, size_t rows,
                          const int64_t* cols_index, size_t cols, uint64_t threshold,
                          bool parallel) {
  if (threshold > (uint64_t{1} << 32)) {
    return InvalidArgument("dropout keep mask: threshold " + std::to_string(threshold) + " > 2^32");
  }
  const size_t count = rows * cols;
  if (count == 0) return Status::Ok();
  const bool split = parallel && count >= kParallelElements;
  return cpuParallelSlices(count, 1, split, [&](size_t begin, size_t end) {
    size_t r = begin / cols;
    size_t c = begin % cols;
    for (size_t i = begin; i < end;) {
      const uint32_t row = static_cast<uint32_t>(rows_hash[r]);
      const size_t stop = (end - i < cols - c) ? c + (end - i) : cols;
      uint8_t* dst = out + i - c;
      for (size_t j = c; j < stop; ++j) {  // the inner loop vectorises: no branch, no division
        const uint32_t h = lowbias32(row ^ static_cast<uint32_t>(cols_index[j]));
        dst[j] = static_cast<uint8_t>(uint64_t{h} >= threshold);
      }
      i += stop - c;
      c = 0;
      ++r;
    }
    return Status::Ok();
  });
}

}  // namespace dk::kernels
