#include "comm/flight_recorder.h"

#include <time.h>

#include <algorithm>

#include "common/debug_wakeup.h"

namespace dk {

const char* traceOpName(TraceOp op) {
  switch (op) {
    case TraceOp::kAllReduce:
      return "all_reduce";
    case TraceOp::kReduceScatter:
      return "reduce_scatter";
    case TraceOp::kAllGather:
      return "all_gather";
    case TraceOp::kBroadcast:
      return "broadcast";
    case TraceOp::kAllToAll:
      return "all_to_all";
    case TraceOp::kBarrier:
      return "barrier";
    case TraceOp::kSend:
      return "send";
    case TraceOp::kRecv:
      return "recv";
  }
  return "unknown";
}

const char* traceStateName(TraceState state) {
  switch (state) {
    case TraceState::kScheduled:
      return "scheduled";
    case TraceState::kStarted:
      return "started";
    case TraceState::kCompleted:
      return "completed";
  }
  return "unknown";
}

FlightRecorder::FlightRecorder(size_t capacity, bool captureStacks)
    : captureStacks_(captureStacks), ring_(std::max<size_t>(capacity, 1)) {}

// The vDSO clock: ~20 ns, no system call.
int64_t FlightRecorder::nowNs() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

uint64_t FlightRecorder::schedule(TraceCall call) {
  const int64_t now = nowNs();
  const bool p2p = isPointToPoint(call.op);
  std::lock_guard<std::mutex> lock(mutex_);
  TraceFootprint& f = footprint_;
  const uint64_t opId = ++f.calls;
  TraceEntry& e = ring_[(opId - 1) % ring_.size()];
  e.call = std::move(call);
  e.collectiveSeq = p2p ? f.lastScheduled : ++f.lastScheduled;
  e.p2pSeq = p2p ? ++f.lastP2pScheduled : f.lastP2pScheduled;
  e.opId = opId;
  e.state = TraceState::kScheduled;
  e.createdNs = now;
  e.startedNs = e.completedNs = 0;
  size_ = std::min(size_ + 1, ring_.size());
  return opId;
}

TraceEntry* FlightRecorder::find(uint64_t opId) {
  TraceEntry& e = ring_[(opId - 1) % ring_.size()];
  return e.opId == opId ? &e : nullptr;
}

void FlightRecorder::started(uint64_t opId, int algorithm) {
  const int64_t now = nowNs();
  std::lock_guard<std::mutex> lock(mutex_);
  TraceEntry* e = find(opId);
  if (e == nullptr) return;  // pushed out of the ring while it waited
  e->state = TraceState::kStarted;
  e->startedNs = now;
  e->call.algorithm = algorithm;
  if (!isPointToPoint(e->call.op)) footprint_.lastStarted = e->collectiveSeq;
}

void FlightRecorder::completed(uint64_t opId) {
  const int64_t now = nowNs();
  std::lock_guard<std::mutex> lock(mutex_);
  TraceEntry* e = find(opId);
  if (e == nullptr) return;
  e->state = TraceState::kCompleted;
  e->completedNs = now;
  // Sends and receives run on two lanes and may finish out of order: the highest counts.
  if (isPointToPoint(e->call.op)) {
    footprint_.lastP2pCompleted = std::max(footprint_.lastP2pCompleted, e->p2pSeq);
  } else {
    footprint_.lastCompleted = e->collectiveSeq;
  }
}

void FlightRecorder::failed(uint64_t opId, const std::string& cause) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (footprint_.failedOpId != 0) return;
    footprint_.failedOpId = opId;
    footprint_.failedNs = nowNs();
    failureCause_ = cause;
  }
  debug_wakeup::notify(debug_wakeup::kFailure);
}

std::vector<TraceEntry> FlightRecorder::snapshot(size_t newest) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const size_t count = std::min(size_, newest);
  std::vector<TraceEntry> out;
  out.reserve(count);
  const uint64_t last = footprint_.calls;
  for (uint64_t opId = last - count + 1; opId <= last; ++opId) {
    out.push_back(ring_[(opId - 1) % ring_.size()]);
  }
  return out;
}

TraceFootprint FlightRecorder::footprint() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return footprint_;
}

std::string FlightRecorder::failureCause() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failureCause_;
}

size_t FlightRecorder::capacity() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ring_.size();
}

void FlightRecorder::setCapacity(size_t capacity) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<TraceEntry> ring(std::max<size_t>(capacity, 1));
  const size_t keep = std::min(size_, ring.size());
  const uint64_t last = footprint_.calls;
  for (uint64_t opId = last - keep + 1; opId <= last; ++opId) {
    ring[(opId - 1) % ring.size()] = std::move(ring_[(opId - 1) % ring_.size()]);
  }
  ring_ = std::move(ring);
  size_ = keep;
}

uint64_t FlightRecorder::nextSeq(bool pointToPoint) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return (pointToPoint ? footprint_.lastP2pScheduled : footprint_.lastScheduled) + 1;
}

}  // namespace dk
