// What one collective call asks of an algorithm: pointers, counts, dtype, op. Algorithms are
// written against Transport and Compute only (no shared-memory or CUDA detail), so the same
// ring and tree drive ShmTransport and NcclTransport.
#pragma once

#include <cstddef>

#include "algorithm/compute.h"
#include "common/dtype.h"
#include "transport/transport.h"

namespace dk::algo {

enum class Algorithm : int { kAuto = 0, kRing = 1, kTree = 2, kOneShot = 3 };

struct CollectiveArgs {
  const void* src = nullptr;  // input (may equal dst: in place)
  void* dst = nullptr;        // output
  size_t count = 0;           // all_reduce / broadcast: elements; scatter / gather: per rank
  DType dtype = DType::kFloat32;
  RedOp op = RedOp::kSum;
  int root = 0;             // broadcast root, send / recv peer
  void* scratch = nullptr;  // at least transport.maxMessageBytes() bytes of local memory
};

// The layers an algorithm runs on.
struct Channel {
  Transport& transport;
  Compute& compute;
};

}  // namespace dk::algo
