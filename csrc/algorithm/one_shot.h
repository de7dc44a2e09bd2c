// One-shot all-reduce, for small messages (design.md decision 13).
//
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
#pragma once

#include "algorithm/collective.h"

namespace dk::algo {

// True if an all-reduce of `bytes` fits the one-shot algorithm on `transport`.
bool oneShotFits(const Transport& transport, size_t bytes);

Status oneShotAllReduce(Channel ch, const CollectiveArgs& args);

}  // namespace dk::algo
