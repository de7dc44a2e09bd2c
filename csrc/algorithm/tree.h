// Tree collectives.
//
// All-reduce over the double binary tree (topology.h): the buffer is cut in two halves, half
// h travels tree h. Per slice: reduce up (each rank adds its children's partial sums to its
// own and sends the result to its parent), then the root's result flows down (each rank copies
// it and forwards it to its children). Seven ranks, tree 0, one slice:
//
//   up:    0,2 -> 1    4,6 -> 5        down:  3 -> 1, 5
//          1,5 -> 3 (root: final)             1 -> 0, 2    5 -> 4, 6
//
// All up-steps of all slices run before the down-steps; the FIFOs pipeline them, and the
// root's result is the only one ever copied, so every rank holds identical bits.
//
// Broadcast: a chain (large messages: each rank forwards once, slices pipelined) or a binary
// heap tree rooted at `root` (small messages: depth log2 n).
//
// Lanes (collective.h): tree t of the all-reduce travels lane t, and broadcast slice j lane j,
// so with two lanes one's reduce or forward overlaps the other's transfer; the bits are the same.
#pragma once

#include "algorithm/collective.h"
#include "algorithm/topology.h"

namespace dk::algo {

Status treeAllReduce(const Lanes& lanes, const CollectiveArgs& args);
// args.dst (count elements) on every rank = args.dst on rank args.root.
Status treeBroadcast(const Lanes& lanes, const CollectiveArgs& args, bool chain);

}  // namespace dk::algo
