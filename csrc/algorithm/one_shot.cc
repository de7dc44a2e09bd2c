#include "algorithm/one_shot.h"

#include <vector>

namespace dk::algo {

bool oneShotFits(const Transport& transport, size_t bytes) {
  return bytes <= transport.maxMessageBytes();
}

Status oneShotAllReduce(Channel ch, const CollectiveArgs& a) {
  const int n = ch.transport.worldSize();
  const int rank = ch.transport.rank();
  const size_t bytes = a.count * dtypeSize(a.dtype);
  if (!oneShotFits(ch.transport, bytes)) return Internal("one-shot all_reduce: message too big");
  std::vector<SendOp> sends;
  std::vector<RecvOp> recvs;
  sends.reserve(n - 1);
  recvs.reserve(n - 1);
  // Publish: our input to every peer, nearest first (rank + 1, + 2, ...), so that no two
  // ranks start by writing to the same peer.
  for (int d = 1; d < n; ++d) {
    const int peer = (rank + d) % n;
    sends.push_back({peer, a.src, bytes});
    recvs.push_back({peer, bytes});
  }
  DK_RETURN_IF_ERROR(ch.transport.exchange(sends.data(), n - 1, recvs.data(), n - 1));
  // Reduce: every input, in rank order (the same expression on every rank).
  std::vector<const void*> srcs(n);
  srcs[rank] = a.src;
  for (const RecvOp& recv : recvs) srcs[recv.peer] = recv.data;
  Status reduced = a.op == RedOp::kAvg
                       ? ch.compute.reduceAverage(a.dst, srcs.data(), n, a.count, a.dtype, n)
                       : ch.compute.reduceMulti(a.dst, srcs.data(), n, a.count, a.dtype, a.op);
  DK_RETURN_IF_ERROR(reduced);
  DK_RETURN_IF_ERROR(ch.transport.release(recvs.data(), n - 1));
  return ch.transport.finish();
}

}  // namespace dk::algo
