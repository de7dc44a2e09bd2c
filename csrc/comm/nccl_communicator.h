// The communicator of one rank over NCCL: it owns the NCCL communicators (one per lane), each
// lane's NcclTransport, compute and stream, and the staging memory, and runs every collective of
// dist_kernels/comm/cuda.py: NCCL's own (algorithm "nccl") or the ring and tree of
// csrc/algorithm/ over NcclTransport. "auto" is resolved here (algo::chooseOnNccl), as the CPU
// communicator resolves it for shared memory.
//
// Device or host. device >= 0 (CUDA builds): device memory, CudaCompute; lane 0 runs on the
// caller-provided stream (the Python communicator's, which orders it against the caller's stream
// with events), the other lanes on streams of their own, forked from lane 0 and joined back
// around every ring or tree collective (lane_streams.h). device -1: host memory, CpuCompute, a
// null stream and the lanes one after another: what the CPU tests run against a fake NCCL.
//
// Lanes: two by default. Ring slices and tree halves alternate over them (collective.h), so the
// reduce of one slice overlaps the transfer of the next; each lane has its own NCCL communicator
// (NCCL orders the operations of one communicator, so one communicator would serialise them),
// and every rank issues the lanes' operations in the same order.
//
// Staging: per lane, num_slots slots of slot_bytes for receives plus slot_bytes of scratch,
// allocated at create(). A collective captured into a CUDA graph allocates its own on the
// capturing stream (cudaMallocAsync) and frees it at its end, inside the graph: a replay never
// shares the memory of eager calls (or of another graph), and the graph owns what it uses.
//
// The host only issues work: a collective returns once enqueued. A failed call after the first
// NCCL operation poisons the communicator (later calls fail with its cause), as on CPU.
// Not thread-safe: one caller thread at a time (the Python layer refuses concurrent calls).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "algorithm/collective.h"
#include "comm/lane_streams.h"
#include "transport/nccl_comm.h"
#include "transport/nccl_transport.h"

namespace dk {

class NcclCommunicator {
 public:
  struct Options {
    size_t slotBytes = size_t{4} << 20;
    int numSlots = 8;
  };

  // Joins one NCCL communicator per id (one lane each; every rank passes the same ids in the
  // same order) as `rank` of `worldSize` on `device`; blocks until every rank has joined (call
  // without the GIL). `stream` (a cudaStream_t; null for device -1) must outlive this object.
  static Status create(const nccl::NcclLibrary& library, const std::vector<nccl::ncclUniqueId>& ids,
                       int rank, int worldSize, int device, void* stream, Options options,
                       std::unique_ptr<NcclCommunicator>* out);
  ~NcclCommunicator();
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const { return rank_; }
  int worldSize() const { return worldSize_; }
  int device() const { return device_; }
  int lanes() const { return static_cast<int>(lanes_.size()); }
  size_t maxMessageBytes() const { return options_.slotBytes; }

  // What `requested` runs: "auto" -> chooseOnNccl; anything else as asked.
  algo::Algorithm resolve(algo::Algorithm requested, size_t bytes) const;

  // Counts as in torch.distributed: all_reduce and broadcast `count` elements; reduce_scatter
  // and all_gather `count` elements per rank. all_reduce and broadcast take ring, tree, nccl or
  // auto (broadcast's ring and tree both run ours, a chain or a heap tree by size);
  // reduce_scatter and all_gather ring, nccl or auto (they have no tree).
  Status allReduce(const void* src, void* dst, size_t count, DType dtype, RedOp op,
                   algo::Algorithm algorithm);
  Status reduceScatter(const void* src, void* dst, size_t count, DType dtype, RedOp op,
                       algo::Algorithm algorithm);
  Status allGather(const void* src, void* dst, size_t count, DType dtype,
                   algo::Algorithm algorithm);
  Status broadcast(void* data, size_t count, DType dtype, int root, algo::Algorithm algorithm);
  // Sends send_bytes to send_peer while receiving recv_bytes from recv_peer (either side may be
  // empty: bytes 0 or peer -1), through lane 0's staging, in one NCCL group per message.
  Status sendRecv(const void* send, size_t sendBytes, int sendPeer, void* recv, size_t recvBytes,
                  int recvPeer);

  // NCCL's asynchronous error on any lane ("" while there is none).
  Status asyncError(std::string* message) const;
  // ncclGetLastError's text.
  std::string lastError() const;
  // Waits for the lanes' work, destroys the NCCL communicators and frees the staging.
  Status close();
  // Aborts the NCCL communicators without waiting (their kernels end too), then frees.
  Status abort();
  bool closed() const { return closed_; }

 private:
  struct Lane {
    std::unique_ptr<nccl::NcclComm> comm;
    std::unique_ptr<nccl::NcclTransport> transport;
    std::unique_ptr<Compute> compute;
  };
  // Staging + scratch of every lane, for one collective.
  struct Workspace {
    char* base = nullptr;
    bool captured = false;  // allocated on the stream for a CUDA graph: freed at the end
  };

  NcclCommunicator(int rank, int worldSize, int device, Options options)
      : rank_(rank), worldSize_(worldSize), device_(device), options_(options) {}

  Status addLane(const nccl::NcclLibrary& library, const nccl::ncclUniqueId& id, void* stream);
  size_t laneBytes() const { return options_.slotBytes * (options_.numSlots + 1); }
  Status usable() const;
  Status beginWorkspace(Workspace* ws);
  Status endWorkspace(const Workspace& ws);
  // Runs `algorithm(lanes)` on the device, lanes forked and joined, inside a workspace; poisons
  // the communicator if it fails.
  template <typename Fn>
  Status runLanes(Fn algorithm);
  // NCCL's own collective on lane 0's communicator and stream.
  template <typename Fn>
  Status runNccl(Fn call);
  Status poison(Status status);
  Status checkRoot(int root) const;

  int rank_;
  int worldSize_;
  int device_;
  Options options_;
  std::vector<Lane> lanes_;
  LaneStreams streams_;
  DeviceBuffer workspace_;
  Status failed_;
  bool closed_ = false;
};

}  // namespace dk
