// Persistent worker threads behind cpuPoolRun (see cpu_thread_pool.h).
#include "kernels/cpu_thread_pool.h"

#include <unistd.h>

#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace dk::kernels {

namespace {

class ThreadPool {
 public:
  explicit ThreadPool(int threads) : threads_(threads) {
    for (int worker = 1; worker < threads_; ++worker) {
      std::thread([this, worker] { workerLoop(worker); }).detach();
    }
  }
  int threads() const { return threads_; }

  // Returns false (running nothing) if another caller holds the pool.
  bool tryRun(int parts, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> job(job_mutex_, std::try_to_lock);
    if (!job.owns_lock()) return false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      fn_ = &fn;
      parts_ = parts;
      pending_ = parts - 1;
      ++generation_;
    }
    wake_.notify_all();
    fn(0);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
    fn_ = nullptr;
    return true;
  }

 private:
  // Workers live for the process (the pool is never destroyed: joining at interpreter exit could
  // deadlock), so the loop has no exit.
  void workerLoop(int worker) {
    unsigned long seen = 0;
    for (;;) {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (worker >= parts_) continue;
      const std::function<void(int)>* fn = fn_;
      lock.unlock();
      (*fn)(worker);
      lock.lock();
      if (--pending_ == 0) done_.notify_one();
    }
  }

  const int threads_;
  std::mutex job_mutex_;  // held by the caller for a whole job
  std::mutex mutex_;      // guards the fields below
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(int)>* fn_ = nullptr;
  int parts_ = 0;
  int pending_ = 0;
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
  // Slice length: a multiple of one cache line's worth of elements.
  const size_t line = dst_element_bytes >= kCacheLine ? 1 : kCacheLine / dst_element_bytes;
  const size_t per_thread = (count + threads - 1) / threads;
  const size_t length = (per_thread + line - 1) / line * line;
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
