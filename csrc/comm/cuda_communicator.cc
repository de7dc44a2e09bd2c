// CudaCommunicator: see cuda_communicator.h.
#include "comm/cuda_communicator.h"

#if DK_WITH_CUDA

#include <string>

#include "algorithm/ring.h"
#include "algorithm/tree.h"

namespace dk {

Status CudaCommunicator::create(nccl::NcclComm* comm, void* stream, void* staging,
                                size_t slot_bytes, int num_slots, void* scratch,
                                std::unique_ptr<CudaCommunicator>* out) {
  if (scratch == nullptr) return InvalidArgument("CudaCommunicator needs a scratch buffer");
  std::unique_ptr<nccl::NcclTransport> transport;
  DK_RETURN_IF_ERROR(
      nccl::NcclTransport::create(comm, stream, staging, slot_bytes, num_slots, &transport));
  out->reset(new CudaCommunicator(std::move(transport), stream, scratch));
  return Status::Ok();
}

algo::CollectiveArgs CudaCommunicator::args(const void* src, void* dst, size_t count, DType dtype,
                                            RedOp op, int root) const {
  algo::CollectiveArgs a;
  a.src = src;
  a.dst = dst;
  a.count = count;
  a.dtype = dtype;
  a.op = op;
  a.root = root;
  a.scratch = scratch_;
  return a;
}

Status CudaCommunicator::allReduce(const void* src, void* dst, size_t count, DType dtype, RedOp op,
                                   algo::Algorithm algorithm) {
  const algo::CollectiveArgs a = args(src, dst, count, dtype, op, 0);
  switch (algorithm) {
    case algo::Algorithm::kRing:
      return algo::ringAllReduce(channel(), a);
    case algo::Algorithm::kTree:
      return algo::treeAllReduce(channel(), a);
    default:
      return InvalidArgument("CudaCommunicator::allReduce: algorithm must be ring or tree, got " +
                             std::to_string(static_cast<int>(algorithm)));
  }
}

Status CudaCommunicator::reduceScatter(const void* src, void* dst, size_t count, DType dtype,
                                       RedOp op) {
  return algo::ringReduceScatter(channel(), args(src, dst, count, dtype, op, 0));
}

Status CudaCommunicator::allGather(const void* src, void* dst, size_t count, DType dtype) {
  return algo::ringAllGather(channel(), args(src, dst, count, dtype, RedOp::kSum, 0));
}

Status CudaCommunicator::broadcast(void* data, size_t count, DType dtype, int root) {
  if (root < 0 || root >= worldSize()) {
    return InvalidArgument("root " + std::to_string(root) +
                           " is not in [0, world_size=" + std::to_string(worldSize()) + ")");
  }
  // Several slices: the chain pipelines them; one slice: the heap tree is shallower.
  const bool chain = count * dtypeSize(dtype) > transport_->maxMessageBytes();
  return algo::treeBroadcast(channel(), args(data, data, count, dtype, RedOp::kSum, root), chain);
}

}  // namespace dk

#endif  // DK_WITH_CUDA
