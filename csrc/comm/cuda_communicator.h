// The CUDA communicator of one rank: the ring and tree of csrc/algorithm/, unchanged, driven by
// NcclTransport (ncclSend / ncclRecv) and CudaCompute (our reduce kernels), everything enqueued
// on the communicator's stream. The host only issues work: a collective returns once enqueued,
// and the Python layer orders the stream against the caller's with CUDA events.
//
// Same answer everywhere: the ring reduces every element of chunk c in one fixed rank order and
// all-gathers that one result; the tree copies the root's result down. Our kernels accumulate
// FP16/BF16 in FP32 and round once per step, identically on every rank.
// CUDA builds only.
#pragma once

#if DK_WITH_CUDA

#include <memory>

#include "algorithm/collective.h"
#include "algorithm/cuda_compute.h"
#include "transport/nccl_comm.h"
#include "transport/nccl_transport.h"

namespace dk {

class CudaCommunicator {
 public:
  // `comm` (NCCL), `stream` (cudaStream_t), `staging` (num_slots * slot_bytes device bytes) and
  // `scratch` (slot_bytes device bytes) are owned by the Python communicator and outlive this.
  static Status create(nccl::NcclComm* comm, void* stream, void* staging, size_t slot_bytes,
                       int num_slots, void* scratch, std::unique_ptr<CudaCommunicator>* out);

  int rank() const { return transport_->rank(); }
  int worldSize() const { return transport_->worldSize(); }

  // algorithm: kRing or kTree (the Python layer resolves "auto" and "nccl").
  Status allReduce(const void* src, void* dst, size_t count, DType dtype, RedOp op,
                   algo::Algorithm algorithm);
  Status reduceScatter(const void* src, void* dst, size_t count, DType dtype, RedOp op);
  Status allGather(const void* src, void* dst, size_t count, DType dtype);
  Status broadcast(void* data, size_t count, DType dtype, int root);

 private:
  CudaCommunicator(std::unique_ptr<nccl::NcclTransport> transport, void* stream, void* scratch)
      : transport_(std::move(transport)), compute_(stream), scratch_(scratch) {}

  algo::Channel channel() { return algo::Channel{*transport_, compute_}; }
  algo::CollectiveArgs args(const void* src, void* dst, size_t count, DType dtype, RedOp op,
                            int root) const;

  std::unique_ptr<nccl::NcclTransport> transport_;
  CudaCompute compute_;
  void* scratch_;
};

}  // namespace dk

#endif  // DK_WITH_CUDA
