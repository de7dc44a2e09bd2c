// What one collective call asks of an algorithm: pointers, counts, dtype, op. Algorithms are
// written against Transport and Compute only (no shared-memory or CUDA detail), so the same
// ring and tree drive ShmTransport and NcclTransport.
#pragma once

#include <cstddef>

#include "algorithm/compute.h"
#include "common/dtype.h"
#include "transport/transport.h"

namespace dk::algo {

// The codes Python passes (dist_kernels/comm/algorithms.py holds the same table; a test checks
// it against _C.ALGORITHMS, which the bindings build from algorithmName()). kNccl: NCCL's own
// collective, on the NCCL route only.
enum class Algorithm : int { kAuto = 0, kRing = 1, kTree = 2, kOneShot = 3, kNccl = 4 };
constexpr int kNumAlgorithms = 5;

// "auto", "ring", "tree", "one_shot", "nccl"; "?" for a code out of range.
inline const char* algorithmName(Algorithm a) {
  constexpr const char* kNames[kNumAlgorithms] = {"auto", "ring", "tree", "one_shot", "nccl"};
  const int i = static_cast<int>(a);
  return i >= 0 && i < kNumAlgorithms ? kNames[i] : "?";
}

struct CollectiveArgs {
  const void* src = nullptr;  // input (may equal dst: in place)
  void* dst = nullptr;        // output
  size_t count = 0;           // all_reduce / broadcast: elements; scatter / gather: per rank
  DType dtype = DType::kFloat32;
  RedOp op = RedOp::kSum;
  int root = 0;  // broadcast root, send / recv peer
};

// The layers an algorithm runs on, and local memory of its own on the same device.
struct Channel {
  Transport& transport;
  Compute& compute;
  void* scratch = nullptr;  // at least transport.maxMessageBytes() bytes (ring reduce-scatter)
};

// Independent channels between the same ranks (NCCL: one communicator, stream and staging
// each). Ring slices and tree halves alternate over them, so one lane's reduce runs while
// another lane's bytes arrive. Every lane has the same maxMessageBytes(), and every rank has
// the same number of lanes, so slice j travels lane j % count() everywhere. Shared memory has
// one lane (a Channel converts to Lanes), and then the algorithms run exactly as with a Channel.
class Lanes {
 public:
  // Implicit: a single channel is one lane.
  Lanes(const Channel& one) : lanes_(&one), count_(1) {}
  Lanes(const Channel* lanes, int count) : lanes_(lanes), count_(count < 1 ? 1 : count) {}

  int count() const { return count_; }
  // The lane of slice (or tree) j.
  const Channel& operator[](size_t j) const { return lanes_[j % static_cast<size_t>(count_)]; }

 private:
  const Channel* lanes_;
  int count_;
};

}  // namespace dk::algo
