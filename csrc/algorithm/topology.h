// Pure topology and chunking for the collective algorithms: no I/O, no transport, testable for
// any world size (tests/test_topology.py checks n = 1..65 through the bindings).
#pragma once

#include <cstddef>
#include <vector>

namespace dk::algo {

// Ring order: the rank at each ring position. Shared memory on one host has no locality to
// exploit, so the ring is the identity; the NCCL path may pass its own order.
//
//   0 -> 1 -> 2 -> ... -> n-1 -> 0      (each rank sends to next, receives from prev)
std::vector<int> ringOrder(int worldSize);

struct RingNeighbors {
  int position;  // this rank's index in the ring order
  int next;      // rank we send to
  int prev;      // rank we receive from
};
RingNeighbors ringNeighbors(const std::vector<int>& order, int rank);

// One rank's place in a tree: parent (-1 at the root) and up to two children.
struct TreeNode {
  int parent = -1;
  int children[2] = {-1, -1};
  int numChildren = 0;
};

// The double binary tree (two trees, each carrying half the data). Tree 0 is the in-order
// binary tree over positions v = rank + 1: a node's level is the number of trailing zero bits
// of v, so every even rank (odd v) is a leaf. For n = 7:
//
//   tree 0 (rank = v - 1)            tree 1 (n odd: shifted, rank = (v - 1 + n - 1) mod n)
//              3                                  2
//          /       \                          /       \     (positions 4 -> 2, 6)
//         1         5                        0         4
//        / \       / \                      / \       / \    (odd positions)
//       0   2     4   6                    6   1     3   5
//
// Tree 1 maps position v to rank n - v (mirror) when n is even and to v - 2 mod n (shift)
// when n is odd, so a rank interior in one tree is a leaf in the other: each rank forwards
// at most one half of the data, and both halves use all links.
TreeNode doubleTreeNode(int tree, int worldSize, int rank);

// Single trees for broadcast, rooted at `root`, over ranks relative to it (v = rank - root):
// chain: v-1 -> v -> v+1 (pipelines large messages: every rank forwards once), and a binary
// heap tree: parent (v-1)/2, children 2v+1, 2v+2 (depth log2 n for small messages).
TreeNode chainNode(int worldSize, int root, int rank);
TreeNode heapTreeNode(int worldSize, int root, int rank);

// Chunks of a buffer of `count` elements: `parts` balanced pieces whose boundaries are
// multiples of `granule` elements (a cache line) so that vector loops stay aligned; the last
// pieces may be shorter or empty.
//
//   count = 10, parts = 3, granule = 2:  [0,4) [4,8) [8,10)
struct Range {
  size_t offset;
  size_t count;
};
Range chunkRange(size_t count, int parts, int index, size_t granule);

// Slices of one chunk: slice `j` of a chunk of `count` elements, `sliceElems` each (the last
// one short, later ones empty). Every rank walks the same number of slices, numSlices(), so
// that the message sequence is identical everywhere even when chunk sizes differ.
Range sliceRange(Range chunk, size_t sliceElems, size_t j);
size_t numSlices(size_t maxChunkCount, size_t sliceElems);

}  // namespace dk::algo
