#include "comm/tagged_receive.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <string>

#include "algorithm/point_to_point.h"

namespace dk {

namespace {

Status disagree(int peer, const shm::MessageHeader& theirs, int rank,
                const shm::MessageHeader& mine) {
  return Status(Code::kMismatch, "ranks disagree: rank " + std::to_string(peer) + " sent " +
                                     shm::describeHeader(theirs) + " but rank " +
                                     std::to_string(rank) + " called " + shm::describeHeader(mine));
}

algo::CollectiveArgs from(const algo::CollectiveArgs& args, int peer) {
  algo::CollectiveArgs out = args;
  out.root = peer;
  return out;
}

}  // namespace

Status TaggedReceiver::receive(algo::Channel ch, shm::ShmTransport& transport,
                               const shm::MessageHeader& expected,
                               const algo::CollectiveArgs& args) {
  const int peer = args.root;
  for (;;) {
    Status taken;
    if (takeSetAside(peer, expected, args, transport.rank(), &taken)) return taken;
    shm::MessageHeader next;
    DK_RETURN_IF_ERROR(transport.peekMessage(peer, &next));
    if (!shm::isPointToPoint(next) || next.op == expected.op) return algo::recvFrom(ch, args);
    DK_RETURN_IF_ERROR(setAside(ch, transport, peer, next, expected));
  }
}

Status TaggedReceiver::receiveAny(algo::Channel ch, shm::ShmTransport& transport,
                                  const shm::MessageHeader& expected,
                                  const algo::CollectiveArgs& args, int* source) {
  const int n = static_cast<int>(setAside_.size());
  for (;;) {
    for (int peer = 0; peer < n; ++peer) {
      Status taken;
      if (takeSetAside(peer, expected, args, transport.rank(), &taken)) {
        *source = peer;
        return taken;
      }
    }
    int peer = -1;
    DK_RETURN_IF_ERROR(transport.waitAnySource(&peer));  // a peer with a send's message
    shm::MessageHeader next;
    DK_RETURN_IF_ERROR(transport.peekMessage(peer, &next));
    if (next.op == expected.op) {
      *source = peer;
      return algo::recvFrom(ch, from(args, peer));
    }
    DK_RETURN_IF_ERROR(setAside(ch, transport, peer, next, expected));
  }
}

bool TaggedReceiver::takeSetAside(int peer, const shm::MessageHeader& expected,
                                  const algo::CollectiveArgs& args, int rank, Status* status) {
  std::deque<Message>& kept = setAside_[static_cast<size_t>(peer)];
  const auto it = std::find_if(kept.begin(), kept.end(),
                               [&](const Message& m) { return m.header.op == expected.op; });
  if (it == kept.end()) return false;
  if (it->header != expected) {
    *status = disagree(peer, it->header, rank, expected);
    return true;
  }
  if (!it->bytes.empty()) std::memcpy(args.dst, it->bytes.data(), it->bytes.size());
  kept.erase(it);
  *status = Status::Ok();
  return true;
}

Status TaggedReceiver::setAside(algo::Channel ch, shm::ShmTransport& transport, int peer,
                                const shm::MessageHeader& next,
                                const shm::MessageHeader& expected) {
  if (!isValidDType(static_cast<int>(next.dtype))) {
    return disagree(peer, next, transport.rank(), expected);
  }
  Message message{next, {}};
  const auto dtype = static_cast<DType>(next.dtype);
  try {
    message.bytes.resize(next.count * dtypeSize(dtype));
  } catch (const std::bad_alloc&) {
    return Status(Code::kInternal,
                  "rank " + std::to_string(transport.rank()) + " could not allocate " +
                      std::to_string(next.count * dtypeSize(dtype)) + " bytes to set aside " +
                      shm::describeHeader(next) + " from rank " + std::to_string(peer) +
                      " while a receive waits for another tag");
  }
  algo::CollectiveArgs theirs;
  theirs.dst = message.bytes.data();
  theirs.count = next.count;
  theirs.dtype = dtype;
  theirs.root = peer;
  transport.expect(next);
  const Status status = algo::recvFrom(ch, theirs);
  transport.expect(expected);
  DK_RETURN_IF_ERROR(status);
  setAside_[static_cast<size_t>(peer)].push_back(std::move(message));
  return Status::Ok();
}

}  // namespace dk
