// The CUDA side of an NcclCommunicator's lanes (collective.h: Lanes): the streams they run on,
// the events that fork them from lane 0 and join them back, and the memory of their staging.
//
//   caller stream --event--> lane 0 (the communicator's stream, the Python layer's)
//                              | fork: lane l waits on an event recorded on lane 0
//                              v
//                            lane 1 .. n-1 (streams of their own)
//                              | join: lane 0 waits on an event recorded on each lane l
//                              v
//                            lane 0 --event--> caller stream
//
// Only events, never host synchronisation, so a collective can be captured in a CUDA graph: the
// fork brings lane l into lane 0's capture and the join takes it out again before the capture
// ends. Host memory (device -1, the CPU tests' fake NCCL) has no streams: every call is a no-op
// and memory comes from the heap.
#pragma once

#include <cstddef>
#include <vector>

#include "common/status.h"

namespace dk {

// Memory of `bytes` on `device` (cudaMalloc), or on the host for device -1.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  Status allocate(int device, size_t bytes);
  // Frees the memory (cudaFree waits for the device's work to finish first).
  Status release();
  char* data() const { return data_; }

 private:
  int device_ = -1;
  char* data_ = nullptr;
};

class LaneStreams {
 public:
  LaneStreams() = default;
  ~LaneStreams() { destroy(); }
  LaneStreams(const LaneStreams&) = delete;
  LaneStreams& operator=(const LaneStreams&) = delete;

  // Lane 0 runs on `stream0` (borrowed); lanes 1 .. lanes-1 get streams of their own. Call with
  // `device` current. device -1: host memory, no streams.
  Status create(int device, void* stream0, int lanes);
  Status destroy();

  void* stream(int lane) const { return streams_.empty() ? nullptr : streams_[lane]; }
  // Lanes 1.. start after everything enqueued on lane 0 so far.
  Status fork();
  // Lane 0 continues after everything enqueued on every lane so far.
  Status join();
  // Whether lane 0 is being captured into a CUDA graph.
  Status capturing(bool* out) const;
  // Stream-ordered memory on lane 0 (a captured graph's own: cudaMallocAsync / cudaFreeAsync).
  Status allocateOnStream(size_t bytes, void** out);
  Status freeOnStream(void* memory);
  // Waits on the host until every lane's work is done (close()).
  Status synchronize();

 private:
  std::vector<void*> streams_;  // [0] borrowed, [1..] owned
  std::vector<void*> events_;   // [0] the fork event, [l] lane l's join event
};

// The id of the CUDA graph capture `stream` takes part in, or 0 when it is not capturing (always
// 0 in a CPU-only build). The Python layer tells a Work made inside a capture from one outside.
Status streamCaptureId(void* stream, unsigned long long* id);

}  // namespace dk
