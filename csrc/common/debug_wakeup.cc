#include "common/debug_wakeup.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <mutex>

namespace dk::debug_wakeup {

namespace {

std::atomic<int> g_writeFd{-1};
int g_readFd = -1;
pid_t g_owner = 0;  // the process that made the pipe: a forked child makes its own
std::mutex g_openMutex;

void onSigusr1(int) { notify(kDumpSignal); }

}  // namespace

Status open(int* readFd) {
  std::lock_guard<std::mutex> lock(g_openMutex);
  if (g_readFd < 0 || g_owner != getpid()) {
    int fds[2];
    // Close-on-exec: a spawned child starts its own; non-blocking: notify() never waits.
    DK_CHECK_SYS(pipe2(fds, O_CLOEXEC | O_NONBLOCK));
    g_readFd = fds[0];
    g_owner = getpid();
    g_writeFd.store(fds[1], std::memory_order_release);
  }
  *readFd = g_readFd;
  return Status::Ok();
}

void notify(char reason) {
  const int fd = g_writeFd.load(std::memory_order_acquire);
  if (fd < 0) return;
  const int saved = errno;  // a signal handler must leave errno as it found it
  // A full pipe (EAGAIN) already holds a wake-up for the reader: dropping this one is fine.
  [[maybe_unused]] const ssize_t written = write(fd, &reason, 1);
  errno = saved;
}

Status handleSigusr1(bool* installed) {
  struct sigaction current;
  DK_CHECK_SYS(sigaction(SIGUSR1, nullptr, &current));
  const bool ours = !(current.sa_flags & SA_SIGINFO) && current.sa_handler == onSigusr1;
  const bool untouched = !(current.sa_flags & SA_SIGINFO) && current.sa_handler == SIG_DFL;
  if (untouched) {
    struct sigaction mine = {};
    mine.sa_handler = onSigusr1;
    // SA_RESTART: system calls the signal interrupts resume (a collective's futex waits loop
    // on EINTR anyway), so the running call does not notice the dump.
    mine.sa_flags = SA_RESTART;
    sigemptyset(&mine.sa_mask);
    DK_CHECK_SYS(sigaction(SIGUSR1, &mine, nullptr));
  }
  *installed = ours || untouched;
  return Status::Ok();
}

}  // namespace dk::debug_wakeup
