// All-to-all in one exchange per message round: every rank posts its block for every peer at
// once, then takes every peer's block, instead of a pairwise schedule's n-1 dependent steps
// (MPICH's pairwise sendrecv, which this replaced: at 4 ranks a message waited on three
// handshakes in turn, here on one). The MoE token dispatch (dist_kernels/moe/) is its user.
//
//   n = 3, blocks cut into messages of at most maxMessageBytes(); round m:
//     rank 0:  send msg m of block 1 -> 1, of block 2 -> 2;  recv msg m from 1 and from 2
//     rank 1:  send msg m of block 2 -> 2, of block 0 -> 0;  recv msg m from 2 and from 0
//     rank 2:  send msg m of block 0 -> 0, of block 1 -> 1;  recv msg m from 0 and from 1
//   a pair whose block has no message m left sits the round out on both sides (both know
//   the block's size), so rounds stay matched.
//
// Bytes: a block in registered memory (comm.empty) is published as a descriptor and the peer
// copies it straight into its output, so every byte is copied once, by its receiver; a plain
// tensor adds the transport's copy into a slot. The own block is one local copy.
// Invariant: message m of a block has the same offset and size on both sides, and every rank
// posts all its sends of a round before it waits on any receive, so no cycle of waits forms
// (each FIFO has a free slot once its receiver released the previous round).
#pragma once

#include <cstddef>

#include "algorithm/collective.h"

namespace dk::algo {

// args.src holds the blocks for ranks 0..n-1 back to back (sendCounts[p] elements for p);
// args.dst receives the blocks from ranks 0..n-1 back to back (recvCounts[p] elements).
// sendCounts[p] on this rank must equal recvCounts[this rank] on rank p.
Status oneShotAllToAll(Channel ch, const CollectiveArgs& args, const size_t* sendCounts,
                       const size_t* recvCounts);

}  // namespace dk::algo
