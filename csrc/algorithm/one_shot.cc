#include "algorithm/one_shot.h"

#include <vector>

namespace dk::algo {

namespace {

// The one step: peer p gets `bytes` from base + p * peerStride (stride 0: the same bytes to
// every peer), nearest peer first (rank + 1, + 2, ...), so that no two ranks start by writing
// to the same peer; and `bytes` arrive from every peer into `recvs` (readable until release).
Status exchangeWithAll(Channel ch, const char* base, size_t peerStride, size_t bytes,
                       std::vector<RecvOp>* recvs) {
  const int n = ch.transport.worldSize();
  const int rank = ch.transport.rank();
  std::vector<SendOp> sends;
  sends.reserve(n - 1);
  recvs->reserve(n - 1);
  for (int d = 1; d < n; ++d) {
    const int peer = (rank + d) % n;
    sends.push_back({peer, base + static_cast<size_t>(peer) * peerStride, bytes});
    recvs->push_back({peer, bytes});
  }
  return ch.transport.exchange(sends.data(), n - 1, recvs->data(), n - 1);
}

// Reduce: srcs[r] = rank r's contribution, combined in rank order (the same expression on every
// rank), AVG dividing in the same pass. The CPU kernels allow dst to alias any one source
// exactly (kernels/reduce_cpu_impl.h): an in-place reduce-scatter's own chunk.
Status reduceInRankOrder(Channel ch, const CollectiveArgs& a, void* dst,
                         const std::vector<const void*>& srcs) {
  const int n = static_cast<int>(srcs.size());
  return a.op == RedOp::kAvg ? ch.compute.reduceAverage(dst, srcs.data(), n, a.count, a.dtype, n)
                             : ch.compute.reduceMulti(dst, srcs.data(), n, a.count, a.dtype, a.op);
}

// Frees the received slots, then waits until every peer has taken our sends.
Status releaseAndFinish(Channel ch, const std::vector<RecvOp>& recvs) {
  DK_RETURN_IF_ERROR(ch.transport.release(recvs.data(), static_cast<int>(recvs.size())));
  return ch.transport.finish();
}

}  // namespace

bool oneShotFits(const Transport& transport, size_t bytes) {
  return bytes <= transport.maxMessageBytes();
}

Status oneShotAllReduce(Channel ch, const CollectiveArgs& a) {
  const int rank = ch.transport.rank();
  const size_t bytes = a.count * dtypeSize(a.dtype);
  if (!oneShotFits(ch.transport, bytes)) return Internal("one-shot all_reduce: message too big");
  std::vector<const void*> srcs(ch.transport.worldSize());
  srcs[rank] = a.src;
  if (ch.transport.fitsSmall(bytes)) {
    // Publish and read in one step, nothing to hand back (transport.h).
    DK_RETURN_IF_ERROR(ch.transport.exchangeSmall(a.src, bytes, srcs.data()));
    return reduceInRankOrder(ch, a, a.dst, srcs);
  }
  // Publish: our input to every peer.
  std::vector<RecvOp> recvs;
  DK_RETURN_IF_ERROR(exchangeWithAll(ch, static_cast<const char*>(a.src), 0, bytes, &recvs));
  // Reduce: every input, in rank order.
  for (const RecvOp& recv : recvs) srcs[recv.peer] = recv.data;
  DK_RETURN_IF_ERROR(reduceInRankOrder(ch, a, a.dst, srcs));
  return releaseAndFinish(ch, recvs);
}

Status oneShotReduceScatter(Channel ch, const CollectiveArgs& a) {
  const int rank = ch.transport.rank();
  const size_t bytes = a.count * dtypeSize(a.dtype);
  if (!oneShotFits(ch.transport, bytes)) {
    return Internal("one-shot reduce_scatter: chunk too big");
  }
  const auto* in = static_cast<const char*>(a.src);
  const int n = ch.transport.worldSize();
  const size_t mine = static_cast<size_t>(rank) * bytes;
  std::vector<const void*> srcs(n);
  srcs[rank] = in + mine;
  const size_t whole = static_cast<size_t>(n) * bytes;
  if (ch.transport.fitsSmall(whole)) {
    // Every rank publishes its whole input once; each reads its own chunk of every peer's.
    DK_RETURN_IF_ERROR(ch.transport.exchangeSmall(in, whole, srcs.data()));
    for (int p = 0; p < n; ++p) {
      if (p != rank) srcs[p] = static_cast<const char*>(srcs[p]) + mine;
    }
    return reduceInRankOrder(ch, a, a.dst, srcs);
  }
  // Scatter: chunk p of our input to peer p.
  std::vector<RecvOp> recvs;
  DK_RETURN_IF_ERROR(exchangeWithAll(ch, in, bytes, bytes, &recvs));
  // Reduce: every rank's chunk `rank`, in rank order.
  for (const RecvOp& recv : recvs) srcs[recv.peer] = recv.data;
  DK_RETURN_IF_ERROR(reduceInRankOrder(ch, a, a.dst, srcs));
  return releaseAndFinish(ch, recvs);
}

Status oneShotAllGather(Channel ch, const CollectiveArgs& a) {
  const int rank = ch.transport.rank();
  const size_t bytes = a.count * dtypeSize(a.dtype);
  if (!oneShotFits(ch.transport, bytes)) return Internal("one-shot all_gather: chunk too big");
  auto* out = static_cast<char*>(a.dst);
  if (ch.transport.fitsSmall(bytes)) {
    const int n = ch.transport.worldSize();
    std::vector<const void*> chunks(n);
    // Published before the own chunk is copied: in place, the input is that chunk.
    DK_RETURN_IF_ERROR(ch.transport.exchangeSmall(a.src, bytes, chunks.data()));
    chunks[rank] = a.src;
    for (int p = 0; p < n; ++p) {
      DK_RETURN_IF_ERROR(ch.compute.copy(out + static_cast<size_t>(p) * bytes, chunks[p], bytes));
    }
    return Status::Ok();
  }
  // Own chunk first: the input may be that very chunk of the output (in place).
  DK_RETURN_IF_ERROR(ch.compute.copy(out + static_cast<size_t>(rank) * bytes, a.src, bytes));
  // Publish: our chunk to every peer.
  std::vector<RecvOp> recvs;
  DK_RETURN_IF_ERROR(exchangeWithAll(ch, static_cast<const char*>(a.src), 0, bytes, &recvs));
  // Copy: peer p's chunk to chunk p.
  for (const RecvOp& recv : recvs) {
    DK_RETURN_IF_ERROR(
        ch.compute.copy(out + static_cast<size_t>(recv.peer) * bytes, recv.data, bytes));
  }
  return releaseAndFinish(ch, recvs);
}

Status oneShotBroadcast(Channel ch, const CollectiveArgs& a) {
  const int n = ch.transport.worldSize();
  const size_t bytes = a.count * dtypeSize(a.dtype);
  if (!ch.transport.fitsSmall(bytes)) return Internal("one-shot broadcast: too big");
  std::vector<const void*> boxes(n);
  // Every rank publishes its buffer (the same byte count, so the descriptors compare); the
  // others' bytes are not read.
  DK_RETURN_IF_ERROR(ch.transport.exchangeSmall(a.src, bytes, boxes.data()));
  if (ch.transport.rank() == a.root) return Status::Ok();
  return ch.compute.copy(a.dst, boxes[a.root], bytes);
}

}  // namespace dk::algo
