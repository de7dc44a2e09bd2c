#include "comm/work.h"

#include <chrono>
#include <cstdio>

namespace dk {

bool Work::isCompleted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_;
}

Status Work::wait(double timeoutSec) const {
  std::unique_lock<std::mutex> lock(mutex_);
  if (timeoutSec < 0) {
    done_.wait(lock, [&] { return completed_; });
  } else if (!done_.wait_for(lock, std::chrono::duration<double>(timeoutSec),
                             [&] { return completed_; })) {
    char buf[96];
    std::snprintf(buf, sizeof(buf), "Work.wait timed out after %.1f s (still running)", timeoutSec);
    return Status(Code::kTimeout, buf);
  }
  return status_;
}

void Work::complete(Status status) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    status_ = std::move(status);
    completed_ = true;
  }
  done_.notify_all();
}

}  // namespace dk
