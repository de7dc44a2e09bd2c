#include "algorithm/select.h"

#include <cmath>

namespace dk::algo {

CostModel shmCostModel(bool oversubscribed) {
  // Measured on the 2-core VM in a quiet moment (2 ranks, fp32, back-to-back calls):
  // all_reduce of 8 B took 3.2 us (registered) to 5.2 us (plain) = 2 dependent steps plus
  // the call, so alpha ~ 1.5 us; 1-16 MiB ran at 6-8 GB/s busbw, so beta ~ 1 / 6 GB/s.
  // With these, auto picks one-shot at 2 ranks up to its size limit and the tree at 8 ranks
  // from ~9 KB to ~290 KB (6 tree steps against the ring's 14).
  // Oversubscribed (4 ranks on 2 cores, 2026-12-01, bench_mpi.py --algorithm): a 4 KiB
  // all-reduce took 9 us one-shot (1 step), 22 us ring (6 steps, neighbours overlap), 28-34 us
  // tree (4 steps, none overlap): a step costs ~4 us, not 1.5.
  return CostModel{oversubscribed ? 4.0 : 1.5, 1.0 / 6000.0};
}

double ringAllReduceUs(const CostModel& m, int n, size_t bytes) {
  return 2.0 * (n - 1) * m.alphaUs + 2.0 * (n - 1) / n * static_cast<double>(bytes) * m.betaUsPerB;
}

double treeAllReduceUs(const CostModel& m, int n, size_t bytes) {
  const double depth = std::ceil(std::log2(static_cast<double>(n)));
  return 2.0 * depth * m.alphaUs + 2.0 * static_cast<double>(bytes) * m.betaUsPerB;
}

double oneShotAllReduceUs(const CostModel& m, int n, size_t bytes) {
  return m.alphaUs + (n - 1) * static_cast<double>(bytes) * m.betaUsPerB;
}

Algorithm chooseAllReduce(const CostModel& m, int n, size_t bytes, bool oneShotFits) {
  Algorithm best = Algorithm::kRing;
  double bestUs = ringAllReduceUs(m, n, bytes);
  if (const double us = treeAllReduceUs(m, n, bytes); us < bestUs) {
    best = Algorithm::kTree;
    bestUs = us;
  }
  if (oneShotFits && oneShotAllReduceUs(m, n, bytes) < bestUs) best = Algorithm::kOneShot;
  return best;
}

double ringAllGatherUs(const CostModel& m, int n, size_t bytes) {
  return (n - 1) * m.alphaUs + static_cast<double>(n - 1) / n * bytes * m.betaUsPerB;
}

double oneShotAllGatherUs(const CostModel& m, int n, size_t bytes) {
  return m.alphaUs + static_cast<double>(n - 1) / n * bytes * m.betaUsPerB;
}

double ringReduceScatterUs(const CostModel& m, int n, size_t bytes) {
  return ringAllGatherUs(m, n, bytes);
}

double oneShotReduceScatterUs(const CostModel& m, int n, size_t bytes) {
  return oneShotAllGatherUs(m, n, bytes);
}

Algorithm chooseAllGather(const CostModel& m, int n, size_t bytes, bool oneShotFits) {
  const bool oneShot =
      oneShotFits && oneShotAllGatherUs(m, n, bytes) < ringAllGatherUs(m, n, bytes);
  return oneShot ? Algorithm::kOneShot : Algorithm::kRing;
}

Algorithm chooseReduceScatter(const CostModel& m, int n, size_t bytes, bool oneShotFits) {
  const bool oneShot =
      oneShotFits && oneShotReduceScatterUs(m, n, bytes) < ringReduceScatterUs(m, n, bytes);
  return oneShot ? Algorithm::kOneShot : Algorithm::kRing;
}

Algorithm chooseOnNccl(int /*worldSize*/, size_t /*bytes*/) { return Algorithm::kNccl; }

}  // namespace dk::algo
