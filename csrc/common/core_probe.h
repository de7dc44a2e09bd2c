// How far apart two CPUs are: the round trip of one cache line between threads pinned to them.
//
// Every two-rank benchmark on a VM depends on where the hypervisor placed its vCPUs: SMT
// siblings or cores sharing a cache pass a line in tens of nanoseconds, cores on other dies in
// hundreds, and the same VM moves between the two from run to run. Benchmarks print this probe
// beside their tables (dist_kernels.info.cross_core_round_trip_ns) so that two runs can be
// compared, as they print the load average.
#pragma once

#include "common/status.h"

namespace dk::probe {

// Median over `batches` of the mean round trip of `iterations` hand-offs between a thread on
// `cpuA` and one on `cpuB`, in nanoseconds. Fails (never hangs) when a CPU cannot be used or
// a thread is not scheduled within a second.
Status crossCoreRoundTripNs(int cpuA, int cpuB, int iterations, int batches, double* ns);

}  // namespace dk::probe
