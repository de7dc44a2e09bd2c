// NcclComm: one NCCL communicator (ncclComm_t) and the library table it was made from.
// Owned by the Python communicator (which exchanges the ncclUniqueId through the torch Store);
// NcclTransport and the NCCL collectives borrow it. In every build: it calls NCCL only through
// the loaded table, so a CPU-only build can drive a fake NCCL and test the error paths (abort,
// asynchronous errors, NCCL's messages) without a GPU.
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "transport/nccl_loader.h"

namespace dk::nccl {

class NcclComm {
 public:
  // A new ncclUniqueId (rank 0 makes it; the others receive it through the Store).
  static Status newUniqueId(const NcclLibrary& library, ncclUniqueId* id);

  // Joins the communicator `id` as `rank` of `world_size` on CUDA device `device` (-1: the
  // calling thread's current device, as NCCL itself binds it); blocks until every rank has
  // joined (call without the GIL). A device >= 0 in a CPU-only build is Unsupported.
  static Status create(const NcclLibrary& library, const ncclUniqueId& id, int rank, int world_size,
                       int device, std::unique_ptr<NcclComm>* out);

  ~NcclComm();  // destroys the communicator if close() was not called
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  // Destroys the communicator; later calls fail. Waits for its pending work on the device.
  Status close();
  // Aborts the communicator without waiting: for a peer that died mid-collective.
  Status abort();
  // NCCL's asynchronous error (a peer's network failure shows up here): Ok and *message empty
  // while there is none (or work is still in progress); otherwise *message says what NCCL
  // reported. A non-Ok Status means the query itself failed (e.g. the communicator is closed).
  Status asyncError(std::string* message) const;
  bool closed() const { return comm_ == nullptr; }

  ncclComm_t handle() const { return comm_; }
  const NcclApi& api() const { return library_.api; }
  int rank() const { return rank_; }
  int worldSize() const { return world_size_; }
  int device() const { return device_; }

 private:
  NcclComm(const NcclLibrary& library, ncclComm_t comm, int rank, int world_size, int device)
      : library_(library), comm_(comm), rank_(rank), world_size_(world_size), device_(device) {}

  Status checkOpen() const;

  const NcclLibrary& library_;
  ncclComm_t comm_;
  int rank_;
  int world_size_;
  int device_;
};

}  // namespace dk::nccl
