// Bytes moved through memory per rank for an all-reduce of S bytes on n ranks (r = read,
// w = written). "Registered": tensors from comm.empty, which peers read in place; "plain":
// any other tensor, whose every send is first copied into a slot.
//
//   registered:  reduce steps  (n-1) chunks x (read own + read peer + write) = r 2(n-1)/n S,
//                                                                             w (n-1)/n S
//                gather steps  (n-1) chunks x (read peer + write)           = r (n-1)/n S,
//                                                                             w (n-1)/n S
//                n = 2: r = 1.5 S, w = 1 S.
//   plain:       + 2(n-1) slot copies of S/n (read + write each); n = 2: r = 2.5 S, w = 2 S.
//   reduce_scatter (S = whole input):  the reduce steps only (+ slot copies when plain).
//   all_gather (S = whole output):     own S/n copied, then the gather steps.
#include "algorithm/ring.h"

#include <vector>

#include "algorithm/topology.h"

namespace dk::algo {

namespace {

// One ring on one lane, one collective, one slice index at a time.
struct Ring {
  Channel ch;
  const CollectiveArgs& args;
  std::vector<int> order;
  RingNeighbors nb;
  int n;
  size_t elem;
  size_t sliceElems;
  bool perRankChunks;  // scatter / gather: chunk r is count elements at r * count

  Ring(Channel c, const CollectiveArgs& a, bool perRank)
      : ch(c),
        args(a),
        order(ringOrder(c.transport.worldSize())),
        nb(ringNeighbors(order, c.transport.rank())),
        n(c.transport.worldSize()),
        elem(dtypeSize(a.dtype)),
        sliceElems(c.transport.maxMessageBytes() / elem),
        perRankChunks(perRank) {}

  // Chunk owned by ring position p (any integer; taken modulo n).
  Range chunk(int p) const {
    const int r = order[((p % n) + n) % n];
    if (perRankChunks) return {static_cast<size_t>(r) * args.count, args.count};
    return chunkRange(args.count, n, r, 64 / elem);
  }
  size_t slices() const {
    return numSlices(perRankChunks ? args.count : chunkRange(args.count, n, 0, 64 / elem).count,
                     sliceElems);
  }
  Range slice(int p, size_t j) const { return sliceRange(chunk(p), sliceElems, j); }
  size_t bytes(Range r) const { return r.count * elem; }

  // Posts a send of `sendRange` from `src`, then receives slice `recvRange` from prev into
  // `recv` (straight into `into` where the transport can: see RecvOp::into).
  Status step(const char* src, Range sendRange, Range recvRange, RecvOp* recv,
              char* into = nullptr) {
    SendOp send{nb.next, src, bytes(sendRange)};
    *recv = RecvOp{nb.prev, bytes(recvRange), into};
    return ch.transport.exchange(&send, 1, recv, 1);
  }

