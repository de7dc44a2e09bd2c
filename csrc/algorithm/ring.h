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
#pragma once

#include "algorithm/collective.h"

namespace dk::algo {

// dst = reduce over ranks of src (count elements; src may equal dst).
Status ringAllReduce(Channel ch, const CollectiveArgs& args);
// dst (count elements) = chunk `rank` of reduce over ranks of src (worldSize * count elements).
Status ringReduceScatter(Channel ch, const CollectiveArgs& args);
// dst (worldSize * count elements) = concatenation over ranks of src (count elements).
Status ringAllGather(Channel ch, const CollectiveArgs& args);

}  // namespace dk::algo
