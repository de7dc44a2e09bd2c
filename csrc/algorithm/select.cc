#include "algorithm/select.h"

#include <cmath>

namespace dk::algo {

CostModel shmCostModel() {
  // alpha: one dependent step of a 2-rank ring at 8 B (half an all-reduce round trip);
  // beta: 1 / (memory bandwidth of one core copying through L2/L3, ~5 GB/s).
  return CostModel{0.8, 1.0 / 5000.0};
}

double ringAllReduceUs(const CostModel& m, int n, size_t bytes) {
  return 2.0 * (n - 1) * m.alphaUs + 2.0 * (n - 1) / n * static_cast<double>(bytes) * m.betaUsPerB;
}

double treeAllReduceUs(const CostModel& m, int n, size_t bytes) {
  const double depth = std::ceil(std::log2(static_cast<double>(n)));
  return 2.0 * depth * m.alphaUs + 2.0 * static_cast<double>(bytes) * m.betaUsPerB;
}

Algorithm chooseAllReduce(const CostModel& m, int n, size_t bytes) {
  return treeAllReduceUs(m, n, bytes) < ringAllReduceUs(m, n, bytes) ? Algorithm::kTree
                                                                     : Algorithm::kRing;
}

}  // namespace dk::algo
