// Work: the handle of one queued operation; completed by the thread of OpQueue that ran it.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "common/status.h"

namespace dk {

class Work {
 public:
  bool isCompleted() const;
  // Waits up to `timeoutSec` (< 0: forever). Returns the collective's status, or kTimeout if
  // it has not finished yet (the collective keeps running; a later wait may succeed).
  // `interruptible`: a SIGINT ends the wait with Code::kInterrupted (the operation keeps
  // running; the caller fails the communicator, see onInterrupt).
  Status wait(double timeoutSec, bool interruptible = false) const;
  void complete(Status status);
  // "[rank 1] all_reduce": prefixed to errors raised by wait().
  std::string context;
  // Set by the bindings: fails the communicator the operation runs on.
  std::function<void(const Status&)> onInterrupt;
  // Set by the bindings for a receive from any source: the sender, once completed.
  std::shared_ptr<const int> source;

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable done_;
  bool completed_ = false;
  Status status_;
};

}  // namespace dk
