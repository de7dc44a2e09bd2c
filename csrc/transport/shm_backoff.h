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

class Backoff {
 public:
  explicit Backoff(bool oversubscribed) : oversubscribed_(oversubscribed) {}
  // One step of waiting for `word` to change from `seen` (the value the caller just found
  // not ready). Past the spin and yield phases the waiter sleeps on a futex: it registers in
  // `sleepers`, and the writer of `word` wakes it (see wakeSleepers()).
  void pause(const std::atomic<uint64_t>& word, uint64_t seen, std::atomic<uint32_t>& sleepers);
  // True on the steps where the caller should also check deadline and peer liveness
  // (a clock read and a trylock are cheap, but not free enough for every spin).
  bool shouldCheck() const { return (step_ & 255) == 0 || step_ > spinSteps(); }
  // Past the spin phase: the wait is slow enough that a system call costs nothing.
  bool sleeping() const { return step_ > spinSteps(); }

 private:
  uint32_t spinSteps() const;
  uint32_t yieldSteps() const;
  bool oversubscribed_;
  uint32_t step_ = 0;
};

// Called by the writer after storing a new value into `word` (seq_cst): wakes the sleepers.
void wakeSleepers(const std::atomic<uint64_t>& word, const std::atomic<uint32_t>& sleepers);

}  // namespace dk::shm
