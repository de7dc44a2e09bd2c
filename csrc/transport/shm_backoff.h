// How a rank waits for a peer over shared memory: spin, then yield, then sleep.
//
// Pure spinning is fine while every rank has a core (a handoff between two cores costs
// ~0.2 us), but when ranks outnumber cores a spinning waiter burns the time slice the rank it
// waits for needs: tests run 8 ranks on 2 cores. So a waiter spins briefly, then gives the core
// away with sched_yield when ranks outnumber cores (the rank it yields to is then likely the
// peer it waits for), then sleeps on a futex until the peer's write wakes it (a timed sleep
// would add its whole period to every step when ranks outnumber cores). With a core per rank
// it skips the yields: a yield would hand the core to whatever other process shares it for a
// whole time slice, where a futex wake brings the waiter back at once (shm_backoff.cc). An
// oversubscribed communicator (more local ranks than usable cores) also skips most of the spin.
#pragma once

#include <atomic>
#include <cstdint>

namespace dk::shm {

// How long a rank with a core of its own spins before it sleeps, adapted to the waits it
// sees (one per transport). A futex wake costs tens of microseconds on a VM (40-50 us p50 for
// an 8 B all-reduce beside one busy process per core, where spinning ~16k pauses gave 2-6 us);
// spinning that long costs the core's other threads that time whenever the peer is far
// behind (a progress thread waiting for a peer's backward while this rank computes its own).
// So: a wait that slept but ended within what the longest spin covers doubles the spin
// (spinning longer would have caught it); one that slept longer halves it.
class SpinBudget {
 public:
  SpinBudget();
  uint32_t steps() const { return steps_.load(std::memory_order_relaxed); }
  // A wait that slept, for `sleptNs` nanoseconds before its word changed.
  void afterSleep(int64_t sleptNs);

 private:
  std::atomic<uint32_t> steps_;
};

class Backoff {
 public:
  // `budget`: the spin of a rank with a core of its own (nullptr: oversubscribed).
  explicit Backoff(bool oversubscribed, SpinBudget* budget = nullptr)
      : oversubscribed_(oversubscribed),
        budget_(oversubscribed ? nullptr : budget),
        spin_(oversubscribed || budget_ == nullptr ? fixedSpinSteps(oversubscribed)
                                                   : budget_->steps()) {}
  // Reports a wait that slept to the budget.
  ~Backoff();
  Backoff(const Backoff&) = delete;
  Backoff& operator=(const Backoff&) = delete;
  // One step of waiting for `word` to change from `seen` (the value the caller just found
  // not ready). Past the spin and yield phases the waiter sleeps on a futex: it registers in
  // `sleepers`, and the writer of `word` wakes it (see wakeSleepers()).
  void pause(const std::atomic<uint64_t>& word, uint64_t seen, std::atomic<uint32_t>& sleepers);
  // True on the steps where the caller should also check deadline and peer liveness
  // (a clock read and a trylock are cheap, but not free enough for every spin). Not on the
  // first step: a small collective's waits mostly end within a few pauses, and the checks
  // (a clock read, a locked instruction on the peer's liveness line, a read of its
  // announcement) took ~0.3 us of a ~1 us 8 B all-reduce when made on every wait's first step.
  bool shouldCheck() const { return (step_ & 255) == 255 || step_ > spinSteps(); }
  // Past the spin phase: the wait is slow enough that a system call costs nothing.
  bool sleeping() const { return step_ > spinSteps(); }

 private:
  static uint32_t fixedSpinSteps(bool oversubscribed);
  uint32_t spinSteps() const { return spin_; }
  uint32_t yieldSteps() const;
  bool oversubscribed_;
  SpinBudget* budget_;
  uint32_t spin_;
  uint32_t step_ = 0;
  int64_t sleptSinceNs_ = -1;  // monotonic time of the first sleep (-1: none)
};

// Called by the writer after storing a new value into `word` (seq_cst): wakes the sleepers.
void wakeSleepers(const std::atomic<uint64_t>& word, const std::atomic<uint32_t>& sleepers);

}  // namespace dk::shm
