// All-to-all by pairwise exchange (MPICH's MPIR_Alltoallv_intra_pairwise_sendrecv_replace
// idea): rank r's block for peer p goes to p, blocks of any sizes (all_to_all_single with
// split sizes).
//
//   n = 4, step k: every rank sends to rank + k and receives from rank - k (mod n)
//     step 0: copy own block        0->0  1->1  2->2  3->3
//     step 1:                       0->1  1->2  2->3  3->0
//     step 2:                       0->2  1->3  2->0  3->1
//     step 3:                       0->3  1->0  2->1  3->2
//
// In every step each rank has exactly one send and one receive, with partners that are in
// the same step, so no rank waits on one that is busy elsewhere; a block larger than a
// message is cut into messages and both partners cut at the same size.
#pragma once

#include <cstddef>

#include "algorithm/collective.h"

namespace dk::algo {

// args.src holds the blocks for ranks 0..n-1 back to back (sendCounts[p] elements for p);
// args.dst receives the blocks from ranks 0..n-1 back to back (recvCounts[p] elements).
// sendCounts[p] on this rank must equal recvCounts[this rank] on rank p.
Status pairwiseAllToAll(Channel ch, const CollectiveArgs& args, const size_t* sendCounts,
                        const size_t* recvCounts);

}  // namespace dk::algo
