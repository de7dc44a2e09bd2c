// Pairwise exchange: see pairwise_exchange.h.
#include "algorithm/pairwise_exchange.h"

#include <algorithm>
#include <string>

namespace dk {

namespace {

Status checkPeer(const Transport& transport, int peer, const char* what) {
  if (peer < transport.worldSize()) return Status::Ok();
  return InvalidArgument(std::string(what) + " peer " + std::to_string(peer) +
                         " is not in [0, world_size=" + std::to_string(transport.worldSize()) +
                         ")");
}

}  // namespace

Status exchangeMessages(Transport& transport, Compute& compute, const void* send, size_t send_bytes,
                        int send_peer, void* recv, size_t recv_bytes, int recv_peer) {
  DK_RETURN_IF_ERROR(checkPeer(transport, send_peer, "send"));
  DK_RETURN_IF_ERROR(checkPeer(transport, recv_peer, "recv"));
  if (send_peer < 0) send_bytes = 0;
  if (recv_peer < 0) recv_bytes = 0;
  const size_t message = transport.maxMessageBytes();
  // Both sides cut at the same message size, so message k of the sender matches message k of
  // the receiver; the longer side simply continues alone.
  for (size_t offset = 0; offset < std::max(send_bytes, recv_bytes); offset += message) {
    SendOp sendOp{send_peer, static_cast<const char*>(send) + offset, 0};
    RecvOp recvOp{recv_peer, 0};
    if (offset < send_bytes) sendOp.bytes = std::min(message, send_bytes - offset);
    if (offset < recv_bytes) recvOp.bytes = std::min(message, recv_bytes - offset);
    const int nsends = sendOp.bytes > 0 ? 1 : 0;
    const int nrecvs = recvOp.bytes > 0 ? 1 : 0;
    DK_RETURN_IF_ERROR(transport.exchange(&sendOp, nsends, &recvOp, nrecvs));
    if (nrecvs == 1) {
      DK_RETURN_IF_ERROR(
          compute.copy(static_cast<char*>(recv) + offset, recvOp.data, recvOp.bytes));
      DK_RETURN_IF_ERROR(transport.release(&recvOp, 1));
    }
  }
  return Status::Ok();
}

Status pairwiseExchange(Transport& transport, Compute& compute, const void* send, size_t send_bytes,
                        int send_peer, void* recv, size_t recv_bytes, int recv_peer) {
  DK_RETURN_IF_ERROR(exchangeMessages(transport, compute, send, send_bytes, send_peer, recv,
                                      recv_bytes, recv_peer));
  return transport.finish();
}

}  // namespace dk
