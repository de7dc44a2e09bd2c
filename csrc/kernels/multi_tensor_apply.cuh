// One launcher for many tensors (the apex multi_tensor_apply idea): the host cuts every
// segment into chunks of `kChunk` elements, lists (segment, chunk) pairs in a table passed to
// the kernel by value, and launches one kernel per full table. Block b works on chunk
// table.block_chunk[b] of segment table.block_segment[b]; the op is a functor
//   op(src, dst, count, segment_index)
// called by all threads of the block on one chunk.
//
//   segments:  [ s0 ............ ][ s1 .. ][ s2 ............................ ]
//   chunks:    [ c0 ][ c1 ][ c2 ]  [ c0 ]   [ c0 ][ c1 ][ c2 ][ c3 ][ c4 ]
//   blocks:      b0    b1    b2      b3       b4    b5   | table full: launch, carry s2 over
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "common/status.h"
#include "kernels/multi_tensor.h"

namespace dk::kernels {

// Table sizes keep the kernel parameter under the classic 4 KiB limit:
// 36 * (8 + 8 + 8 + 4) + 320 * (1 + 4) + 8 = 2616 bytes.
constexpr int kMaxTableSegments = 36;
constexpr int kMaxTableBlocks = 320;
// 64 Ki elements per block (apex's chunk size): a 64 MiB float32 bucket is 256 blocks, one
// launch. Not tuned on a device yet (no GPU in the session that wrote this): the device check's
// bench_bucket.py --device cuda run reports the fraction of copy bandwidth to tune against.
constexpr int64_t kChunk = 65536;
constexpr int kBlockThreads = 512;

struct SegmentTable {
  const void* src[kMaxTableSegments];
  void* dst[kMaxTableSegments];
  int64_t count[kMaxTableSegments];
  int32_t index[kMaxTableSegments];  // position in the caller's segment list
  uint8_t block_segment[kMaxTableBlocks];
  int32_t block_chunk[kMaxTableBlocks];
};
static_assert(sizeof(SegmentTable) <= 4000, "kernel parameters must stay under 4 KiB");
static_assert(kMaxTableSegments <= 256, "block_segment is a uint8_t");

inline Status cudaCheck(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status(Code::kCudaError, std::string(what) + ": " + cudaGetErrorString(err));
}

template <typename Op>
__global__ void __launch_bounds__(kBlockThreads) multiTensorKernel(SegmentTable table, Op op) {
  const int segment = table.block_segment[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(table.block_chunk[blockIdx.x]) * kChunk;
  const int64_t left = table.count[segment] - begin;
  op(table.src[segment], table.dst[segment], begin, left < kChunk ? left : kChunk,
     table.index[segment]);
}

template <typename Op>
Status launchTable(const SegmentTable& table, int num_blocks, const Op& op, cudaStream_t stream) {
  multiTensorKernel<Op><<<num_blocks, kBlockThreads, 0, stream>>>(table, op);
  return cudaCheck(cudaGetLastError(), "multi-tensor kernel launch");
}

template <typename Op>
Status multiTensorApply(const TensorSegment* segments, int64_t num_segments, const Op& op,
                        cudaStream_t stream) {
  SegmentTable table;
  int slot = 0, blocks = 0;
  for (int64_t i = 0; i < num_segments; ++i) {
    if (segments[i].count == 0) continue;
    table.src[slot] = segments[i].src;
    table.dst[slot] = segments[i].dst;
    table.count[slot] = segments[i].count;
    table.index[slot] = static_cast<int32_t>(i);
    const int64_t chunks = (segments[i].count + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      table.block_segment[blocks] = static_cast<uint8_t>(slot);
      table.block_chunk[blocks] = static_cast<int32_t>(c);
      ++blocks;
      const bool last_chunk = c == chunks - 1;
      if (blocks == kMaxTableBlocks || (last_chunk && slot + 1 == kMaxTableSegments)) {
        DK_RETURN_IF_ERROR(launchTable(table, blocks, op, stream));
        blocks = 0;
        if (last_chunk) {
          slot = -1;  // the next segment starts a fresh table
        } else {      // the rest of this segment's chunks carry over into slot 0
          table.src[0] = table.src[slot];
          table.dst[0] = table.dst[slot];
          table.count[0] = table.count[slot];
          table.index[0] = table.index[slot];
          slot = 0;
        }
      }
    }
    ++slot;
  }
  if (blocks > 0) DK_RETURN_IF_ERROR(launchTable(table, blocks, op, stream));
  return Status::Ok();
}

}  // namespace dk::kernels
