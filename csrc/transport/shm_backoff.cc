#include "transport/shm_backoff.h"

#include <errno.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

namespace dk::shm {

namespace {
// One _mm_pause takes 11-20 ns on the 2-core Sapphire Rapids VM, so 512 pauses spin for
// ~6-10 us: longer than a small all-reduce's handoff (~1 us), so back-to-back collectives stay
// in the spin phase while each rank has a core, and short, because a rank sharing its core
// with the peer it waits for (other load on the machine) only wastes that time: it then sleeps
// (oversubscribed: yields first, below). 2048 spins (the value before 2026-12-01) cost 60-120 us
// per small all-reduce on the loaded EPYC VM; 512 + 1024 yields gave 1.2-1.6 us from 8 B to 8 KiB
// there (load 5.5).
constexpr uint32_t kSpinSteps = 512;
// Oversubscribed: spin only ~3 us before giving the core to the rank we wait for.
constexpr uint32_t kSpinStepsOversubscribed = 64;
// Yield steps before sleeping, oversubscribed only: there the rank sharing our core is most
// likely a peer rank, and a yield hands it the core for the price of a context switch. With a
// core per rank the one sharing our core is someone else's process, and a yield gives it the
// rest of its slice (EEVDF: ~1.5 ms on 2 cpus) while the peer's write goes unnoticed: with one
// busy nice-0 process per core, spin + 1024 yields took 1.5-6.3 ms per small all-reduce on
// average (p99 10-20 ms), spin + futex 38-84 us (p99 0.1-2 ms; 2026-12-02, 2-core VM at load
// ~10, benchmarks/results/2026-12-02-wait-strategy-loaded.md). A futex sleep also lets the
// scheduler place the waiter again when it wakes, where a yielding waiter stays runnable on its
// core: two ranks that a Gloo call left on one core part at the next wake-up (the suspected cause
// of the slow rows beside Gloo's threads, issue 28; not yet confirmed on an idle machine). 1024
// yields last ~0.5-1 ms when the core is free.
constexpr uint32_t kYieldSteps = 1024;
// A futex sleep ends on the writer's wake; the timeout only bounds how late the waiter
// notices a dead peer, an abort or its deadline.
constexpr long kSleepNs = 2000000;

// Set once a futex call fails for a reason other than the expected ones (a changed word, a
// timeout, a signal): every waiter then yields instead of sleeping. A wait only gets slower
// that way, never wrong or stuck: callers re-check their word and deadline after each pause.
std::atomic<bool> futexUnusable{false};

bool unexpectedFutexError(long rc) {
  return rc < 0 && errno != EAGAIN && errno != ETIMEDOUT && errno != EINTR;
}

// The futex word is the low half of the 64-bit counter (x86-64 is little-endian).
const uint32_t* lowWord(const std::atomic<uint64_t>& word) {
  static_assert(sizeof(std::atomic<uint64_t>) == 8, "plain 64-bit counter");
  return reinterpret_cast<const uint32_t*>(&word);
}

// The adaptive spin's range: from kSpinSteps (~6-10 us) up to ~16k pauses (~200-330 us),
// which on the 2-core EPYC VM with one busy process per core turned most 8 B-8 KiB
// all-reduces from 40-50 us into 2-6 us (p50; 2026-12-02, benchmarks/results/
// 2026-12-02-epyc-wait-spin.md). A sleep that ended within kCatchNs would have been caught by
// the longest spin. DK_SHM_SPIN_STEPS fixes the spin instead (measurements).
constexpr uint32_t kMaxSpinSteps = 16384;
constexpr int64_t kCatchNs = 300000;

int64_t monotonicNs() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);  // cannot fail for CLOCK_MONOTONIC with a valid pointer
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// DK_SHM_SPIN_STEPS, read once; 0 when unset (adaptive).
uint32_t fixedSpinFromEnv() {
  static const uint32_t steps = [] {
    const char* env = std::getenv("DK_SHM_SPIN_STEPS");
    if (env == nullptr || env[0] == '\0') return uint32_t{0};
    return static_cast<uint32_t>(std::strtoul(env, nullptr, 10));
  }();
  return steps;
}
}  // namespace

SpinBudget::SpinBudget() : steps_(kSpinSteps) {}

void SpinBudget::afterSleep(int64_t sleptNs) {
  if (fixedSpinFromEnv() != 0) return;
  const uint32_t now = steps_.load(std::memory_order_relaxed);
  const uint32_t next =
      sleptNs < kCatchNs ? std::min(kMaxSpinSteps, now * 2) : std::max(kSpinSteps, now / 2);
  steps_.store(next, std::memory_order_relaxed);
}

uint32_t Backoff::fixedSpinSteps(bool oversubscribed) {
  if (oversubscribed) return kSpinStepsOversubscribed;
  const uint32_t fixed = fixedSpinFromEnv();
  return fixed != 0 ? fixed : kSpinSteps;
}

Backoff::~Backoff() {
  if (budget_ != nullptr && sleptSinceNs_ >= 0) budget_->afterSleep(monotonicNs() - sleptSinceNs_);
}

uint32_t Backoff::yieldSteps() const { return oversubscribed_ ? kYieldSteps : 0; }

void Backoff::pause(const std::atomic<uint64_t>& word, uint64_t seen,
                    std::atomic<uint32_t>& sleepers) {
  const uint32_t spin = spinSteps();
  ++step_;
  if (step_ <= spin) {
    _mm_pause();
    return;
  }
  if (step_ <= spin + yieldSteps() || futexUnusable.load(std::memory_order_relaxed)) {
    sched_yield();  // cannot fail on Linux (sched_yield(2))
    return;
  }
  if (sleptSinceNs_ < 0) sleptSinceNs_ = monotonicNs();
  // Dekker with the writer: we register, then the kernel re-reads the word; the writer
  // stores the word, then reads `sleepers`. One of the two sees the other.
  sleepers.fetch_add(1, std::memory_order_seq_cst);
  struct timespec timeout = {0, kSleepNs};
  const long rc = syscall(SYS_futex, lowWord(word), FUTEX_WAIT, static_cast<uint32_t>(seen),
                          &timeout, nullptr, 0);
  sleepers.fetch_sub(1, std::memory_order_seq_cst);
  if (unexpectedFutexError(rc)) futexUnusable.store(true, std::memory_order_relaxed);
}

void wakeSleepers(const std::atomic<uint64_t>& word, const std::atomic<uint32_t>& sleepers) {
  if (sleepers.load(std::memory_order_seq_cst) == 0) return;
  const long rc = syscall(SYS_futex, lowWord(word), FUTEX_WAKE, 0x7fffffff, nullptr, nullptr, 0);
  // A failed wake leaves a sleeper to its 2 ms timeout; from then on nobody sleeps.
  if (unexpectedFutexError(rc)) futexUnusable.store(true, std::memory_order_relaxed);
}

}  // namespace dk::shm
