// All-to-all in one exchange per message round: see all_to_all.h.
#include "algorithm/all_to_all.h"

#include <algorithm>
#include <string>
#include <vector>

namespace dk::algo {

namespace {

// Byte offsets of the blocks laid back to back (offsets[p] .. offsets[p + 1] is block p).
std::vector<size_t> byteOffsets(const size_t* counts, int n, size_t elem) {
  std::vector<size_t> offsets(n + 1, 0);
  for (int p = 0; p < n; ++p) offsets[p + 1] = offsets[p] + counts[p] * elem;
  return offsets;
}

// Bytes of message `round` of a block of `blockBytes` (0 once the block is used up).
size_t messageBytes(size_t blockBytes, size_t round, size_t message) {
  const size_t offset = round * message;
  return offset < blockBytes ? std::min(message, blockBytes - offset) : 0;
}

size_t largestBlock(const std::vector<size_t>& offsets) {
  size_t largest = 0;
  for (size_t p = 0; p + 1 < offsets.size(); ++p) {
    largest = std::max(largest, offsets[p + 1] - offsets[p]);
  }
  return largest;
}

}  // namespace

Status oneShotAllToAll(Channel ch, const CollectiveArgs& a, const size_t* sendCounts,
                       const size_t* recvCounts) {
  const int n = ch.transport.worldSize();
  const int rank = ch.transport.rank();
  const size_t message = ch.transport.maxMessageBytes();
  const std::vector<size_t> sendAt = byteOffsets(sendCounts, n, dtypeSize(a.dtype));
  const std::vector<size_t> recvAt = byteOffsets(recvCounts, n, dtypeSize(a.dtype));
  const auto* src = static_cast<const char*>(a.src);
  auto* dst = static_cast<char*>(a.dst);
  if (sendCounts[rank] != recvCounts[rank]) {
    return InvalidArgument("all_to_all: this rank sends itself " +
                           std::to_string(sendCounts[rank]) + " elements but expects " +
                           std::to_string(recvCounts[rank]));
  }
  // Own block: one local copy.
  DK_RETURN_IF_ERROR(
      ch.compute.copy(dst + recvAt[rank], src + sendAt[rank], sendAt[rank + 1] - sendAt[rank]));
  const size_t rounds =
      (std::max(largestBlock(sendAt), largestBlock(recvAt)) + message - 1) / message;
  std::vector<SendOp> sends;
  std::vector<RecvOp> recvs;
  for (size_t round = 0; round < rounds; ++round) {
    sends.clear();
    recvs.clear();
    // Post: message `round` of every peer's block, nearest peer first.
    for (int d = 1; d < n; ++d) {
      const int to = (rank + d) % n;
      const int from = (rank - d + n) % n;
      const size_t out = messageBytes(sendAt[to + 1] - sendAt[to], round, message);
      const size_t in = messageBytes(recvAt[from + 1] - recvAt[from], round, message);
      if (out > 0) sends.push_back({to, src + sendAt[to] + round * message, out});
      if (in > 0) recvs.push_back({from, in});
    }
    DK_RETURN_IF_ERROR(ch.transport.exchange(sends.data(), static_cast<int>(sends.size()),
                                             recvs.data(), static_cast<int>(recvs.size())));
    // Copy: each received message to its place in the output, then free its slot.
    for (const RecvOp& recv : recvs) {
      DK_RETURN_IF_ERROR(
          ch.compute.copy(dst + recvAt[recv.peer] + round * message, recv.data, recv.bytes));
    }
    DK_RETURN_IF_ERROR(ch.transport.release(recvs.data(), static_cast<int>(recvs.size())));
  }
  return ch.transport.finish();
}

}  // namespace dk::algo
