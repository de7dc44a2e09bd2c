#include "algorithm/point_to_point.h"

#include <vector>

#include "algorithm/topology.h"

namespace dk::algo {

Status sendTo(Channel ch, const CollectiveArgs& a) {
  const size_t elem = dtypeSize(a.dtype);
  const size_t sliceElems = ch.transport.maxMessageBytes() / elem;
  const auto* src = static_cast<const char*>(a.src);
  for (size_t j = 0; j < numSlices(a.count, sliceElems); ++j) {
    const Range r = sliceRange({0, a.count}, sliceElems, j);
    SendOp send{a.root, src + r.offset * elem, r.count * elem};
    DK_RETURN_IF_ERROR(ch.transport.exchange(&send, 1, nullptr, 0));
  }
  return ch.transport.finish();
}

Status recvFrom(Channel ch, const CollectiveArgs& a) {
  const size_t elem = dtypeSize(a.dtype);
  const size_t sliceElems = ch.transport.maxMessageBytes() / elem;
  auto* dst = static_cast<char*>(a.dst);
  for (size_t j = 0; j < numSlices(a.count, sliceElems); ++j) {
    const Range r = sliceRange({0, a.count}, sliceElems, j);
    RecvOp recv{a.root, r.count * elem};
    DK_RETURN_IF_ERROR(ch.transport.exchange(nullptr, 0, &recv, 1));
    DK_RETURN_IF_ERROR(ch.compute.copy(dst + r.offset * elem, recv.data, r.count * elem));
    DK_RETURN_IF_ERROR(ch.transport.release(&recv, 1));
  }
  // No finish(): a receive posted no sends, and finish() belongs to the send lane, which a
  // send on another thread may be using right now (ShmTransport's lanes).
  return Status::Ok();
}

Status barrier(Channel ch) {
  const int n = ch.transport.worldSize();
  const int rank = ch.transport.rank();
  if (ch.transport.fitsSmall(0)) {
    // One round: every rank raises its flag and waits for every other's (no bytes).
    std::vector<const void*> unused(n);
    DK_RETURN_IF_ERROR(ch.transport.exchangeSmall(nullptr, 0, unused.data()));
    return ch.transport.finish();
  }
  for (int dist = 1; dist < n; dist *= 2) {
    SendOp send{(rank + dist) % n, nullptr, 0};
    RecvOp recv{(rank - dist + n) % n, 0};
    DK_RETURN_IF_ERROR(ch.transport.exchange(&send, 1, &recv, 1));
    DK_RETURN_IF_ERROR(ch.transport.release(&recv, 1));
  }
  return ch.transport.finish();
}

}  // namespace dk::algo
