// Pairwise exchange: send `send_bytes` to one peer while receiving `recv_bytes` from another,
// cut into messages of at most transport.maxMessageBytes(), each received message copied out of
// the transport's staging into `recv`. Point-to-point send/recv of the communicator, and the
// smallest whole use of a Transport + Compute pair (the GPU tests drive NcclTransport with it).
#pragma once

#include <cstddef>

#include "algorithm/compute.h"
#include "common/status.h"
#include "transport/transport.h"

namespace dk {

// Either side may be empty (bytes 0 or peer < 0) for a one-way send or receive.
// exchangeMessages() moves the bytes; pairwiseExchange() then ends the collective (finish()),
// so a caller that exchanges with several peers in a row (all-to-all) finishes once.
Status exchangeMessages(Transport& transport, Compute& compute, const void* send, size_t send_bytes,
                        int send_peer, void* recv, size_t recv_bytes, int recv_peer);
Status pairwiseExchange(Transport& transport, Compute& compute, const void* send, size_t send_bytes,
                        int send_peer, void* recv, size_t recv_bytes, int recv_peer);

}  // namespace dk
