// Standalone CPU kernels on the process's OpenMP runtime (see cpu_openmp.h).
#include "kernels/cpu_openmp.h"

#include <dlfcn.h>
#include <pthread.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace dk::kernels {

namespace {

// libgomp's ABI (GCC >= 4.9): runs fn(data) on a team of num_threads (0: the runtime's
// default), the calling thread included, and returns when every team thread has returned.
using GompParallel = void (*)(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags);

using OmpGetMaxThreads = int (*)();

struct Runtime {
  GompParallel parallel = nullptr;
  OmpGetMaxThreads maxThreads = nullptr;  // the team size torch.set_num_threads sets
};

// Set in a fork()ed child (pthread_atfork): the parent's OpenMP threads do not exist there.
// A flag rather than a getpid() per call: glibc no longer caches the pid, and a kernel call
// asked three times (~0.1 us each on this VM).
std::atomic<bool> forked{false};

const Runtime& runtime() {
  static const Runtime found = [] {
    Runtime r;
    const char* choice = std::getenv("DK_CPU_POOL");
    if (choice != nullptr && std::strcmp(choice, "dk") == 0) return r;
    // dlsym cannot fail in a way other than "not found" (nullptr), which is an answer here.
    r.parallel = reinterpret_cast<GompParallel>(dlsym(RTLD_DEFAULT, "GOMP_parallel"));
    r.maxThreads = reinterpret_cast<OmpGetMaxThreads>(dlsym(RTLD_DEFAULT, "omp_get_max_threads"));
    if (r.maxThreads == nullptr) r.parallel = nullptr;  // a runtime we do not recognise
    // Without the fork handler a child could enter the parent's runtime: then use none.
    if (r.parallel != nullptr && pthread_atfork(nullptr, nullptr, [] {
                                   forked.store(true, std::memory_order_relaxed);
                                 }) != 0) {
      r.parallel = nullptr;
    }
    return r;
  }();
  return found;
}

// One parallel region: the team's threads take parts from one counter, so a thread the OS
// runs late takes fewer (the same work sharing as our pool's).
struct Region {
  const std::function<void(int)>* fn;
  int parts;
  std::atomic<int> next{0};
};

void runParts(void* data) {
  auto* region = static_cast<Region*>(data);
  for (int part = region->next.fetch_add(1); part < region->parts;
       part = region->next.fetch_add(1)) {
    (*region->fn)(part);
  }
}

// Set while a call's region runs: a second caller thread (two Python threads calling kernels)
// would make the runtime build a second team on the same cores.
std::atomic<bool> busy{false};

}  // namespace

bool openmpActive() {
  return runtime().parallel != nullptr && !forked.load(std::memory_order_relaxed);
}

bool openmpRun(int threads, int parts, const std::function<void(int)>& fn) {
  if (!openmpActive()) return false;
  const Runtime& rt = runtime();
  if (busy.exchange(true, std::memory_order_acquire)) {
    for (int part = 0; part < parts; ++part) fn(part);
    return true;
  }
  Region region{&fn, parts};
  rt.parallel(&runParts, &region, static_cast<unsigned>(threads), 0);
  busy.store(false, std::memory_order_release);
  return true;
}

int openmpThreads() { return openmpActive() ? runtime().maxThreads() : 0; }

const char* cpuPoolBackend() { return openmpActive() ? "openmp" : "dk"; }

}  // namespace dk::kernels
