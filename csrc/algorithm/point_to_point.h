// Send / receive between two ranks, and the barrier.
#pragma once

#include "algorithm/collective.h"

namespace dk::algo {

// args.src (count elements) to rank args.root, cut into slices; returns once the peer can no
// longer need our buffer (finish()).
Status sendTo(Channel ch, const CollectiveArgs& args);
// args.dst (count elements) from rank args.root. Touches only the receiving side of the
// transport, so it may run beside a sendTo() on another thread (the CPU communicator's lanes).
Status recvFrom(Channel ch, const CollectiveArgs& args);

// Barrier. Where the transport has small-message boxes: one round, every rank raises its flag
// and waits for every other's (n - 1 flag lines instead of log2 n dependent FIFO steps).
// Elsewhere the dissemination barrier: in round k every rank signals rank + 2^k and waits for
// rank - 2^k; after ceil(log2 n) rounds every rank has heard, indirectly, from every other.
//
//   n = 5, round 0: 0->1 1->2 2->3 3->4 4->0;  round 1: 0->2 1->3 ...;  round 2: 0->4 ...
Status barrier(Channel ch);

}  // namespace dk::algo
