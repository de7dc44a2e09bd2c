// NcclTransport: the Transport interface over ncclSend / ncclRecv on one stream, so that the
// same ring and tree code that runs over shared memory runs on GPUs.
//
// Staging: receives that the algorithm reduces land in `num_slots` slots of `slot_bytes` each,
// carved from one buffer that its owner (the NcclCommunicator) lends; a slot is handed out by
// exchange() and comes back with release(). A receive with RecvOp::into set (a final slice the
// algorithm would only copy) lands there directly and takes no slot.
//
// Why release() needs no device synchronisation: every ncclRecv into a slot and every kernel
// that reads it are enqueued on the one stream, in the host order the algorithm calls them. The
// algorithm releases a slot only after it has enqueued the reads of it, so any later ncclRecv
// into that slot sits behind those reads on the stream. Host bookkeeping (which slots are out)
// is all that is left, and it catches an algorithm that holds more receives than there are slots.
//
// In every build: it calls NCCL only through the loaded table and CUDA not at all, so a CPU-only
// build drives it over host memory with a fake NCCL (stream null), as the CPU tests do.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "transport/nccl_comm.h"
#include "transport/transport.h"

namespace dk::nccl {

class NcclTransport final : public Transport {
 public:
  // `slot_bytes` is a positive multiple of 256 so that every slot is aligned for vector loads;
  // `stream` is a cudaStream_t (null for host memory). `comm` and `stream` must outlive the
  // transport; the staging comes with setStaging() before the first exchange().
  static Status create(NcclComm* comm, void* stream, size_t slot_bytes, int num_slots,
                       std::unique_ptr<NcclTransport>* out);

  int rank() const override { return comm_->rank(); }
  int worldSize() const override { return comm_->worldSize(); }
  bool deviceMemory() const override { return stream_ != nullptr; }
  size_t maxMessageBytes() const override { return slot_bytes_; }

  // ncclGroupStart; ncclSend per send; ncclRecv per receive (into a free slot, or its `into`);
  // ncclGroupEnd.
  Status exchange(const SendOp* sends, int nsends, RecvOp* recvs, int nrecvs) override;
  // Marks the receives' slots free (see the file comment: stream order protects their reuse).
  Status release(const RecvOp* recvs, int nrecvs) override;
  // Nothing to wait for on the host: the collective's completion is a point on the stream.
  Status finish() override { return Status::Ok(); }

  // The staging of the next collectives: num_slots * slot_bytes bytes (the communicator's own,
  // or one a captured CUDA graph allocated for itself). Fails while a slot is still out.
  Status setStaging(void* staging);
  size_t stagingBytes() const { return slot_bytes_ * slot_busy_.size(); }
  void* stream() const { return stream_; }
  NcclComm& comm() const { return *comm_; }

 private:
  NcclTransport(NcclComm* comm, void* stream, size_t slot_bytes, int num_slots)
      : comm_(comm), stream_(stream), slot_bytes_(slot_bytes), slot_busy_(num_slots, false) {}

  Status takeSlot(char** slot);
  Status postRecvs(RecvOp* recvs, int nrecvs);
  Status postSends(const SendOp* sends, int nsends);

  NcclComm* comm_;
  void* stream_;
  char* staging_ = nullptr;
  size_t slot_bytes_;
  std::vector<bool> slot_busy_;
  size_t next_slot_ = 0;  // round-robin start of the search for a free slot
};

}  // namespace dk::nccl
