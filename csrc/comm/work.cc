#include "comm/work.h"

#include <chrono>
#include <cstdio>

#include "common/interrupt.h"

namespace dk {

bool Work::isCompleted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_;
}

Status Work::wait(double timeoutSec, bool interruptible) const {
  using Clock = std::chrono::steady_clock;
  std::unique_lock<std::mutex> lock(mutex_);
  if (completed_) return status_;
  const bool bounded = timeoutSec >= 0;
  const Clock::time_point deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(bounded ? timeoutSec : 0.0));
  if (interruptible) interrupt::armSigint();
  const uint64_t sigints = interrupt::sigintCount();
  // Interruptible: wake every 20 ms to look at the SIGINT count (well inside the 0.5 s a
  // Ctrl-C may take); a plain wait sleeps until completion or the deadline.
  while (!completed_) {
    if (interruptible && interrupt::sigintCount() != sigints) {
      return Status(Code::kInterrupted, "interrupted (SIGINT) in Work.wait");
    }
    const Clock::time_point now = Clock::now();
    if (bounded && now >= deadline) {
      char buf[96];
      std::snprintf(buf, sizeof(buf), "Work.wait timed out after %.1f s (still running)",
                    timeoutSec);
      return Status(Code::kTimeout, buf);
    }
    if (!interruptible && !bounded) {
      done_.wait(lock);
      continue;
    }
    Clock::time_point until = interruptible ? now + std::chrono::milliseconds(20) : deadline;
    if (bounded && deadline < until) until = deadline;
    done_.wait_until(lock, until);
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
