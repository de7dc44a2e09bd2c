// Persistent worker threads behind cpuPoolRun (see cpu_thread_pool.h).
#include "kernels/cpu_thread_pool.h"

#include "kernels/cpu_openmp.h"

#include <immintrin.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace dk::kernels {

namespace {

// How long a worker stays awake after a job, and the caller spins for the last parts, before
// sleeping. Long enough to span the Python between two kernel calls of one optimizer step or
// a loop of ops (a few to tens of microseconds), short enough that an idle pool gives its cores
// back at once (OpenMP's default keeps them for 200 ms, KMP_BLOCKTIME).
constexpr auto kSpin = std::chrono::microseconds(100);

// Spins (with the CPU's pause hint) until ready() or kSpin has passed; returns ready().
template <typename Ready>
bool spinUntil(Ready ready) {
  const auto until = std::chrono::steady_clock::now() + kSpin;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (ready()) return true;
      _mm_pause();
    }
    if (std::chrono::steady_clock::now() >= until) return ready();
  }
}

// Work sharing: a job is split into more parts than threads, and the caller and the workers
// take parts from one atomic counter; the caller returns once every part has finished, without
// waiting for workers that never took one. A worker the OS has not scheduled (the machine is
// shared) then costs nothing: the caller takes its parts. Measured on the shared 2-core VM under
// load (load average 8-20): a static one-slice-per-thread split made a 16 MiB fp32 sum 2.4x
// slower than serial, and waiting for every woken worker to check in gave a median of 2.6 GB/s
// for a 4 MiB bf16 sum against 22.7 GB/s serial.
//
// Waking: a worker that finishes a job spins on the job counter for kSpinNs before it sleeps
// on the condition variable, as OpenMP's workers do (GOMP_SPINCOUNT, KMP_BLOCKTIME), so back-
// to-back calls find it awake: waking a sleeping worker (futex wake, then the scheduler) cost
// more than a 4 MiB reduce saves by splitting (0.59x torch at 4 MiB, issue 28). The caller
// likewise spins on the finished-part count before it sleeps.
class ThreadPool {
 public:
  explicit ThreadPool(int threads) : threads_(threads) {
    for (int worker = 1; worker < threads_; ++worker) {
      std::thread([this] { workerLoop(); }).detach();
    }
  }
  int threads() const { return threads_; }

  // Returns false (running nothing) if another caller holds the pool.
  bool tryRun(int parts, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> job_lock(job_mutex_, std::try_to_lock);
    if (!job_lock.owns_lock()) return false;
    auto job = std::make_shared<Job>(&fn, parts);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = job;
      generation_.fetch_add(1, std::memory_order_seq_cst);
    }
    // A worker registers as a sleeper under mutex_ and then re-checks the generation, so one
    // that sleeps has either been counted here or sees the new job before it sleeps.
    if (sleepers_.load(std::memory_order_seq_cst) > 0) wake_.notify_all();
    job->runParts();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_.reset();  // no worker joins from here on
    }
    job->waitAllDone();
    return true;
  }

 private:
  // Invariant: fn runs only for parts taken while next < parts, and the caller returns only
  // after all `parts` have finished, so fn (the caller's) is never called after it returns. A
  // late worker may still hold the Job (shared ownership) but finds no part left to take.
  struct Job {
    Job(const std::function<void(int)>* f, int n) : fn(f), parts(n) {}
    const std::function<void(int)>* fn;
    const int parts;
    std::atomic<int> next{0};
    std::atomic<int> done{0};
    std::atomic<bool> caller_sleeps{false};
    std::mutex mutex;
    std::condition_variable all_done;

    void runParts() {
      for (int part = next.fetch_add(1); part < parts; part = next.fetch_add(1)) {
        (*fn)(part);
        if (done.fetch_add(1, std::memory_order_seq_cst) + 1 == parts &&
            caller_sleeps.load(std::memory_order_seq_cst)) {
          std::lock_guard<std::mutex> lock(mutex);
          all_done.notify_all();
        }
      }
    }
    void waitAllDone() {
      if (spinUntil([this] { return done.load(std::memory_order_acquire) == parts; })) return;
      std::unique_lock<std::mutex> lock(mutex);
      caller_sleeps.store(true, std::memory_order_seq_cst);  // then `done` is read again
      all_done.wait(lock, [this] { return done.load() == parts; });
    }
  };

  // Workers live for the process (joining them at interpreter exit could deadlock), so the loop
  // has no exit.
  void workerLoop() {
    uint64_t seen = 0;
    for (;;) {
      spinUntil([&] { return generation_.load(std::memory_order_acquire) != seen; });
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, [&] { return generation_.load() != seen && job_ != nullptr; });
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        seen = generation_.load();
        job = job_;
      }
      job->runParts();
    }
  }

  const int threads_;
  std::mutex job_mutex_;  // held by the caller for a whole job
  std::mutex mutex_;      // guards job_; generation_ changes under it
  std::condition_variable wake_;
  std::shared_ptr<Job> job_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleepers_{0};  // workers waiting (or about to wait) on wake_
};

