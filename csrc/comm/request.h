// Request: one call on a CPU communicator (what the bindings build and the queue carries).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "algorithm/collective.h"
#include "comm/flight_recorder.h"
#include "transport/shm_layout.h"

namespace dk {

struct Request {
  shm::CollectiveKind kind = shm::CollectiveKind::kAllReduce;
  algo::Algorithm algorithm = algo::Algorithm::kAuto;
  algo::CollectiveArgs args;
  bool isSend = false;  // kSendRecv: send (else receive)
  // kSendRecv: torch's tag, carried in the message header (MessageHeader::op); a receive takes
  // the oldest message from its source with its tag (TaggedReceiver).
  int32_t tag = 0;
  // A receive from any source: the sender's rank is written here before the request
  // completes (null: a receive from args.root).
  std::shared_ptr<int> source;
  // kAllToAll: elements for / from each rank, blocks back to back in src / dst.
  std::vector<size_t> sendCounts, recvCounts;
  // A synchronous call on the thread Python delivers signals to: Ctrl-C ends its waits.
  bool interruptible = false;
  // The flight recorder's handle of this call (0: not recorded) and, when the recorder
  // captures stacks, the Python stack of the call site.
  uint64_t traceId = 0;
  TraceFrames frames;
};

// "all_reduce", "send", "recv", ...: the name users call it by, for errors.
const char* requestName(const Request& request);

}  // namespace dk
