#include "transport/shm_backoff.h"

#include <immintrin.h>
#include <sched.h>
#include <time.h>

#include <algorithm>

namespace dk::shm {

namespace {
// Measured on the 2-core Sapphire Rapids VM (tools: the latency loop in docs/architecture.md):
// one _mm_pause is ~40 ns there, so 8192 pauses spin for ~300 us, longer than a 64 KiB
// all-reduce step, so back-to-back collectives never reach the yield phase when each rank
// has its own core.
constexpr uint32_t kSpinSteps = 8192;
// Oversubscribed: spin only ~3 us before yielding the core to the rank we wait for.
constexpr uint32_t kSpinStepsOversubscribed = 64;
// Yield steps before sleeping: a yield returns at once when nobody else wants the core.
constexpr uint32_t kYieldSteps = 2000;
// Sleeps grow from 5 us to 200 us: long enough to free the core, short against any timeout.
constexpr long kMinSleepNs = 5000;
constexpr long kMaxSleepNs = 200000;
}  // namespace

uint32_t Backoff::spinSteps() const {
  return oversubscribed_ ? kSpinStepsOversubscribed : kSpinSteps;
}

void Backoff::pause() {
  const uint32_t spin = spinSteps();
  ++step_;
  if (step_ <= spin) {
    _mm_pause();
  } else if (step_ <= spin + kYieldSteps) {
    sched_yield();
  } else {
    const uint32_t sleeps = step_ - spin - kYieldSteps;
    const long ns = std::min(kMaxSleepNs, kMinSleepNs * static_cast<long>(std::min(sleeps, 64u)));
    struct timespec ts = {0, ns};
    nanosleep(&ts, nullptr);
  }
}

}  // namespace dk::shm
