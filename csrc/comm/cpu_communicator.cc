#include "comm/cpu_communicator.h"

#include <chrono>
#include <cstring>

#include "algorithm/point_to_point.h"
#include "algorithm/ring.h"
#include "algorithm/select.h"
#include "algorithm/tree.h"

namespace dk {

using shm::CollectiveKind;

const char* requestName(const Request& r) {
  if (r.kind == CollectiveKind::kSendRecv) return r.isSend ? "send" : "recv";
  return shm::collectiveKindName(r.kind);
}

CpuCommunicator::CpuCommunicator(std::unique_ptr<shm::ShmTransport> transport, Options options)
    : transport_(std::move(transport)),
      options_(options),
      scratch_(transport_->maxMessageBytes()) {}

Status CpuCommunicator::create(std::shared_ptr<shm::Segment> segment, int rank, Options options,
                               std::unique_ptr<CpuCommunicator>* out) {
  std::unique_ptr<shm::ShmTransport> transport;
  DK_RETURN_IF_ERROR(
      shm::ShmTransport::attach(std::move(segment), rank, options.oversubscribed, &transport));
  std::unique_ptr<CpuCommunicator> comm(new CpuCommunicator(std::move(transport), options));
  // The progress thread takes the liveness mutex first thing and holds it until close().
  std::promise<Status> started;
  auto ready = started.get_future();
  comm->progress_ = std::thread(&CpuCommunicator::progressLoop, comm.get(), &started);
  Status status = ready.get();
  if (!status.ok()) {
    comm->close();
    return status;
  }
  *out = std::move(comm);
  return Status::Ok();
}

CpuCommunicator::~CpuCommunicator() { close(); }

void CpuCommunicator::progressLoop(std::promise<Status>* started) {
  Status held = transport_->holdLiveness();
  started->set_value(held);
  if (!held.ok()) return;
  std::unique_lock<std::mutex> lock(queueMutex_);
  while (true) {
    queueChanged_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) break;  // stopping, and nothing left to run
    auto item = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    Status status;
    {
      std::lock_guard<std::mutex> exec(execMutex_);
      status = execute(item.first);
    }
    item.second->complete(std::move(status));
    lock.lock();
    busy_ = false;
    queueChanged_.notify_all();
  }
  lock.unlock();
  transport_->markClosed();
}

void CpuCommunicator::drain() {
  std::unique_lock<std::mutex> lock(queueMutex_);
  queueChanged_.wait(lock, [&] { return queue_.empty() && !busy_; });
}

Status CpuCommunicator::run(Request request) {
  if (closed_) return Status(Code::kPeerFailure, "the communicator is closed");
  drain();
  std::lock_guard<std::mutex> exec(execMutex_);
  return execute(request);
}

Status CpuCommunicator::submit(Request request, std::shared_ptr<Work>* work) {
  if (closed_) return Status(Code::kPeerFailure, "the communicator is closed");
  *work = std::make_shared<Work>();
  {
    std::lock_guard<std::mutex> lock(queueMutex_);
    queue_.emplace_back(std::move(request), *work);
  }
  queueChanged_.notify_all();
  return Status::Ok();
}

Status CpuCommunicator::registerBuffer(uint32_t id, std::shared_ptr<shm::Segment> local,
                                       std::vector<std::shared_ptr<shm::Segment>> peers) {
  drain();
  std::lock_guard<std::mutex> exec(execMutex_);
  return transport_->registerBuffer(id, std::move(local), std::move(peers));
}

Status CpuCommunicator::close() {
  if (closed_) return Status::Ok();
  closed_ = true;
  {
    std::lock_guard<std::mutex> lock(queueMutex_);
    stopping_ = true;
  }
  queueChanged_.notify_all();
  if (progress_.joinable()) progress_.join();
  return Status::Ok();
}

algo::Algorithm CpuCommunicator::resolve(const Request& r) const {
  if (r.kind != CollectiveKind::kAllReduce || r.algorithm != algo::Algorithm::kAuto) {
    return r.algorithm == algo::Algorithm::kAuto ? algo::Algorithm::kRing : r.algorithm;
  }
  const size_t bytes = r.args.count * dtypeSize(r.args.dtype);
  return algo::chooseAllReduce(algo::shmCostModel(), worldSize(), bytes);
}