// DK_NUM_THREADS, else OMP_NUM_THREADS as torch reads it (torchrun sets it to 1 when it starts
// several ranks per host, so each rank's pool must not take every core), else the core count.
int configuredThreads() {
  for (const char* name : {"DK_NUM_THREADS", "OMP_NUM_THREADS"}) {
    const char* env = std::getenv(name);
    if (env != nullptr && std::atoi(env) >= 1) return std::atoi(env);
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

// The pool of this process; a child after fork() builds its own (the parent's is leaked there:
// its threads were not copied, and its mutexes may be held).
ThreadPool& processPool() {
  static std::mutex mutex;
  static ThreadPool* pool = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(mutex);
  if (pool == nullptr || owner != getpid()) {
    pool = new ThreadPool(configuredThreads());
    owner = getpid();
  }
  return *pool;
}

// DK_NUM_THREADS if set (read once), else on the OpenMP runtime its team size, which follows
// OMP_NUM_THREADS and torch.set_num_threads as torch's own ops do, else configuredThreads().
int callThreads() {
  static const int fixed = [] {
    const char* env = std::getenv("DK_NUM_THREADS");
    return env != nullptr && std::atoi(env) >= 1 ? std::atoi(env) : 0;
  }();
  if (fixed != 0) return fixed;
  const int team = openmpThreads();
  return team >= 1 ? team : processPool().threads();
}

constexpr size_t kCacheLine = 64;
// Our pool: enough parts that a descheduled thread's share is small, few enough that taking a
// part (one atomic add) stays negligible against a part's work. On the OpenMP runtime one part
// per thread, as torch's own ops split: an fp32 sum ran at 0.70-0.76 / 0.80-0.81 / 0.92-0.97x
// torch's add_ at 256 KiB / 512 KiB / 1 MiB with 1 part per thread, 0.61-0.71 / 0.70-0.72 /
// 0.80-0.81x with 8 (quiet 2-core EPYC VM, 2026-12-04, two rounds each).
constexpr size_t kPartsPerThread = 8;

}  // namespace

int cpuPoolThreads() { return callThreads(); }

// The process's OpenMP runtime first (cpu_openmp.h: torch's threads, shared rather than fought
// for the cores), our own pool where there is none.
void cpuPoolRun(int parts, const std::function<void(int)>& fn) {
  const int threads = parts > 1 ? callThreads() : 1;
  if (threads > 1 && openmpRun(threads, parts, fn)) return;
  if (parts <= 1 || !processPool().tryRun(parts, fn)) {
    for (int part = 0; part < parts; ++part) fn(part);
  }
}

Status cpuParallelSlices(size_t count, size_t dst_element_bytes, bool split,
                         const std::function<Status(size_t, size_t)>& slice) {
  const int threads = split ? cpuPoolThreads() : 1;
  if (threads <= 1) return slice(0, count);
  // parts_per_thread parts per thread, each a multiple of one cache line of the destination.
  const size_t line = dst_element_bytes >= kCacheLine ? 1 : kCacheLine / dst_element_bytes;
  const size_t parts_per_thread = openmpActive() ? 1 : kPartsPerThread;
  const size_t per_part = (count + threads * parts_per_thread - 1) / (threads * parts_per_thread);
  const size_t length = (per_part + line - 1) / line * line;
  const int parts = static_cast<int>((count + length - 1) / length);
  std::vector<Status> results(parts);
  cpuPoolRun(parts, [&](int part) {
    const size_t begin = part * length;
    const size_t end = begin + length < count ? begin + length : count;
    results[part] = slice(begin, end);
  });
  for (const Status& status : results) DK_RETURN_IF_ERROR(status);
  return Status::Ok();
}

}  // namespace dk::kernels
