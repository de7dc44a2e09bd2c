// Keep masks of counter-based dropout (dist_kernels/models/dropout.py): an element is kept when
// a hash of its global coordinates clears a threshold, so every parallel layout, and every
// recomputation, draws the same mask for it. Python hashes the slower coordinates into one
// 32-bit value per row (small tensors); this kernel does the full-size last step, which torch's
// int64 ops did at ~15 passes over memory.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace dk::kernels {

// lowbias32 (C. Wellons): a bijective 32-bit mixer. The Python side computes the same function.
inline uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// out[r * cols + c] = lowbias32(uint32(rows_hash[r]) ^ uint32(cols_index[c])) >= threshold, as
// 0 / 1 bytes (a torch.bool tensor). threshold <= 2^32 (2^32 drops everything). Split over the
// CPU pool's threads when `parallel`.
Status dropoutKeepMaskCpu(uint8_t* out, const int64_t* rows_hash, size_t rows,
                          const int64_t* cols_index, size_t cols, uint64_t threshold,
                          bool parallel);

}  // namespace dk::kernels
