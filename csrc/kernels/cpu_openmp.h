// The OpenMP runtime already loaded in this process (torch's), borrowed for standalone CPU
// kernel calls.
//
// torch runs its CPU ops on OpenMP threads (libgomp in torch's wheels), and those spin for a
// while after each parallel region before they sleep (GOMP_SPINCOUNT). A pool of our own beside
// them fought them for the cores: interleaved with torch's add_, our pooled 2-thread fp32 sum ran
// at 0.47-0.61x torch's speed from 256 KiB to 4 MiB, slower than our own single thread (quiet
// 2-core EPYC VM, 2026-12-04, benchmarks/bench_kernels.py). Running our parts on the runtime's
// own team shares its threads instead of competing with them.
//
// The runtime is found by symbol (GOMP_parallel: libgomp's entry point, which Intel's libiomp5
// exports too) among the libraries loaded with global scope (torch loads libgomp so); nothing
// is linked, so a process without OpenMP (a CuPy user without torch) keeps our own pool.
// DK_CPU_POOL=dk forces our pool (measurements, tests).
#pragma once

#include <functional>

namespace dk::kernels {

// Runs fn(part) for every part in [0, parts) on `threads` threads of the process's OpenMP
// runtime (the caller is one of them) and returns true; each part runs exactly once. A call made
// while another thread's call is running runs its parts on the caller alone (as our pool does).
// Returns false, running nothing, when no runtime was found, DK_CPU_POOL=dk, or this process is
// a fork()ed child of the one that found it (libgomp's threads do not survive fork()).
bool openmpRun(int threads, int parts, const std::function<void(int part)>& fn);

// True where openmpRun would run: a runtime was found, DK_CPU_POOL is not "dk", and this is not
// a fork()ed child of the process that found it.
bool openmpActive();

// The runtime's team size for a parallel region of the calling thread (omp_get_max_threads:
// OMP_NUM_THREADS, or what torch.set_num_threads last set); 0 where openmpRun would not run.
int openmpThreads();

// "openmp" if standalone kernels run on the process's OpenMP runtime, else "dk" (our pool).
const char* cpuPoolBackend();

}  // namespace dk::kernels
