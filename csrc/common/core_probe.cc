// The cross-CPU round trip (see core_probe.h).
#include "common/core_probe.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DK_CPU_RELAX() _mm_pause()
#else
#define DK_CPU_RELAX() ((void)0)
#endif

namespace dk::probe {

namespace {

using Clock = std::chrono::steady_clock;

// The counter both threads pass back and forth: odd values are the ping, even the pong.
struct alignas(64) Line {
  std::atomic<uint64_t> value{0};
  std::atomic<bool> failed{false};
};

Status pinTo(int cpu) {
  if (cpu < 0 || cpu >= CPU_SETSIZE) {
    return InvalidArgument("cross-CPU probe: cannot run on CPU " + std::to_string(cpu) +
                           ": not a CPU number (0 to " + std::to_string(CPU_SETSIZE - 1) + ")");
  }
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  const int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  if (rc != 0) {
    return InvalidArgument("cross-CPU probe: cannot run on CPU " + std::to_string(cpu) + ": " +
                           std::strerror(rc));
  }
  return Status::Ok();
}

// Spins until `line` holds `want`; false after a second (the other thread is not running).
bool waitFor(Line& line, uint64_t want) {
  const auto deadline = Clock::now() + std::chrono::seconds(1);
  for (uint32_t spins = 0; line.value.load(std::memory_order_acquire) != want; ++spins) {
    if (line.failed.load(std::memory_order_relaxed)) return false;
    DK_CPU_RELAX();
    if ((spins & 1023) == 0 && Clock::now() > deadline) {
      line.failed.store(true, std::memory_order_relaxed);
      return false;
    }
  }
  return true;
}

}  // namespace

Status crossCoreRoundTripNs(int cpuA, int cpuB, int iterations, int batches, double* ns) {
  if (iterations < 1 || batches < 1) {
    return InvalidArgument("cross-CPU probe: iterations and batches must be positive");
  }
  // Two threads of their own: pinning the caller would leave it on one CPU for good.
  Line line;
  Status statusA = Status::Ok(), statusB = Status::Ok();
  const uint64_t total = static_cast<uint64_t>(iterations) * static_cast<uint64_t>(batches);
  std::thread answering([&] {
    statusB = pinTo(cpuB);
    if (!statusB.ok()) {
      line.failed.store(true);
      return;
    }
    for (uint64_t i = 0; i < total; ++i) {  // answer every ping
      if (!waitFor(line, 2 * i + 1)) return;
      line.value.store(2 * i + 2, std::memory_order_release);
    }
  });
  std::vector<double> means;
  std::thread pinging([&] {
    statusA = pinTo(cpuA);
    if (!statusA.ok()) {
      line.failed.store(true);
      return;
    }
    for (int b = 0; b < batches && !line.failed.load(); ++b) {
      const auto start = Clock::now();
      for (int i = 0; i < iterations; ++i) {
        const uint64_t ping = 2 * (static_cast<uint64_t>(b) * iterations + i) + 1;
        line.value.store(ping, std::memory_order_release);
        if (!waitFor(line, ping + 1)) return;
      }
      const std::chrono::duration<double, std::nano> took = Clock::now() - start;
      means.push_back(took.count() / iterations);
    }
  });
  pinging.join();
  answering.join();
  if (!statusA.ok()) return statusA;
  if (!statusB.ok()) return statusB;
  if (line.failed.load() || means.empty()) {
    return Unsupported("cross-CPU probe: a thread was not scheduled within a second (CPUs " +
                       std::to_string(cpuA) + " and " + std::to_string(cpuB) + " busy?)");
  }
  std::sort(means.begin(), means.end());
  *ns = means[means.size() / 2];
  return Status::Ok();
}

}  // namespace dk::probe
