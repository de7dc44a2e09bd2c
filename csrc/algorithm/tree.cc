// Bytes moved per rank for S bytes (registered tensors; a plain tensor adds one slot copy per
// send): all_reduce interior rank of one tree: up r = S/2 x 3 (own + two children), w = S/2;
// down r = S/2, w = S/2; leaf of the other tree: nothing up, down r = S/2 w = S/2.
// Broadcast: every non-root rank reads S and writes S once.
#include "algorithm/tree.h"

namespace dk::algo {

namespace {

struct TreeWalk {
  Channel ch;
  const CollectiveArgs& args;
  size_t elem;
  size_t sliceElems;

  char* at(Range r) const { return static_cast<char*>(args.dst) + r.offset * elem; }

  // up: receive the children's partial sums of slice `r`, add our own, send to the parent. The
  // root's reduce completes the sum: AVG divides there, in the same pass.
  Status reduceUp(const TreeNode& node, Range r, int worldSize) const {
    RecvOp recvs[2];
    for (int i = 0; i < node.numChildren; ++i) recvs[i] = RecvOp{node.children[i], r.count * elem};
    DK_RETURN_IF_ERROR(ch.transport.exchange(nullptr, 0, recvs, node.numChildren));
    // Fixed order: own value, then the children in tree order.
    const void* srcs[3] = {static_cast<const char*>(args.src) + r.offset * elem, recvs[0].data,
                           recvs[1].data};
    const int nsrcs = 1 + node.numChildren;
    const bool root = node.parent < 0;
    if (root && args.op == RedOp::kAvg) {
      DK_RETURN_IF_ERROR(
          ch.compute.reduceAverage(at(r), srcs, nsrcs, r.count, args.dtype, worldSize));
    } else if (nsrcs > 1) {
      DK_RETURN_IF_ERROR(ch.compute.reduceMulti(at(r), srcs, nsrcs, r.count, args.dtype, args.op));
    } else {
      DK_RETURN_IF_ERROR(ch.compute.copy(at(r), srcs[0], r.count * elem));
    }
    if (node.numChildren > 0) DK_RETURN_IF_ERROR(ch.transport.release(recvs, node.numChildren));
    if (root) return Status::Ok();
    SendOp send{node.parent, at(r), r.count * elem};
    return ch.transport.exchange(&send, 1, nullptr, 0);
  }

  // down: receive slice `r` from the parent into dst (straight there where the transport can:
  // RecvOp::into), forward it to the children.
  Status copyDown(const TreeNode& node, Range r) const {
    if (node.parent >= 0) {
      RecvOp recv{node.parent, r.count * elem, at(r)};
      DK_RETURN_IF_ERROR(ch.transport.exchange(nullptr, 0, &recv, 1));
      if (recv.data != at(r)) DK_RETURN_IF_ERROR(ch.compute.copy(at(r), recv.data, recv.bytes));
      DK_RETURN_IF_ERROR(ch.transport.release(&recv, 1));
    }
    SendOp sends[2];
    for (int i = 0; i < node.numChildren; ++i)
      sends[i] = SendOp{node.children[i], at(r), r.count * elem};
    return ch.transport.exchange(sends, node.numChildren, nullptr, 0);
  }
};

// Ends the collective on every lane.
Status finishAll(const Lanes& lanes) {
  for (int l = 0; l < lanes.count(); ++l) DK_RETURN_IF_ERROR(lanes[l].transport.finish());
  return Status::Ok();
}

}  // namespace

Status treeAllReduce(const Lanes& lanes, const CollectiveArgs& a) {
  const Channel& first = lanes[0];
  const int n = first.transport.worldSize();
  const size_t elem = dtypeSize(a.dtype);
  if (n == 1) return first.compute.copy(a.dst, a.src, a.count * elem);
  const size_t sliceElems = first.transport.maxMessageBytes() / elem;
  // Tree t travels lane t: with two lanes the trees' reduces and transfers overlap.
  const TreeWalk walks[2] = {{lanes[0], a, elem, sliceElems}, {lanes[1], a, elem, sliceElems}};
  const TreeNode nodes[2] = {doubleTreeNode(0, n, first.transport.rank()),
                             doubleTreeNode(1, n, first.transport.rank())};
  const Range halves[2] = {chunkRange(a.count, 2, 0, 64 / elem),
                           chunkRange(a.count, 2, 1, 64 / elem)};
  const size_t slices = numSlices(halves[0].count, sliceElems);
  for (size_t j = 0; j < slices; ++j) {
    for (int t = 0; t < 2; ++t) {
      DK_RETURN_IF_ERROR(walks[t].reduceUp(nodes[t], sliceRange(halves[t], sliceElems, j), n));
    }
  }
  for (size_t j = 0; j < slices; ++j) {
    for (int t = 0; t < 2; ++t) {
      DK_RETURN_IF_ERROR(walks[t].copyDown(nodes[t], sliceRange(halves[t], sliceElems, j)));
    }
  }
  return finishAll(lanes);
}

Status treeBroadcast(const Lanes& lanes, const CollectiveArgs& a, bool chain) {
  const Channel& first = lanes[0];
  const int n = first.transport.worldSize();
  const size_t elem = dtypeSize(a.dtype);
  if (n == 1) return Status::Ok();
  const size_t sliceElems = first.transport.maxMessageBytes() / elem;
  const int rank = first.transport.rank();
  const TreeNode node = chain ? chainNode(n, a.root, rank) : heapTreeNode(n, a.root, rank);
  const Range all{0, a.count};
  // Slice j travels lane j: a chain's forward of slice j overlaps the receive of slice j+1.
  for (size_t j = 0; j < numSlices(a.count, sliceElems); ++j) {
    const TreeWalk walk{lanes[j], a, elem, sliceElems};
    DK_RETURN_IF_ERROR(walk.copyDown(node, sliceRange(all, sliceElems, j)));
  }
  return finishAll(lanes);
}

}  // namespace dk::algo
