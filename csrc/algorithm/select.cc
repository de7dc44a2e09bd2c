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

double bytesUs(const CostModel& m, double bytes) {
  if (m.kneeBytes <= 0.0 || bytes <= m.kneeBytes) return bytes * m.betaUsPerB;
  return m.kneeBytes * m.betaUsPerB + (bytes - m.kneeBytes) * m.betaFarUsPerB;
}

double ringAllReduceUs(const CostModel& m, int n, size_t bytes) {
  return 2.0 * (n - 1) * m.alphaUs + bytesUs(m, 2.0 * (n - 1) / n * static_cast<double>(bytes));
}

double treeAllReduceUs(const CostModel& m, int n, size_t bytes) {
  const double depth = std::ceil(std::log2(static_cast<double>(n)));
  return 2.0 * depth * m.alphaUs + bytesUs(m, 2.0 * static_cast<double>(bytes));
}

double oneShotAllReduceUs(const CostModel& m, int n, size_t bytes) {
  return m.alphaUs + bytesUs(m, (n - 1) * static_cast<double>(bytes));
}

Algorithm chooseAllReduce(const AlgorithmCosts& m, int n, size_t bytes, bool oneShotFits) {
  Algorithm best = Algorithm::kRing;
  double bestUs = ringAllReduceUs(m.ringAllReduce, n, bytes);
  if (const double us = treeAllReduceUs(m.treeAllReduce, n, bytes); us < bestUs) {
    best = Algorithm::kTree;
    bestUs = us;
  }
  if (oneShotFits && oneShotAllReduceUs(m.oneShotAllReduce, n, bytes) < bestUs) {
    best = Algorithm::kOneShot;
  }
  return best;
}

double ringAllGatherUs(const CostModel& m, int n, size_t bytes) {
  return (n - 1) * m.alphaUs + bytesUs(m, static_cast<double>(n - 1) / n * bytes);
}

double oneShotAllGatherUs(const CostModel& m, int n, size_t bytes) {
  return m.alphaUs + bytesUs(m, static_cast<double>(n - 1) / n * bytes);
}

double ringReduceScatterUs(const CostModel& m, int n, size_t bytes) {
  return ringAllGatherUs(m, n, bytes);
}

double oneShotReduceScatterUs(const CostModel& m, int n, size_t bytes) {
  return oneShotAllGatherUs(m, n, bytes);
}

Algorithm chooseAllGather(const AlgorithmCosts& m, int n, size_t bytes, bool oneShotFits) {
  const bool oneShot = oneShotFits && oneShotAllGatherUs(m.oneShotAllGather, n, bytes) <
                                          ringAllGatherUs(m.ringAllGather, n, bytes);
  return oneShot ? Algorithm::kOneShot : Algorithm::kRing;
}

Algorithm chooseReduceScatter(const AlgorithmCosts& m, int n, size_t bytes, bool oneShotFits) {
  const bool oneShot = oneShotFits && oneShotReduceScatterUs(m.oneShotReduceScatter, n, bytes) <
                                          ringReduceScatterUs(m.ringReduceScatter, n, bytes);
  return oneShot ? Algorithm::kOneShot : Algorithm::kRing;
}

Algorithm chooseOnNccl(int /*worldSize*/, size_t /*bytes*/) { return Algorithm::kNccl; }

}  // namespace dk::algo
