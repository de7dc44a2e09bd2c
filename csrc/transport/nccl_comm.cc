// NcclComm: see nccl_comm.h.
#include "transport/nccl_comm.h"

#include <string>

#include "cuda/cuda_status.h"

namespace dk::nccl {

namespace {

// NCCL binds the communicator to the calling thread's current device; -1 keeps that device.
Status bindDevice(int device) {
  if (device < 0) return Status::Ok();
#if DK_WITH_CUDA
  DK_CHECK_CUDA(cudaSetDevice(device));
  return Status::Ok();
#else
  return Unsupported("NCCL communicator on CUDA device " + std::to_string(device) +
                     ": dist_kernels was built without CUDA");
#endif
}

}  // namespace

Status NcclComm::newUniqueId(const NcclLibrary& library, ncclUniqueId* id) {
  DK_CHECK_NCCL(library.api, getUniqueId(id));
  return Status::Ok();
}

Status NcclComm::create(const NcclLibrary& library, const ncclUniqueId& id, int rank,
                        int world_size, int device, std::unique_ptr<NcclComm>* out) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return InvalidArgument("rank " + std::to_string(rank) +
                           " is not in [0, world_size=" + std::to_string(world_size) + ")");
  }
  DK_RETURN_IF_ERROR(bindDevice(device));
  ncclComm_t comm = nullptr;
  DK_CHECK_NCCL(library.api, commInitRank(&comm, world_size, id, rank));
  out->reset(new NcclComm(library, comm, rank, world_size, device));
  return Status::Ok();
}

NcclComm::~NcclComm() {
  // A destructor cannot report: errors here are dropped; close() reports them.
  if (comm_ != nullptr) library_.api.commDestroy(comm_);
}

Status NcclComm::checkOpen() const {
  if (comm_ == nullptr) return InvalidArgument("the NCCL communicator is closed");
  return Status::Ok();
}

Status NcclComm::close() {
  if (comm_ == nullptr) return Status::Ok();
  ncclComm_t comm = comm_;
  comm_ = nullptr;
  DK_CHECK_NCCL(library_.api, commDestroy(comm));
  return Status::Ok();
}

Status NcclComm::abort() {
  if (comm_ == nullptr) return Status::Ok();
  ncclComm_t comm = comm_;
  comm_ = nullptr;
  DK_CHECK_NCCL(library_.api, commAbort(comm));
  return Status::Ok();
}

Status NcclComm::asyncError(std::string* message) const {
  message->clear();
  DK_RETURN_IF_ERROR(checkOpen());
  ncclResult_t pending = ncclSuccess;
  DK_CHECK_NCCL(library_.api, commGetAsyncError(comm_, &pending));
  if (pending != ncclSuccess && pending != ncclInProgress) {
    *message = describeResult(library_.api, pending);
  }
  return Status::Ok();
}

}  // namespace dk::nccl
