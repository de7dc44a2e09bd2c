// Ring collectives: reduce-scatter, all-gather, and all-reduce = reduce-scatter then
// all-gather, pipelined in slices of at most transport.maxMessageBytes().
//
// Four ranks, one slice, data chunks A B C D (chunk c ends up reduced on ring position c):
//
//   reduce-scatter (3 steps)                 all-gather (3 steps)
//   step 1: r0 sends D, r1 A, r2 B, r3 C     step 4: r0 sends A*, r1 B*, r2 C*, r3 D*
//   step 2: forward C+D, D+A, A+B, B+C       step 5: forward D*, A*, B*, C*
//   step 3: r0 gets B+C+D, adds A = A*       step 6: r0 gets C*, r1 D*, ...: everyone has all
//
// Every element of chunk c is reduced in the same order (starting at position c+1, ending at
// c), and all-gather copies that one result everywhere, so all ranks hold identical bits.
//
// Lanes: slice j runs on lane j % lanes.count() (its own transport, compute and scratch), so
// with two lanes the reduce of slice j overlaps the transfers of slice j+1 (collective.h). The
// arithmetic and its order do not depend on the lane: the bits are the same with any count.
#pragma once

#include "algorithm/collective.h"

namespace dk::algo {

// dst = reduce over ranks of src (count elements; src may equal dst).
Status ringAllReduce(const Lanes& lanes, const CollectiveArgs& args);
// dst (count elements) = chunk `rank` of reduce over ranks of src (worldSize * count elements);
// partial sums go to each lane's scratch.
Status ringReduceScatter(const Lanes& lanes, const CollectiveArgs& args);
// dst (worldSize * count elements) = concatenation over ranks of src (count elements).
Status ringAllGather(const Lanes& lanes, const CollectiveArgs& args);

}  // namespace dk::algo
