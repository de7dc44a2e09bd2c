// Tagged receives over the shared-memory transport.
//
// torch's point-to-point calls carry a tag, and gloo and MPI give a receive the oldest message
// from its source with its tag, whatever came before it (NCCL ignores tags). The transport
// delivers each pair's messages in the order they were sent, and a send's header carries its
// tag (MessageHeader::op). So a receive looks at the next message from its source first: one
// with its tag, or a collective's (whose mismatch the transport reports as before), is received
// as it is, straight from the transport; one with another tag is received whole into memory of
// its own and set aside for the receive that names that tag. Messages sent in the order they
// are received (the common case) are never copied twice, and a sender is never held up by a
// receive that waits for a later tag.
#pragma once

#include <deque>
#include <vector>

#include "algorithm/collective.h"
#include "common/status.h"
#include "transport/shm_transport.h"

namespace dk {

class TaggedReceiver {
 public:
  explicit TaggedReceiver(int worldSize) : setAside_(static_cast<size_t>(worldSize)) {}

  // args.dst (args.count elements of args.dtype) from rank args.root: the oldest message from
  // it whose header equals `expected` in tag; any other difference fails as a disagreement.
  // Receive lane only.
  Status receive(algo::Channel ch, shm::ShmTransport& transport, const shm::MessageHeader& expected,
                 const algo::CollectiveArgs& args);
  // The same from whichever rank has such a message first; *source is set to it.
  Status receiveAny(algo::Channel ch, shm::ShmTransport& transport,
                    const shm::MessageHeader& expected, const algo::CollectiveArgs& args,
                    int* source);

 private:
  struct Message {
    shm::MessageHeader header;
    std::vector<unsigned char> bytes;
  };
  // Copies `peer`'s oldest set-aside message with expected's tag into args.dst and drops it
  // (*status: Ok, or the disagreement); false when `peer` has none.
  bool takeSetAside(int peer, const shm::MessageHeader& expected, const algo::CollectiveArgs& args,
                    int rank, Status* status);
  // Receives `peer`'s next message, whose header is `next`, whole, and keeps it.
  Status setAside(algo::Channel ch, shm::ShmTransport& transport, int peer,
                  const shm::MessageHeader& next, const shm::MessageHeader& expected);

  std::vector<std::deque<Message>> setAside_;  // per source, in arrival order
};

}  // namespace dk