shm::MessageHeader CpuCommunicator::headerOf(const Request& r) const {
  shm::MessageHeader h;
  h.collective = static_cast<uint32_t>(r.kind) | (static_cast<uint32_t>(r.algorithm) << 8);
  h.dtype = static_cast<uint32_t>(r.args.dtype);
  const bool reduces =
      r.kind == CollectiveKind::kAllReduce || r.kind == CollectiveKind::kReduceScatter;
  h.op = reduces ? static_cast<uint32_t>(r.args.op) : 0;
  h.root = r.kind == CollectiveKind::kBroadcast ? r.args.root : -1;
  h.count = r.args.count;
  return h;
}

Status CpuCommunicator::execute(const Request& request) {
  if (!failed_.ok()) {
    return Status(failed_.code(),
                  "the communicator failed earlier and cannot be used: " + failed_.message());
  }
  Request r = request;
  r.algorithm = resolve(request);
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(options_.timeoutSec));
  const shm::MessageHeader header = headerOf(r);
  Status status = transport_->begin(header, deadline, requestName(r));
  if (status.ok() && options_.debug && r.kind != CollectiveKind::kSendRecv) {
    status = fingerprint(header);
    if (status.ok()) status = transport_->begin(header, deadline, requestName(r));
  }
  if (status.ok()) status = dispatch(r);
  if (!status.ok()) {
    transport_->poison(status);
    failed_ = status;
  }
  return status;
}

Status CpuCommunicator::dispatch(const Request& r) {
  algo::Channel ch{*transport_, compute_};
  algo::CollectiveArgs args = r.args;
  args.scratch = scratch_.data();
  const bool ring = r.algorithm == algo::Algorithm::kRing;
  switch (r.kind) {
    case CollectiveKind::kAllReduce:
      return ring ? algo::ringAllReduce(ch, args) : algo::treeAllReduce(ch, args);
    case CollectiveKind::kReduceScatter:
      return algo::ringReduceScatter(ch, args);
    case CollectiveKind::kAllGather:
      return algo::ringAllGather(ch, args);
    case CollectiveKind::kBroadcast:
      // Several slices: the chain pipelines them; one slice: the heap tree is shallower.
      return algo::treeBroadcast(
          ch, args, args.count * dtypeSize(args.dtype) > transport_->maxMessageBytes());
    case CollectiveKind::kSendRecv:
      return r.isSend ? algo::sendTo(ch, args) : algo::recvFrom(ch, args);
    case CollectiveKind::kBarrier:
      return algo::barrier(ch);
    case CollectiveKind::kFingerprint:
      break;
  }
  return Internal("unknown collective");
}

// DK_DEBUG: every rank sends its header to every peer and compares, so ranks that disagree
// fail before any data moves, with a message naming what differs on which rank.
Status CpuCommunicator::fingerprint(const shm::MessageHeader& mine) {
  shm::MessageHeader probe;
  probe.collective = static_cast<uint32_t>(CollectiveKind::kFingerprint);
  probe.count = sizeof(shm::MessageHeader);
  DK_RETURN_IF_ERROR(
      transport_->begin(probe,
                        std::chrono::steady_clock::now() +
                            std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                std::chrono::duration<double>(options_.timeoutSec)),
                        "fingerprint"));
  const int n = worldSize();
  std::vector<SendOp> sends;
  std::vector<RecvOp> recvs;
  for (int peer = 0; peer < n; ++peer) {
    if (peer == rank()) continue;
    sends.push_back({peer, &mine, sizeof(mine)});
    recvs.push_back({peer, sizeof(mine)});
  }
  DK_RETURN_IF_ERROR(transport_->exchange(sends.data(), static_cast<int>(sends.size()),
                                          recvs.data(), static_cast<int>(recvs.size())));
  std::string differences;
  for (const RecvOp& recv : recvs) {
    shm::MessageHeader theirs;
    std::memcpy(&theirs, recv.data, sizeof(theirs));
    if (theirs != mine) {
      differences +=
          "; rank " + std::to_string(recv.peer) + " called " + shm::describeHeader(theirs);
    }
  }
  DK_RETURN_IF_ERROR(transport_->release(recvs.data(), static_cast<int>(recvs.size())));
  DK_RETURN_IF_ERROR(transport_->finish());
  if (differences.empty()) return Status::Ok();
  return Status(Code::kMismatch, "ranks disagree (DK_DEBUG fingerprint): rank " +
                                     std::to_string(rank()) + " called " +
                                     shm::describeHeader(mine) + differences);
}

}  // namespace dk
