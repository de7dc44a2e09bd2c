// Persistent worker threads behind cpuPoolRun (see cpu_thread_pool.h).
#include "kernels/cpu_thread_pool.h"

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace dk::kernels {

namespace {

// Work sharing: a job is split into more parts than threads, and the caller and the workers
// take parts from one atomic counter. A worker the OS has not scheduled (the machine is shared)
// then costs nothing: the caller takes its parts instead of waiting for it. Measured on the
// shared 2-core VM under load (load average 8): a static one-slice-per-thread split made a
// 16 MiB fp32 sum 2.4x slower than serial; with work sharing it stays within a few percent.
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
    Job job{&fn, parts};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &job;
      ++generation_;
    }
    wake_.notify_all();
    job.runParts();
    std::unique_lock<std::mutex> lock(mutex_);
    job_ = nullptr;  // no worker joins from here on
    left_.wait(lock, [this] { return active_ == 0; });
    return true;
  }

 private:
  struct Job {
    const std::function<void(int)>* fn;
    int parts;
    std::atomic<int> next{0};
    void runParts() {
      for (int part = next.fetch_add(1); part < parts; part = next.fetch_add(1)) (*fn)(part);
    }
  };

  // Invariant: a worker touches a Job only between joining (job_ set, under mutex_) and leaving
  // (active_ decremented); the caller returns only when active_ is 0 after clearing job_, so
  // every part has finished and the Job on its stack is no longer referenced. Workers live for
  // the process (joining them at interpreter exit could deadlock), so the loop has no exit.
  void workerLoop() {
    unsigned long seen = 0;
    for (;;) {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return generation_ != seen && job_ != nullptr; });
      seen = generation_;
      Job* job = job_;
      ++active_;
      lock.unlock();
      job->runParts();
      lock.lock();
      if (--active_ == 0) left_.notify_all();
    }
  }

  const int threads_;
  std::mutex job_mutex_;  // held by the caller for a whole job
  std::mutex mutex_;      // guards job_, active_ and generation_
  std::condition_variable wake_;
  std::condition_variable left_;
  Job* job_ = nullptr;
  int active_ = 0;
  unsigned long generation_ = 0;
};

int configuredThreads() {
  const char* env = std::getenv("DK_NUM_THREADS");
  if (env != nullptr && std::atoi(env) >= 1) return std::atoi(env);
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

constexpr size_t kCacheLine = 64;
// Enough parts that a descheduled thread's share is small, few enough that taking a part (one
// atomic add) stays negligible against a part's work.
constexpr size_t kPartsPerThread = 8;

}  // namespace

int cpuPoolThreads() { return processPool().threads(); }

void cpuPoolRun(int parts, const std::function<void(int)>& fn) {
  if (parts <= 1 || !processPool().tryRun(parts, fn)) {
    for (int part = 0; part < parts; ++part) fn(part);
  }
}

Status cpuParallelSlices(size_t count, size_t dst_element_bytes, bool split,
                         const std::function<Status(size_t, size_t)>& slice) {
  const int threads = split ? cpuPoolThreads() : 1;
  if (threads <= 1) return slice(0, count);
  // kPartsPerThread parts per thread, each a multiple of one cache line of the destination.
  const size_t line = dst_element_bytes >= kCacheLine ? 1 : kCacheLine / dst_element_bytes;
  const size_t per_part = (count + threads * kPartsPerThread - 1) / (threads * kPartsPerThread);
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
