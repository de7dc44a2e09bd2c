// The CPU communicator of one host: owns the shared-memory transport, the CPU compute and the
// queue of asynchronous operations, and runs collectives through the algorithms of
// csrc/algorithm/.
//
// Ordering: asynchronous operations start in issue order (OpQueue); a synchronous one first
// waits until no queued operation uses its lanes, then runs inline on the caller's thread (no
// thread handoff: ~2 us less per call). Collectives execute one at a time, in issue order,
// which is what makes every rank's message sequence identical.
//
// Lanes: a send and a receive may run at the same time on two threads (each holds one lane of
// the transport; a collective holds both), so a receive waiting for its peer does not hold up
// a send, synchronous or queued. Two sends (or two receives) run one after the other.
//
// close() lets queued operations finish, then cancels the waits of synchronous calls still
// running on other threads (they fail, which poisons the segment like any failure) and
// returns once they have left.
//
// Disagreement: every collective carries a descriptor (kind, count, dtype, op, root, its
// sequence number) in each message and in the rank's announcement (ShmTransport::announce),
// so ranks that called different things all fail with CommError, in the default mode.
//
// Failure: the first failed call poisons the communicator (every later call fails at once
// with the same cause) and the shared segment (every peer's waits stop).
//
// Flight recorder (optional): every call is scheduled in it when issued, started once it holds
// its lanes and its algorithm is resolved, completed when it returns without error.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "algorithm/collective.h"
#include "algorithm/cpu_compute.h"
#include "algorithm/select.h"
#include "comm/flight_recorder.h"
#include "comm/op_queue.h"
#include "comm/request.h"
#include "comm/tagged_receive.h"
#include "comm/work.h"
#include "transport/shm_transport.h"

namespace dk {

class CpuCommunicator {
 public:
  struct Options {
    double timeoutSec = 1800.0;
    bool oversubscribed = false;
    bool debug = false;            // DK_DEBUG: fingerprint every collective before it runs
    bool checkDescriptors = true;  // see ShmTransport::setDescriptorChecks
    std::shared_ptr<FlightRecorder> recorder;  // null: calls are not recorded
    // Fitted models for algorithm="auto" (python -m dist_kernels.bench --calibrate); none:
    // the built-in one, algo::shmCostModel(oversubscribed), for every algorithm.
    std::optional<algo::AlgorithmCosts> fitted;
  };
  static Status create(std::shared_ptr<shm::Segment> segment, int rank, Options options,
                       std::unique_ptr<CpuCommunicator>* out);
  ~CpuCommunicator();

  int rank() const { return transport_->rank(); }
  int worldSize() const { return transport_->worldSize(); }
  // The algorithm a request runs: what it asked for, or what "auto" picks (the same on every
  // rank: the cost model's inputs are).
  algo::Algorithm resolve(const Request& request) const;

  // Which transport lanes a request holds (see above).
  static shm::Lane laneOf(const Request& request);

  // The timeout of calls started from now on (torch's ProcessGroup.set_timeout).
  void setTimeout(double seconds) { timeoutSec_.store(seconds, std::memory_order_relaxed); }
  // Peers some rank found dead (see ShmTransport::peerDied): after a receive from any source
  // lost one (Code::kPeerLost), the caller learns here which.
  std::vector<int> deadPeers() const;

  Status run(Request request);
  Status submit(Request request, std::shared_ptr<Work>* work);
  Status registerBuffer(uint32_t id, std::shared_ptr<shm::Segment> local,
                        std::vector<std::shared_ptr<shm::Segment>> peers);
  Status close();
  // Fails the communicator on every rank with `cause` (first failure wins): Ctrl-C during a
  // Work.wait, or the interpreter exiting with calls still queued.
  void abort(const Status& cause);

 private:
  explicit CpuCommunicator(std::unique_ptr<shm::ShmTransport> transport, Options options);
  // Runs `request` holding its lanes; a synchronous call (not `queued`) fails if the
  // communicator was closed while it waited for them.
  Status executeLocked(const Request& request, bool queued);
  // `inPlace` false: sends copy registered bytes instead of publishing them (see sendAtOnce).
  Status execute(const Request& request, bool inPlace = true);
  bool sendAtOnce(const Request& request, Work& work);
  Status failure() const;
  Status dispatch(const Request& request);
  // Schedules `request` in the flight recorder (if there is one) and sets its traceId.
  void record(Request& request) const;
  TraceCall traceCallOf(const Request& request) const;
  algo::Algorithm resolveAllReduce(const Request& request) const;
  algo::Algorithm resolveGatherScatter(const Request& request) const;
  algo::AlgorithmCosts costModels() const;
  bool fitsSmallBoxes(size_t bytes) const;
  bool boxedBroadcast(const Request& request) const;
  // Within the deadline of the collective it checks.
  Status fingerprint(const shm::MessageHeader& header,
                     std::chrono::steady_clock::time_point deadline);
  shm::MessageHeader headerOf(const Request& request) const;
  static bool needsAgreement(const Request& request);

  std::unique_ptr<shm::ShmTransport> transport_;
  CpuCompute compute_;
  Options options_;
  std::atomic<double> timeoutSec_;  // options_.timeoutSec until setTimeout()
  std::vector<char> scratch_;
  TaggedReceiver tagged_;       // messages received ahead of their tag's receive; receive lane only
  uint64_t collectiveSeq_ = 0;  // collectives started; changed with both lanes held

  OpQueue queue_;
  std::mutex sendLane_;  // one call at a time per transport lane; collectives take both
  std::mutex recvLane_;
  mutable std::mutex failedMutex_;
  Status failed_;  // guarded by failedMutex_: the first failure, reported by every later call
  std::atomic<bool> closed_{false};
};

}  // namespace dk
