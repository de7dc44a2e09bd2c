// Parallel parts for standalone CPU kernel calls (dist_kernels.ops): on the process's OpenMP
// runtime when one is loaded (torch's; cpu_openmp.h), else on a small persistent thread pool of
// our own, described below. The communicator never uses either: each rank owns one core there.
//
// Size: DK_NUM_THREADS if set (>= 1); else on the OpenMP runtime its team size (what torch's
// ops use: OMP_NUM_THREADS, torch.set_num_threads); else OMP_NUM_THREADS (>= 1; torchrun sets it
// to 1 for several ranks per host), else std::thread::hardware_concurrency(). The calling
// thread is one of them. Threads start on first use and after a fork() in the child (the
// parent's threads do not exist there). One job runs at a time; a second caller that finds the
// pool busy runs its job on its own thread instead of waiting. Idle workers spin ~100 us
// after a job before they sleep (as OpenMP's do), so back-to-back calls need no wake-up.
#pragma once

#include <cstddef>
#include <functional>

#include "common/status.h"

namespace dk::kernels {

// Number of threads a parallel call may use, the caller included.
int cpuPoolThreads();

// Runs fn(part) for every part in [0, parts), shared among the caller and the pool's threads,
// and returns after all parts finish. Any number of parts; each runs exactly once.
void cpuPoolRun(int parts, const std::function<void(int part)>& fn);

// Splits [0, count) into a few slices per pool thread whose boundaries fall on 64-byte
// multiples of the destination (no two threads write one cache line) and runs slice(begin, end)
// for each; the first non-OK Status wins. With split false it runs one slice on the caller.
Status cpuParallelSlices(size_t count, size_t dst_element_bytes, bool split,
                         const std::function<Status(size_t begin, size_t end)>& slice);

}  // namespace dk::kernels
