// algorithm="auto": the alpha-beta model of design.md with constants measured per transport.
#pragma once

#include <cstddef>

#include "algorithm/collective.h"

namespace dk::algo {

struct CostModel {
  double alphaUs;     // per dependent message step (handoff between ranks)
  double betaUsPerB;  // per byte moved through memory on the critical path
  // A fitted model may have a knee: bytes beyond kneeBytes cost betaFarUsPerB each (the
  // working set has left the caches). 0: no knee.
  double kneeBytes = 0.0;
  double betaFarUsPerB = 0.0;
};

// beta's term for `bytes` on the critical path, with the knee.
double bytesUs(const CostModel& m, double bytes);

// One model per algorithm: a calibration (python -m dist_kernels.bench --calibrate) fits each
// on its own; the built-in model is one for all (uniform).
struct AlgorithmCosts {
  CostModel ringAllReduce, treeAllReduce, oneShotAllReduce;
  CostModel ringAllGather, oneShotAllGather, ringReduceScatter, oneShotReduceScatter;
  static AlgorithmCosts uniform(const CostModel& m) { return {m, m, m, m, m, m, m}; }
};

// Shared memory (see docs/architecture.md). `oversubscribed`: more ranks on the host than usable
// cores, where every dependent step waits for a time slice.
CostModel shmCostModel(bool oversubscribed = false);

// ring: 2 (n-1) alpha + 2 (n-1)/n S beta;  tree: 2 ceil(log2 n) alpha + 2 S beta;
// one-shot: alpha + (n-1) S beta (one step; each rank reads the n-1 other inputs once).
double ringAllReduceUs(const CostModel& m, int worldSize, size_t bytes);
double treeAllReduceUs(const CostModel& m, int worldSize, size_t bytes);
double oneShotAllReduceUs(const CostModel& m, int worldSize, size_t bytes);
// The cheapest by the model; one-shot only if `oneShotFits` (the caller's size limit for it).
Algorithm chooseAllReduce(const AlgorithmCosts& m, int worldSize, size_t bytes, bool oneShotFits);

// All-gather and reduce-scatter, `bytes` = the whole buffer S (all-gather's output,
// reduce-scatter's input), as nccl-tests counts it. ring: (n-1) alpha + (n-1)/n S beta;
// one-shot: alpha + (n-1)/n S beta (the same chunks move, in one step instead of n-1).
// Equal at n = 2, where the ring is one exchange too.
double ringAllGatherUs(const CostModel& m, int worldSize, size_t bytes);
double oneShotAllGatherUs(const CostModel& m, int worldSize, size_t bytes);
// A reduce-scatter moves what an all-gather moves, backwards: the same two models.
double ringReduceScatterUs(const CostModel& m, int worldSize, size_t bytes);
double oneShotReduceScatterUs(const CostModel& m, int worldSize, size_t bytes);
// The cheaper of ring and one-shot (one-shot only if `oneShotFits`; a tie keeps the ring).
Algorithm chooseAllGather(const AlgorithmCosts& m, int worldSize, size_t bytes, bool oneShotFits);
Algorithm chooseReduceScatter(const AlgorithmCosts& m, int worldSize, size_t bytes,
                              bool oneShotFits);

// NCCL transport: what "auto" runs. NCCL's own collective, for every size and collective,
// until our ring and tree over NCCL send/recv have been measured on a GPU (docs/gpu.md): there
// is no cost model for this transport yet, and NCCL's tuning is the better default.
Algorithm chooseOnNccl(int worldSize, size_t bytes);

}  // namespace dk::algo
