// NcclTransport: see nccl_transport.h.
#include "transport/nccl_transport.h"

#include <algorithm>
#include <string>

namespace dk::nccl {

constexpr size_t kSlotAlignment = 256;  // cudaMalloc's alignment; keeps 16-byte vector loads legal

Status NcclTransport::create(NcclComm* comm, void* stream, size_t slot_bytes, int num_slots,
                             std::unique_ptr<NcclTransport>* out) {
  if (comm == nullptr || comm->handle() == nullptr) {
    return InvalidArgument("NcclTransport needs an open NCCL communicator");
  }
  if (num_slots < 1 || slot_bytes == 0 || slot_bytes % kSlotAlignment != 0) {
    return InvalidArgument("NcclTransport staging: need num_slots >= 1 slots of a positive " +
                           std::string("multiple of 256 bytes, got ") + std::to_string(num_slots) +
                           " x " + std::to_string(slot_bytes));
  }
  out->reset(new NcclTransport(comm, stream, slot_bytes, num_slots));
  return Status::Ok();
}

Status NcclTransport::setStaging(void* staging) {
  if (staging == nullptr) return InvalidArgument("NcclTransport: null staging");
  if (std::find(slot_busy_.begin(), slot_busy_.end(), true) != slot_busy_.end()) {
    return Internal("NcclTransport: staging changed while a receive holds a slot");
  }
  staging_ = static_cast<char*>(staging);
  return Status::Ok();
}

Status NcclTransport::takeSlot(char** slot) {
  if (staging_ == nullptr) return Internal("NcclTransport: no staging set");
  const size_t n = slot_busy_.size();
  for (size_t i = 0; i < n; ++i) {
    const size_t s = (next_slot_ + i) % n;
    if (!slot_busy_[s]) {
      slot_busy_[s] = true;
      next_slot_ = (s + 1) % n;
      *slot = staging_ + s * slot_bytes_;
      return Status::Ok();
    }
  }
  return Internal("NcclTransport: all " + std::to_string(n) +
                  " staging slots are held; the algorithm must release() receives sooner");
}

Status NcclTransport::postSends(const SendOp* sends, int nsends) {
  for (int i = 0; i < nsends; ++i) {
    if (sends[i].bytes > slot_bytes_) {
      return InvalidArgument("send of " + std::to_string(sends[i].bytes) +
                             " bytes exceeds maxMessageBytes " + std::to_string(slot_bytes_));
    }
    if (sends[i].bytes == 0) continue;
    DK_CHECK_NCCL(comm_->api(), send(sends[i].src, sends[i].bytes, ncclUint8, sends[i].peer,
                                     comm_->handle(), stream_));
  }
  return Status::Ok();
}

Status NcclTransport::postRecvs(RecvOp* recvs, int nrecvs) {
  for (int i = 0; i < nrecvs; ++i) {
    if (recvs[i].bytes > slot_bytes_) {
      return InvalidArgument("receive of " + std::to_string(recvs[i].bytes) +
                             " bytes exceeds maxMessageBytes " + std::to_string(slot_bytes_));
    }
    char* target = static_cast<char*>(recvs[i].into);
    if (target == nullptr) DK_RETURN_IF_ERROR(takeSlot(&target));
    recvs[i].data = target;
    if (recvs[i].bytes == 0) continue;
    DK_CHECK_NCCL(comm_->api(),
                  recv(target, recvs[i].bytes, ncclUint8, recvs[i].peer, comm_->handle(), stream_));
  }
  return Status::Ok();
}

Status NcclTransport::exchange(const SendOp* sends, int nsends, RecvOp* recvs, int nrecvs) {
  const NcclApi& api = comm_->api();
  // One group per step: NCCL matches this rank's sends and receives together, so a ring step
  // (send to next, receive from previous) cannot deadlock.
  DK_CHECK_NCCL(api, groupStart());
  Status status = postSends(sends, nsends);
  if (status.ok()) status = postRecvs(recvs, nrecvs);
  // The group is closed even after an error, so NCCL's group depth stays balanced.
  ncclResult_t end = api.groupEnd();
  DK_RETURN_IF_ERROR(status);
  if (end != ncclSuccess) return ncclError(api, end, "ncclGroupEnd");
  return Status::Ok();
}

Status NcclTransport::release(const RecvOp* recvs, int nrecvs) {
  for (int i = 0; i < nrecvs; ++i) {
    const char* data = static_cast<const char*>(recvs[i].data);
    if (recvs[i].into != nullptr && data == recvs[i].into) continue;  // took no slot
    if (staging_ == nullptr || data < staging_ || data >= staging_ + stagingBytes()) {
      return InvalidArgument("release() of a receive that is not in this transport's staging");
    }
    slot_busy_[static_cast<size_t>(data - staging_) / slot_bytes_] = false;
  }
  return Status::Ok();
}

}  // namespace dk::nccl
