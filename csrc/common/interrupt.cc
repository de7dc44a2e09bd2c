#include "common/interrupt.h"

#include <signal.h>

#include <atomic>
#include <mutex>

namespace dk::interrupt {

namespace {

std::atomic<uint64_t> g_sigints{0};
// The handler ours replaced; written (under g_armMutex) before ours is installed, so the
// handler never sees it half-written.
struct sigaction g_previous;
std::mutex g_armMutex;

void countSigint(int sig, siginfo_t* info, void* context) {
  g_sigints.fetch_add(1, std::memory_order_relaxed);
  if (g_previous.sa_flags & SA_SIGINFO) {
    g_previous.sa_sigaction(sig, info, context);
  } else if (g_previous.sa_handler == SIG_DFL) {
    // Nobody handles SIGINT (an embedding without Python's handlers): die as if never armed.
    signal(sig, SIG_DFL);
    raise(sig);
  } else if (g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
  }
}

}  // namespace

uint64_t sigintCount() { return g_sigints.load(std::memory_order_relaxed); }

void armSigint() {
  std::lock_guard<std::mutex> lock(g_armMutex);
  struct sigaction current;
  if (sigaction(SIGINT, nullptr, &current) != 0) return;
  const bool ours = (current.sa_flags & SA_SIGINFO) && current.sa_sigaction == countSigint;
  const bool ignored = !(current.sa_flags & SA_SIGINFO) && current.sa_handler == SIG_IGN;
  if (ours || ignored) return;
  g_previous = current;
  struct sigaction mine = {};
  mine.sa_sigaction = countSigint;
  // No SA_RESTART: a futex sleep in the interrupted thread returns at once (EINTR).
  mine.sa_flags = SA_SIGINFO | (current.sa_flags & SA_ONSTACK);
  sigemptyset(&mine.sa_mask);
  sigaction(SIGINT, &mine, nullptr);
}

}  // namespace dk::interrupt
