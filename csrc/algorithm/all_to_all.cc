// All-to-all by pairwise exchange: see all_to_all.h.
#include "algorithm/all_to_all.h"

#include <vector>

#include "algorithm/pairwise_exchange.h"

namespace dk::algo {

namespace {

// Byte offsets of the blocks laid back to back.
std::vector<size_t> blockOffsets(const size_t* counts, int n, size_t elem) {
  std::vector<size_t> offsets(n + 1, 0);
  for (int p = 0; p < n; ++p) offsets[p + 1] = offsets[p] + counts[p] * elem;
  return offsets;
}

}  // namespace

Status pairwiseAllToAll(Channel ch, const CollectiveArgs& a, const size_t* sendCounts,
                        const size_t* recvCounts) {
  const int n = ch.transport.worldSize();
  const int rank = ch.transport.rank();
  const size_t elem = dtypeSize(a.dtype);
  const std::vector<size_t> sendAt = blockOffsets(sendCounts, n, elem);
  const std::vector<size_t> recvAt = blockOffsets(recvCounts, n, elem);
  const auto* src = static_cast<const char*>(a.src);
  auto* dst = static_cast<char*>(a.dst);
  if (sendCounts[rank] != recvCounts[rank]) {
    return InvalidArgument("all_to_all: this rank sends itself " +
                           std::to_string(sendCounts[rank]) + " elements but expects " +
                           std::to_string(recvCounts[rank]));
  }
  // Step 0: our own block.
  DK_RETURN_IF_ERROR(
      ch.compute.copy(dst + recvAt[rank], src + sendAt[rank], sendCounts[rank] * elem));
  // Steps 1..n-1: send to rank + k while receiving from rank - k.
  for (int k = 1; k < n; ++k) {
    const int to = (rank + k) % n;
    const int from = (rank - k + n) % n;
    DK_RETURN_IF_ERROR(exchangeMessages(ch.transport, ch.compute, src + sendAt[to],
                                        sendCounts[to] * elem, to, dst + recvAt[from],
                                        recvCounts[from] * elem, from));
  }
  return ch.transport.finish();
}

}  // namespace dk::algo
