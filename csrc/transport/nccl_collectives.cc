// NCCL's own collectives: see nccl_collectives.h.
#include "transport/nccl_collectives.h"

#include <string>

namespace dk::nccl {

Status allReduce(NcclComm& comm, const void* send, void* recv, size_t count, DType dtype, RedOp op,
                 void* stream) {
  ncclDataType_t type;
  ncclRedOp_t nccl_op;
  DK_RETURN_IF_ERROR(toNcclType(dtype, &type));
  DK_RETURN_IF_ERROR(toNcclOp(op, &nccl_op));
  DK_CHECK_NCCL(comm.api(), allReduce(send, recv, count, type, nccl_op, comm.handle(), stream));
  return Status::Ok();
}

Status reduceScatter(NcclComm& comm, const void* send, void* recv, size_t count, DType dtype,
                     RedOp op, void* stream) {
  ncclDataType_t type;
  ncclRedOp_t nccl_op;
  DK_RETURN_IF_ERROR(toNcclType(dtype, &type));
  DK_RETURN_IF_ERROR(toNcclOp(op, &nccl_op));
  DK_CHECK_NCCL(comm.api(), reduceScatter(send, recv, count, type, nccl_op, comm.handle(), stream));
  return Status::Ok();
}

Status allGather(NcclComm& comm, const void* send, void* recv, size_t count, DType dtype,
                 void* stream) {
  ncclDataType_t type;
  DK_RETURN_IF_ERROR(toNcclType(dtype, &type));
  DK_CHECK_NCCL(comm.api(), allGather(send, recv, count, type, comm.handle(), stream));
  return Status::Ok();
}

Status broadcast(NcclComm& comm, const void* send, void* recv, size_t count, DType dtype, int root,
                 void* stream) {
  if (root < 0 || root >= comm.worldSize()) {
    return InvalidArgument("root " + std::to_string(root) +
                           " is not in [0, world_size=" + std::to_string(comm.worldSize()) + ")");
  }
  ncclDataType_t type;
  DK_RETURN_IF_ERROR(toNcclType(dtype, &type));
  DK_CHECK_NCCL(comm.api(), broadcast(send, recv, count, type, root, comm.handle(), stream));
  return Status::Ok();
}

}  // namespace dk::nccl
