// The transport interface: moves bytes between two ranks of one communicator; no arithmetic.
// Backends: ShmTransport (CPU processes of one host, POSIX shared memory) and NcclTransport
// (ncclSend / ncclRecv on the communicator's stream). Algorithms (csrc/algorithm/) are written
// against this interface only, so the same ring and tree drive both.
//
// One algorithm step = one exchange(): post every send of the step, then complete every receive
// (NCCL needs the sends and receives of a step in one group to avoid deadlock; shared memory
// buffers sends, so the same order works there).
#pragma once

#include <cstddef>

#include "common/status.h"

namespace dk {

struct SendOp {
  int peer;         // rank in the communicator
  const void* src;  // host or device pointer, per Transport::deviceMemory()
  size_t bytes;     // at most maxMessageBytes()
};

struct RecvOp {
  int peer;
  size_t bytes;  // must equal the matching SendOp's bytes
  // Where the caller will copy the bytes anyway (the all-gather phase's output), or null. A
  // transport that receives into caller memory (NCCL) writes them there and sets data = into,
  // saving the copy; one that cannot (shared memory reads in place from the peer) ignores it.
  void* into = nullptr;
  const void* data = nullptr;  // set by exchange(): where the received bytes can be read
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int worldSize() const = 0;
  // True when pointers are CUDA device pointers and work is ordered on a stream.
  virtual bool deviceMemory() const = 0;
  // Largest message one SendOp may carry; algorithms cut their slices to fit.
  virtual size_t maxMessageBytes() const = 0;

  // Posts the sends, then completes the receives. On return (CPU), or once the stream reaches
  // this point (GPU), recvs[i].data points at recvs[i].bytes bytes from recvs[i].peer, readable
  // in place (for shared memory: straight from the peer's staging slot or registered buffer, so
  // the caller can reduce from it without a copy) until release().
  // Zero-copy sends: bytes that lie in registered memory may be read in place by the peer, so
  // the algorithm must not overwrite them before the peer has received them (ring and tree
  // guarantee it by their data dependencies); finish() waits until every peer is done.
  virtual Status exchange(const SendOp* sends, int nsends, RecvOp* recvs, int nrecvs) = 0;

  // Hands the receive buffers of an exchange back to the transport (frees the sender's slot);
  // a receive that landed in its `into` holds nothing and is skipped.
  virtual Status release(const RecvOp* recvs, int nrecvs) = 0;

  // Ends one collective: returns when every peer has consumed every send of this rank.
  virtual Status finish() = 0;

  // Small collectives: the largest message exchangeSmall() takes (0: it is not offered).
  virtual size_t smallMessageBytes() const { return 0; }
  // True if a message of `bytes` (0 included) may go through exchangeSmall().
  bool fitsSmall(size_t bytes) const {
    const size_t most = smallMessageBytes();
    return most > 0 && bytes <= most;
  }
  // Inside a collective: publishes this rank's `bytes` from `src` to every peer at once and
  // waits until every peer has published its own; then data[p] (an array of worldSize()
  // pointers; data[rank()] is left alone) points at peer p's bytes. Those stay readable until
  // this rank's next collective ends, and nothing is released or finished: one flag line
  // carries the message where exchange() costs a descriptor, a head, a tail and finish().
  // Every rank must call it in the same collective with the same byte count (a rank whose
  // descriptor differs fails every rank that reads it, as exchange() does).
  virtual Status exchangeSmall(const void* src, size_t bytes, const void** data) {
    (void)src, (void)bytes, (void)data;
    return Unsupported("small-message exchange is not supported by this transport");
  }

  // A receive from any source: waits until some peer has a point-to-point message for this
  // rank and sets *source to it; the caller then receives it from *source with exchange().
  // Peers are taken in turn (round robin), so a busy one cannot starve the others.
  virtual Status waitAnySource(int* source) {
    (void)source;
    return Unsupported("receiving from any source is not supported by this transport");
  }
};

}  // namespace dk
