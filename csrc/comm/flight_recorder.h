// FlightRecorder: the last N calls of one communicator, with their state, for post-mortems.
//
// The idea and the vocabulary are torch's Flight Recorder (TORCH_NCCL_TRACE_BUFFER_SIZE): each
// call gets an entry when it is scheduled (issued by the caller), is marked started when it
// holds the transport and its algorithm runs, and completed when it has returned successfully.
// A call that fails stays "started"; one that never ran stays "scheduled". Python
// (dist_kernels/debug/flight_recorder.py) turns a snapshot into torch's dump format, which
// torch's analyzer (torchfrtrace) reads unchanged.
//
// Numbering, as torch's: op ids count this communicator's calls; collective and point-to-point
// calls have their own 1-based sequence numbers (an entry of one kind carries the other kind's
// current count, as torch's entries do). All of them are per communicator, so the members of a
// group number the same calls alike whatever else each rank did (the dump's record_id is the
// op id: dist_kernels/debug/flight_recorder.py says why). The footprint (last scheduled /
// started / completed sequence numbers) is what the desync report compares between ranks.
//
// Cost: three clock reads and three uncontended mutex sections per call (the benchmark
// benchmarks/bench_recorder.py prints it; the budget is 0.2 us). A snapshot copies the ring
// under the same mutex, so a dump taken while calls run is consistent entry by entry.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace dk {

enum class TraceOp : uint8_t {
  kAllReduce,
  kReduceScatter,
  kAllGather,
  kBroadcast,
  kAllToAll,
  kBarrier,
  kSend,
  kRecv,
};

// torch's names for the call ("all_reduce", "send", ...): the analyzer knows these.
const char* traceOpName(TraceOp op);
inline bool isPointToPoint(TraceOp op) { return op == TraceOp::kSend || op == TraceOp::kRecv; }

enum class TraceState : uint8_t { kScheduled, kStarted, kCompleted };
const char* traceStateName(TraceState state);

// One Python frame of the call site (DK_TRACE_PYTHON_STACK=1), innermost first.
struct TraceFrame {
  std::string name;
  std::string filename;
  int line = 0;
};
using TraceFrames = std::shared_ptr<const std::vector<TraceFrame>>;

// What a call is, as the communicator describes it when scheduling it.
struct TraceCall {
  TraceOp op = TraceOp::kAllReduce;
  int dtype = 0;          // DType code
  int redOp = -1;         // RedOp code, -1 when the call reduces nothing
  int peer = -1;          // send: destination, recv: source, broadcast: root (group ranks)
  int algorithm = 0;      // asked for; replaced by the resolved one when the call starts
  uint64_t inCount = 0;   // elements of the input (all of them: reduce-scatter's whole buffer)
  uint64_t outCount = 0;  // elements of the output
  TraceFrames frames;
};

struct TraceEntry {
  TraceCall call;
  uint64_t collectiveSeq = 0;
  uint64_t p2pSeq = 0;
  uint64_t opId = 0;  // calls scheduled on this communicator, this one included
  TraceState state = TraceState::kScheduled;
  int64_t createdNs = 0;  // CLOCK_REALTIME, as torch's time_created_ns
  int64_t startedNs = 0;  // 0 until started
  int64_t completedNs = 0;
};

struct TraceFootprint {
  uint64_t lastScheduled = 0;  // collective sequence numbers
  uint64_t lastStarted = 0;
  uint64_t lastCompleted = 0;
  uint64_t lastP2pScheduled = 0;
  uint64_t lastP2pCompleted = 0;
  uint64_t calls = 0;       // op ids handed out
  uint64_t failedOpId = 0;  // the first failed call, 0 while none failed
  int64_t failedNs = 0;
};

class FlightRecorder {
 public:
  // `capacity` entries are kept (at least 1); `captureStacks`: the bindings attach the
  // Python stack of every call (costs microseconds; off by default).
  FlightRecorder(size_t capacity, bool captureStacks);

  // Returns the call's op id, the handle of started(), completed() and failed().
  uint64_t schedule(TraceCall call);
  void started(uint64_t opId, int algorithm);
  void completed(uint64_t opId);
  // The call ended in an error: it stays started (or scheduled). The first failure's cause is
  // kept and wakes the debug monitor (common/debug_wakeup.h), which dumps and reports.
  void failed(uint64_t opId, const std::string& cause);

  // The newest `newest` kept entries (all by default), oldest first.
  std::vector<TraceEntry> snapshot(size_t newest = SIZE_MAX) const;
  TraceFootprint footprint() const;
  std::string failureCause() const;
  size_t capacity() const;
  // Keeps the newest min(size, capacity) entries (dk.debug.trace widens the window).
  void setCapacity(size_t capacity);
  bool capturesStacks() const { return captureStacks_; }
  // The sequence number the next call of this kind gets (profiler events name it).
  uint64_t nextSeq(bool pointToPoint) const;

 private:
  // The entry of `opId` if it is still kept, else nullptr (under mutex_).
  TraceEntry* find(uint64_t opId);
  static int64_t nowNs();

  const bool captureStacks_;
  mutable std::mutex mutex_;
  std::vector<TraceEntry> ring_;  // entry of op id k at (k - 1) % capacity
  size_t size_ = 0;               // entries kept
  TraceFootprint footprint_;
  std::string failureCause_;
};

}  // namespace dk
