// NcclTransport: the Transport interface over ncclSend / ncclRecv on the communicator's stream,
// so that the same ring and tree code that runs over shared memory runs on GPUs.
//
// Staging: receives land in `num_slots` device slots of `slot_bytes` each, carved from one
// buffer that the Python communicator owns (C++ borrows it). A slot is handed out by exchange()
// and comes back with release().
//
// Why release() needs no device synchronisation: every ncclRecv into a slot and every kernel
// that reads it are enqueued on the one stream, in the host order the algorithm calls them. The
// algorithm releases a slot only after it has enqueued the reads of it, so any later ncclRecv
// into that slot sits behind those reads on the stream. Host bookkeeping (which slots are out)
// is all that is left, and it catches an algorithm that holds more receives than there are slots.
// CUDA builds only.
#pragma once

#if DK_WITH_CUDA

#include <cstddef>
#include <vector>

#include "transport/nccl_comm.h"
#include "transport/transport.h"

namespace dk::nccl {

class NcclTransport final : public Transport {
 public:
  // `staging` is device memory of num_slots * slot_bytes bytes (slot_bytes a multiple of 256 so
  // that every slot is aligned for vector loads); `stream` is a cudaStream_t. Both, and `comm`,
  // must outlive the transport.
  static Status create(NcclComm* comm, void* stream, void* staging, size_t slot_bytes,
                       int num_slots, std::unique_ptr<NcclTransport>* out);

  int rank() const override { return comm_->rank(); }
  int worldSize() const override { return comm_->worldSize(); }
  bool deviceMemory() const override { return true; }
  size_t maxMessageBytes() const override { return slot_bytes_; }

  // ncclGroupStart; ncclSend per send; ncclRecv per receive into a free slot; ncclGroupEnd.
  Status exchange(const SendOp* sends, int nsends, RecvOp* recvs, int nrecvs) override;
  // Marks the receives' slots free (see the file comment: stream order protects their reuse).
  Status release(const RecvOp* recvs, int nrecvs) override;
  // Nothing to wait for on the host: the collective's completion is a point on the stream.
  Status finish() override { return Status::Ok(); }

  void* stream() const { return stream_; }

 private:
  NcclTransport(NcclComm* comm, void* stream, char* staging, size_t slot_bytes, int num_slots)
      : comm_(comm),
        stream_(stream),
        staging_(staging),
        slot_bytes_(slot_bytes),
        slot_busy_(num_slots, false) {}

  Status takeSlot(char** slot);
  Status postRecvs(RecvOp* recvs, int nrecvs);

  NcclComm* comm_;
  void* stream_;
  char* staging_;
  size_t slot_bytes_;
  std::vector<bool> slot_busy_;
  size_t next_slot_ = 0;  // round-robin start of the search for a free slot
};

}  // namespace dk::nccl

#endif  // DK_WITH_CUDA
