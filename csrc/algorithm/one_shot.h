// One-shot collectives, for small messages (design.md decision 13): one exchange with every
// peer instead of a chain of dependent steps.
//
// all-reduce:
// Every rank publishes its whole input to every peer once, then reduces all n inputs itself,
// in rank order:
//
//   rank r:  send in_r -> every peer;  receive in_p from every peer p;
//            dst = op(in_0, in_1, ..., in_{n-1})      (in_r read from its own buffer)
//
// One dependent step instead of the ring's 2(n-1) or the tree's 2 log2 n, paid for with n-1
// times the bytes: it wins while the per-step latency dominates (algorithm/select.h picks it).
// Invariant: every rank evaluates the same expression, sources in the same order, with the
// same kernel, so every rank holds identical bits (FP16 / BF16 accumulate in FP32 and round
// once). Every rank receives every peer's message, so every rank checks every rank's
// descriptor (the transport's header check): disagreement is seen everywhere.
//
// The message must fit one transport message (maxMessageBytes()); larger ones use ring / tree.
// One that fits the transport's small-message boxes (smallMessageBytes(): shared memory's
// flag-line boxes, up to 8 KiB) is published with exchangeSmall() instead of exchange():
// nothing to release or finish, the same reduction. A small reduce-scatter publishes its whole
// input there (n chunks), and each rank reads its own chunk of every peer's.
//
// all-gather and reduce-scatter: the same single step with the ring's bytes, one chunk (count
// elements) per peer, which must fit one message; larger ones use the ring:
//
//   all_gather     rank r:  send in_r -> every peer;  out[p] = in_p for every p
//   reduce_scatter rank r:  send chunk p of in_r -> peer p;
//                           out = op(chunk r of in_0, ..., chunk r of in_{n-1})   (rank order)
//
// n-1 steps of the ring become one; at 2 ranks the ring is this very exchange. Each chunk of a
// reduce-scatter is reduced by one rank only, with the all-reduce's kernel and source order.
#pragma once

#include "algorithm/collective.h"

namespace dk::algo {

// True if a one-shot message of `bytes` (all-reduce: the whole input; all-gather and
// reduce-scatter: one rank's chunk) fits on `transport`.
bool oneShotFits(const Transport& transport, size_t bytes);

Status oneShotAllReduce(Channel ch, const CollectiveArgs& args);
// dst (count elements) = chunk `rank` of reduce over ranks of src (worldSize * count elements).
Status oneShotReduceScatter(Channel ch, const CollectiveArgs& args);
// dst (worldSize * count elements) = concatenation over ranks of src (count elements).
Status oneShotAllGather(Channel ch, const CollectiveArgs& args);
// Broadcast of a message that fits the transport's small-message boxes (fitsSmall): one round
// in which every rank publishes and reads every flag, so every rank has checked every rank's
// descriptor (the agreement a tree broadcast needs afterwards) and non-roots copy the root's.
Status oneShotBroadcast(Channel ch, const CollectiveArgs& args);

}  // namespace dk::algo
