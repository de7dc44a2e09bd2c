// NcclCommunicator: see nccl_communicator.h.
#include "comm/nccl_communicator.h"

#include <string>

#include "algorithm/cpu_compute.h"
#include "algorithm/pairwise_exchange.h"
#include "algorithm/ring.h"
#include "algorithm/select.h"
#include "algorithm/tree.h"
#include "cuda/device_guard.h"
#include "transport/nccl_collectives.h"

#if DK_WITH_CUDA
#include "algorithm/cuda_compute.h"
#endif

namespace dk {

namespace {

// The binding names the collective ("[rank r] reduce_scatter: ..."); this says what is wrong.
Status notFor(algo::Algorithm a, const char* allowed) {
  return InvalidArgument(std::string("algorithm must be ") + allowed + ", got " +
                         algo::algorithmName(a));
}

algo::CollectiveArgs argsOf(const void* src, void* dst, size_t count, DType dtype, RedOp op,
                            int root) {
  algo::CollectiveArgs a;
  a.src = src;
  a.dst = dst;
  a.count = count;
  a.dtype = dtype;
  a.op = op;
  a.root = root;
  return a;
}

// Caller mistakes: found before anything is enqueued, so the communicator stays usable.
bool isCallerError(const Status& s) {
  return s.code() == Code::kInvalidArgument || s.code() == Code::kTypeError;
}

}  // namespace

Status NcclCommunicator::create(const nccl::NcclLibrary& library,
                                const std::vector<nccl::ncclUniqueId>& ids, int rank, int worldSize,
                                int device, void* stream, Options options,
                                std::unique_ptr<NcclCommunicator>* out) {
  if (ids.empty()) return InvalidArgument("NcclCommunicator needs one unique id per lane (>= 1)");
  if (worldSize < 1 || rank < 0 || rank >= worldSize) {
    return InvalidArgument("rank " + std::to_string(rank) +
                           " is not in [0, world_size=" + std::to_string(worldSize) + ")");
  }
  if ((device < 0) != (stream == nullptr)) {
    return InvalidArgument("NcclCommunicator: a CUDA device needs a stream, host memory none");
  }
  std::unique_ptr<NcclCommunicator> comm(new NcclCommunicator(rank, worldSize, device, options));
  NcclCommunicator* c = comm.get();
  DK_RETURN_IF_ERROR(onDevice(device, [&]() -> Status {
    DK_RETURN_IF_ERROR(c->streams_.create(device, stream, static_cast<int>(ids.size())));
    for (const nccl::ncclUniqueId& id : ids) DK_RETURN_IF_ERROR(c->addLane(library, id, stream));
    return c->workspace_.allocate(device, c->lanes() * c->laneBytes());
  }));
  *out = std::move(comm);
  return Status::Ok();
}

Status NcclCommunicator::addLane(const nccl::NcclLibrary& library, const nccl::ncclUniqueId& id,
                                 void* stream) {
  Lane lane;
  DK_RETURN_IF_ERROR(nccl::NcclComm::create(library, id, rank_, worldSize_, device_, &lane.comm));
  void* laneStream = streams_.stream(lanes());
  DK_RETURN_IF_ERROR(nccl::NcclTransport::create(lane.comm.get(), laneStream, options_.slotBytes,
                                                 options_.numSlots, &lane.transport));
  if (device_ < 0) {
    lane.compute = std::make_unique<CpuCompute>();
  } else {
#if DK_WITH_CUDA
    lane.compute = std::make_unique<CudaCompute>(laneStream);
#endif
  }
  lanes_.push_back(std::move(lane));
  return Status::Ok();
}

NcclCommunicator::~NcclCommunicator() { close(); }  // a destructor cannot report: close() does

algo::Algorithm NcclCommunicator::resolve(algo::Algorithm requested, size_t bytes) const {
  if (requested != algo::Algorithm::kAuto) return requested;
  return algo::chooseOnNccl(worldSize_, bytes);
}

Status NcclCommunicator::usable() const {
  if (closed_) return Status(Code::kPeerFailure, "the communicator is closed");
  if (!failed_.ok()) {
    return Status(failed_.code(),
                  "the communicator failed earlier and cannot be used: " + failed_.message());
  }
  return Status::Ok();
}

Status NcclCommunicator::poison(Status status) {
  if (!status.ok() && !isCallerError(status) && failed_.ok()) failed_ = status;
  return status;
}

Status NcclCommunicator::beginWorkspace(Workspace* ws) {
  DK_RETURN_IF_ERROR(streams_.capturing(&ws->captured));
  if (!ws->captured) {
    ws->base = workspace_.data();
    return Status::Ok();
  }
  void* memory = nullptr;
  DK_RETURN_IF_ERROR(streams_.allocateOnStream(lanes() * laneBytes(), &memory));
  ws->base = static_cast<char*>(memory);
  return Status::Ok();
}

Status NcclCommunicator::endWorkspace(const Workspace& ws) {
  return ws.captured ? streams_.freeOnStream(ws.base) : Status::Ok();
}

template <typename Fn>
Status NcclCommunicator::runLanes(Fn algorithm) {
  DK_RETURN_IF_ERROR(usable());
  return poison(onDevice(device_, [&]() -> Status {
    Workspace ws;
    DK_RETURN_IF_ERROR(beginWorkspace(&ws));
    std::vector<algo::Channel> channels;
    Status status;
    for (size_t l = 0; l < lanes_.size() && status.ok(); ++l) {
      char* staging = ws.base + l * laneBytes();
      status = lanes_[l].transport->setStaging(staging);
      char* scratch = staging + options_.slotBytes * options_.numSlots;
      channels.push_back(algo::Channel{*lanes_[l].transport, *lanes_[l].compute, scratch});
    }
    if (status.ok()) status = streams_.fork();
    if (status.ok()) status = algorithm(algo::Lanes(channels.data(), lanes()));
    // Joined and freed even after a failure, so that a capture can still end.
    const Status joined = streams_.join();
    const Status freed = endWorkspace(ws);
    if (!status.ok()) return status;
    return joined.ok() ? freed : joined;
  }));
}

template <typename Fn>
Status NcclCommunicator::runNccl(Fn call) {
  DK_RETURN_IF_ERROR(usable());
  return poison(onDevice(device_, [&] { return call(*lanes_[0].comm, streams_.stream(0)); }));
}

Status NcclCommunicator::checkRoot(int root) const {
  if (root >= 0 && root < worldSize_) return Status::Ok();
  return InvalidArgument("root " + std::to_string(root) +
                         " is not in [0, world_size=" + std::to_string(worldSize_) + ")");
}

Status NcclCommunicator::allReduce(const void* src, void* dst, size_t count, DType dtype, RedOp op,
                                   algo::Algorithm algorithm) {
  const algo::CollectiveArgs a = argsOf(src, dst, count, dtype, op, 0);
  switch (resolve(algorithm, count * dtypeSize(dtype))) {
    case algo::Algorithm::kNccl:
      return runNccl([&](nccl::NcclComm& c, void* s) {
        return nccl::allReduce(c, src, dst, count, dtype, op, s);
      });
    case algo::Algorithm::kRing:
      return runLanes([&](const algo::Lanes& l) { return ringAllReduce(l, a); });
    case algo::Algorithm::kTree:
      return runLanes([&](const algo::Lanes& l) { return treeAllReduce(l, a); });
    default:
      return notFor(algorithm, "ring, tree, nccl or auto");
  }
}

Status NcclCommunicator::reduceScatter(const void* src, void* dst, size_t count, DType dtype,
                                       RedOp op, algo::Algorithm algorithm) {
  const algo::CollectiveArgs a = argsOf(src, dst, count, dtype, op, 0);
  switch (resolve(algorithm, count * dtypeSize(dtype))) {
    case algo::Algorithm::kNccl:
      return runNccl([&](nccl::NcclComm& c, void* s) {
        return nccl::reduceScatter(c, src, dst, count, dtype, op, s);
      });
    case algo::Algorithm::kRing:
      return runLanes([&](const algo::Lanes& l) { return ringReduceScatter(l, a); });
    default:
      return notFor(algorithm, "ring, nccl or auto (there is no tree)");
  }
}

Status NcclCommunicator::allGather(const void* src, void* dst, size_t count, DType dtype,
                                   algo::Algorithm algorithm) {
  const algo::CollectiveArgs a = argsOf(src, dst, count, dtype, RedOp::kSum, 0);
  switch (resolve(algorithm, count * dtypeSize(dtype))) {
    case algo::Algorithm::kNccl:
      return runNccl([&](nccl::NcclComm& c, void* s) {
        return nccl::allGather(c, src, dst, count, dtype, s);
      });
    case algo::Algorithm::kRing:
      return runLanes([&](const algo::Lanes& l) { return ringAllGather(l, a); });
    default:
      return notFor(algorithm, "ring, nccl or auto (there is no tree)");
  }
}

Status NcclCommunicator::broadcast(void* data, size_t count, DType dtype, int root,
                                   algo::Algorithm algorithm) {
  DK_RETURN_IF_ERROR(checkRoot(root));
  const algo::CollectiveArgs a = argsOf(data, data, count, dtype, RedOp::kSum, root);
  // Several slices: the chain pipelines them; one slice: the heap tree is shallower.
  const bool chain = count * dtypeSize(dtype) > maxMessageBytes();
  switch (resolve(algorithm, count * dtypeSize(dtype))) {
    case algo::Algorithm::kNccl:
      return runNccl([&](nccl::NcclComm& c, void* s) {
        return nccl::broadcast(c, data, data, count, dtype, root, s);
      });
    case algo::Algorithm::kRing:
    case algo::Algorithm::kTree:
      return runLanes([&](const algo::Lanes& l) { return treeBroadcast(l, a, chain); });
    default:
      return notFor(algorithm, "ring, tree, nccl or auto");
  }
}

Status NcclCommunicator::sendRecv(const void* send, size_t sendBytes, int sendPeer, void* recv,
                                  size_t recvBytes, int recvPeer) {
  return runLanes([&](const algo::Lanes& l) {
    return pairwiseExchange(l[0].transport, l[0].compute, send, sendBytes, sendPeer, recv,
                            recvBytes, recvPeer);
  });
}

Status NcclCommunicator::asyncError(std::string* message) const {
  message->clear();
  for (const Lane& lane : lanes_) {
    DK_RETURN_IF_ERROR(lane.comm->asyncError(message));
    if (!message->empty()) return Status::Ok();
  }
  return Status::Ok();
}

std::string NcclCommunicator::lastError() const {
  return lanes_.empty() ? std::string() : nccl::lastError(lanes_[0].comm->api());
}

Status NcclCommunicator::close() {
  if (closed_) return Status::Ok();
  closed_ = true;
  return onDevice(device_, [&]() -> Status {
    Status first = streams_.synchronize();
    for (Lane& lane : lanes_) {
      const Status s = lane.comm->close();
      if (first.ok()) first = s;
    }
    const Status freed = workspace_.release();
    const Status destroyed = streams_.destroy();
    if (!first.ok()) return first;
    return freed.ok() ? destroyed : freed;
  });
}

Status NcclCommunicator::abort() {
  if (closed_) return Status::Ok();
  closed_ = true;
  return onDevice(device_, [&]() -> Status {
    Status first;
    for (Lane& lane : lanes_) {
      const Status s = lane.comm->abort();  // ends the lanes' NCCL kernels still waiting
      if (first.ok()) first = s;
    }
    streams_.synchronize();  // what is left (our kernels) ends; its errors are the abort's
    workspace_.release();
    streams_.destroy();
    return first;
  });
}

}  // namespace dk
