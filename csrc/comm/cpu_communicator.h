// The CPU communicator of one host: owns the shared-memory transport, the CPU compute and a
// progress thread, and runs collectives through the algorithms of csrc/algorithm/.
//
// Ordering: asynchronous collectives run on the progress thread in the order issued; a
// synchronous one first waits for the queue to drain, then runs inline on the caller's thread
// (no thread handoff: ~2 us less per call). Either way collectives execute one at a time, in
// issue order, which is what makes every rank's message sequence identical.
//
// Failure: the first failed collective poisons the communicator (every later call fails at
// once with the same cause) and the shared segment (every peer's waits stop).
#pragma once

#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "algorithm/collective.h"
#include "algorithm/cpu_compute.h"
#include "comm/work.h"
#include "transport/shm_transport.h"

namespace dk {

struct Request {
  shm::CollectiveKind kind = shm::CollectiveKind::kAllReduce;
  algo::Algorithm algorithm = algo::Algorithm::kAuto;
  algo::CollectiveArgs args;
  bool isSend = false;  // kSendRecv: send (else receive)
};

const char* requestName(const Request& request);

class CpuCommunicator {
 public:
  struct Options {
    double timeoutSec = 1800.0;
    bool oversubscribed = false;
    bool debug = false;  // DK_DEBUG: fingerprint every collective before it runs
  };
  static Status create(std::shared_ptr<shm::Segment> segment, int rank, Options options,
                       std::unique_ptr<CpuCommunicator>* out);
  ~CpuCommunicator();

  int rank() const { return transport_->rank(); }
  int worldSize() const { return transport_->worldSize(); }
  // The algorithm "auto" resolves to for an all-reduce of `bytes` (same on every rank).
  algo::Algorithm resolve(const Request& request) const;

  Status run(Request request);
  Status submit(Request request, std::shared_ptr<Work>* work);
  Status registerBuffer(uint32_t id, std::shared_ptr<shm::Segment> local,
                        std::vector<std::shared_ptr<shm::Segment>> peers);
  Status close();

 private:
  explicit CpuCommunicator(std::unique_ptr<shm::ShmTransport> transport, Options options);
  void progressLoop(std::promise<Status>* started);
  void drain();
  Status execute(const Request& request);
  Status dispatch(const Request& request);
  Status fingerprint(const shm::MessageHeader& header);
  shm::MessageHeader headerOf(const Request& request) const;

  std::unique_ptr<shm::ShmTransport> transport_;
  CpuCompute compute_;
  Options options_;
  std::vector<char> scratch_;

  std::mutex queueMutex_;
  std::condition_variable queueChanged_;
  std::deque<std::pair<Request, std::shared_ptr<Work>>> queue_;
  bool busy_ = false;
  bool stopping_ = false;
  std::thread progress_;

  std::mutex execMutex_;  // one collective at a time on the transport
  Status failed_;         // guarded by execMutex_
  bool closed_ = false;
};

}  // namespace dk