  // Puts a received final slice at `to` (nothing to copy if it arrived there), then frees it.
  Status land(char* to, RecvOp& recv) {
    if (recv.data != to) DK_RETURN_IF_ERROR(ch.compute.copy(to, recv.data, recv.bytes));
    return ch.transport.release(&recv, 1);
  }
};

// One Ring per lane; slice j runs on lane j % lanes.count().
std::vector<Ring> ringsOf(const Lanes& lanes, const CollectiveArgs& a, bool perRank) {
  std::vector<Ring> rings;
  for (int l = 0; l < lanes.count(); ++l) rings.emplace_back(lanes[l], a, perRank);
  return rings;
}

// Ends the collective on every lane.
Status finishAll(const Lanes& lanes) {
  for (int l = 0; l < lanes.count(); ++l) DK_RETURN_IF_ERROR(lanes[l].transport.finish());
  return Status::Ok();
}

// Reduce-scatter of slice j. `in` holds every chunk; partials go to partialBase + offset
// (dst for all-reduce, scratch for reduce-scatter, at slice offset 0); the owned result goes
// to `owned` (finalBase + offset).
Status reduceScatterSlice(Ring& ring, size_t j, const char* in, char* partialBase,
                          bool partialInScratch, char* owned) {
  Compute& c = ring.ch.compute;
  const CollectiveArgs& a = ring.args;
  const int p = ring.nb.position;
  const int n = ring.n;
  auto at = [&](const char* base, Range r) { return base + r.offset * ring.elem; };
  RecvOp x;
  // send: our own slice of chunk p-1 starts its trip round the ring.
  DK_RETURN_IF_ERROR(
      ring.step(at(in, ring.slice(p - 1, j)), ring.slice(p - 1, j), ring.slice(p - 2, j), &x));
  // n-2 x recv-reduce-send: add our slice to the partial sum and pass it on.
  for (int k = 1; k <= n - 2; ++k) {
    const Range r = ring.slice(p - 1 - k, j);
    char* partial = partialInScratch ? partialBase : const_cast<char*>(at(partialBase, r));
    DK_RETURN_IF_ERROR(c.reduce(partial, at(in, r), x.data, r.count, a.dtype, a.op));
    DK_RETURN_IF_ERROR(ring.ch.transport.release(&x, 1));
    DK_RETURN_IF_ERROR(ring.step(partial, r, ring.slice(p - 2 - k, j), &x));
  }
  // recv-reduce: the last contribution completes chunk p; AVG divides once, in this same pass.
  const Range mine = ring.slice(p, j);
  const void* last[2] = {at(in, mine), x.data};
  DK_RETURN_IF_ERROR(a.op == RedOp::kAvg
                         ? c.reduceAverage(owned, last, 2, mine.count, a.dtype, n)
                         : c.reduce(owned, last[0], last[1], mine.count, a.dtype, a.op));
  return ring.ch.transport.release(&x, 1);
}

// All-gather of slice j: every chunk's final slice lives at out + offset; ours is in place.
// Each received slice is final, so it is received straight into `out` where the transport can.
Status allGatherSlice(Ring& ring, size_t j, char* out) {
  const int p = ring.nb.position;
  const int n = ring.n;
  auto at = [&](Range r) { return out + r.offset * ring.elem; };
  RecvOp x;
  // send: our final slice.
  Range next = ring.slice(p - 1, j);
  DK_RETURN_IF_ERROR(ring.step(at(ring.slice(p, j)), ring.slice(p, j), next, &x, at(next)));
  // n-2 x recv-copy-send.
  for (int k = 1; k <= n - 2; ++k) {
    const Range r = ring.slice(p - k, j);
    DK_RETURN_IF_ERROR(ring.land(at(r), x));
    next = ring.slice(p - k - 1, j);
    DK_RETURN_IF_ERROR(ring.step(at(r), r, next, &x, at(next)));
  }
  // recv: the last chunk arrives.
  return ring.land(at(ring.slice(p + 1, j)), x);
}

// A single rank: the result is its own input.
Status selfOnly(Channel ch, const CollectiveArgs& a, size_t count) {
  return ch.compute.copy(a.dst, a.src, count * dtypeSize(a.dtype));
}

}  // namespace

Status ringAllReduce(const Lanes& lanes, const CollectiveArgs& a) {
  if (lanes[0].transport.worldSize() == 1) return selfOnly(lanes[0], a, a.count);
  std::vector<Ring> rings = ringsOf(lanes, a, /*perRank=*/false);
  auto* dst = static_cast<char*>(a.dst);
  const auto* src = static_cast<const char*>(a.src);
  for (size_t j = 0; j < rings[0].slices(); ++j) {
    Ring& ring = rings[j % rings.size()];
    char* owned = dst + ring.slice(ring.nb.position, j).offset * ring.elem;
    DK_RETURN_IF_ERROR(reduceScatterSlice(ring, j, src, dst, false, owned));
    DK_RETURN_IF_ERROR(allGatherSlice(ring, j, dst));
  }
  return finishAll(lanes);
}

Status ringReduceScatter(const Lanes& lanes, const CollectiveArgs& a) {
  if (lanes[0].transport.worldSize() == 1) return selfOnly(lanes[0], a, a.count);
  std::vector<Ring> rings = ringsOf(lanes, a, /*perRank=*/true);
  auto* dst = static_cast<char*>(a.dst);
  const Range own = rings[0].chunk(rings[0].nb.position);
  for (size_t j = 0; j < rings[0].slices(); ++j) {
    Ring& ring = rings[j % rings.size()];
    char* owned = dst + (ring.slice(ring.nb.position, j).offset - own.offset) * ring.elem;
    DK_RETURN_IF_ERROR(reduceScatterSlice(ring, j, static_cast<const char*>(a.src),
                                          static_cast<char*>(ring.ch.scratch), true, owned));
  }
  return finishAll(lanes);
}

Status ringAllGather(const Lanes& lanes, const CollectiveArgs& a) {
  std::vector<Ring> rings = ringsOf(lanes, a, /*perRank=*/true);
  auto* dst = static_cast<char*>(a.dst);
  const auto* src = static_cast<const char*>(a.src);
  const Range own = rings[0].chunk(rings[0].nb.position);
  // Our own slice j is copied into place by the lane that then sends it (on a GPU the lanes
  // are streams: a copy on another lane would not be ordered before the send).
  for (size_t j = 0; j < rings[0].slices(); ++j) {
    Ring& ring = rings[j % rings.size()];
    const Range mine = ring.slice(ring.nb.position, j);
    const char* from = src + (mine.offset - own.offset) * ring.elem;
    DK_RETURN_IF_ERROR(ring.ch.compute.copy(dst + mine.offset * ring.elem, from, ring.bytes(mine)));
    if (ring.n > 1) DK_RETURN_IF_ERROR(allGatherSlice(ring, j, dst));
  }
  return rings[0].n == 1 ? Status::Ok() : finishAll(lanes);
}

}  // namespace dk::algo
