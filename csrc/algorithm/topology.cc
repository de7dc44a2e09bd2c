#include "algorithm/topology.h"

#include <algorithm>

namespace dk::algo {

std::vector<int> ringOrder(int worldSize) {
  std::vector<int> order(worldSize);
  for (int r = 0; r < worldSize; ++r) order[r] = r;
  return order;
}

RingNeighbors ringNeighbors(const std::vector<int>& order, int rank) {
  const int n = static_cast<int>(order.size());
  const int pos = static_cast<int>(std::find(order.begin(), order.end(), rank) - order.begin());
  return {pos, order[(pos + 1) % n], order[(pos + n - 1) % n]};
}

namespace {

int lowBit(int v) { return v & -v; }

// Parent of position v in the infinite in-order tree: clear v's low bit, set the next one.
int inOrderParent(int v) { return (v - lowBit(v)) | (lowBit(v) << 1); }

// Positions 1..n of the in-order tree. Nodes beyond n are skipped: a node hanging under one
// climbs to the first in-range ancestor, and a missing child is replaced by the first in-range
// node down its left spine (all of a missing node's right subtree is beyond n too).
int inRangeParent(int v, int n) {
  int root = 1;
  while (root * 2 <= n) root *= 2;
  if (v == root) return 0;
  int p = inOrderParent(v);
  while (p > n) p = inOrderParent(p);
  return p;
}

int inRangeChild(int c, int n) {
  while (c > n) {
    if (lowBit(c) == 1) return 0;
    c -= lowBit(c) / 2;
  }
  return c;
}

TreeNode inOrderNode(int n, int v) {
  TreeNode node;
  node.parent = inRangeParent(v, n);  // 0 = none
  const int half = lowBit(v) / 2;
  if (half > 0) {
    for (int c : {v - half, inRangeChild(v + half, n)}) {
      if (c > 0) node.children[node.numChildren++] = c;
    }
  }
  return node;
}

}  // namespace

TreeNode doubleTreeNode(int tree, int worldSize, int rank) {
  const int n = worldSize;
  // rank <-> position maps of the two trees (position v is 1-based).
  auto toRank = [&](int v) {
    if (tree == 0) return v - 1;
    return n % 2 == 0 ? n - v : (v - 2 + n) % n;
  };
  const int v = tree == 0 ? rank + 1 : (n % 2 == 0 ? n - rank : (rank + 1) % n + 1);
  TreeNode node = inOrderNode(n, v);
  node.parent = node.parent == 0 ? -1 : toRank(node.parent);
  for (int i = 0; i < node.numChildren; ++i) node.children[i] = toRank(node.children[i]);
  return node;
}

TreeNode chainNode(int worldSize, int root, int rank) {
  const int v = (rank - root + worldSize) % worldSize;
  TreeNode node;
  if (v > 0) node.parent = (rank - 1 + worldSize) % worldSize;
  if (v + 1 < worldSize) node.children[node.numChildren++] = (rank + 1) % worldSize;
  return node;
}

TreeNode heapTreeNode(int worldSize, int root, int rank) {
  const int v = (rank - root + worldSize) % worldSize;
  TreeNode node;
  if (v > 0) node.parent = ((v - 1) / 2 + root) % worldSize;
  for (int c : {2 * v + 1, 2 * v + 2}) {
    if (c < worldSize) node.children[node.numChildren++] = (c + root) % worldSize;
  }
  return node;
}

Range chunkRange(size_t count, int parts, int index, size_t granule) {
  const size_t units = (count + granule - 1) / granule;
  const size_t base = units / parts;
  const size_t extra = units % parts;
  const size_t idx = static_cast<size_t>(index);
  const size_t begin = std::min(count, (idx * base + std::min(idx, extra)) * granule);
  const size_t end = std::min(count, ((idx + 1) * base + std::min(idx + 1, extra)) * granule);
  return {begin, end - begin};
}

Range sliceRange(Range chunk, size_t sliceElems, size_t j) {
  const size_t begin = std::min(chunk.count, j * sliceElems);
  const size_t end = std::min(chunk.count, begin + sliceElems);
  return {chunk.offset + begin, end - begin};
}

size_t numSlices(size_t maxChunkCount, size_t sliceElems) {
  return std::max<size_t>(1, (maxChunkCount + sliceElems - 1) / sliceElems);
}

}  // namespace dk::algo
