// algorithm="auto": the alpha-beta model of design.md with constants measured per transport.
#pragma once

#include <cstddef>

#include "algorithm/collective.h"

namespace dk::algo {

struct CostModel {
  double alphaUs;     // per dependent message step (handoff between ranks)
  double betaUsPerB;  // per byte moved through memory on the critical path
};

// Shared memory, measured on the 2-core Sapphire Rapids VM (see docs/architecture.md).
CostModel shmCostModel();

// ring: 2 (n-1) alpha + 2 (n-1)/n S beta;  tree: 2 ceil(log2 n) alpha + 2 S beta;
// one-shot: alpha + 2 (n-1) S beta (one step; n-1 copies out, n-1 inputs read).
double ringAllReduceUs(const CostModel& m, int worldSize, size_t bytes);
double treeAllReduceUs(const CostModel& m, int worldSize, size_t bytes);
double oneShotAllReduceUs(const CostModel& m, int worldSize, size_t bytes);
// The cheapest by the model; one-shot only if `oneShotFits` (the message fits one slot).
Algorithm chooseAllReduce(const CostModel& m, int worldSize, size_t bytes, bool oneShotFits);

}  // namespace dk::algo
