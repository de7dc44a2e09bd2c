#include "comm/cpu_communicator.h"

#include <chrono>
#include <cstring>

#include "algorithm/all_to_all.h"
#include "algorithm/one_shot.h"
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
      timeoutSec_(options.timeoutSec),
      scratch_(transport_->maxMessageBytes()),
      tagged_(transport_->worldSize()) {}

Status CpuCommunicator::create(std::shared_ptr<shm::Segment> segment, int rank, Options options,
                               std::unique_ptr<CpuCommunicator>* out) {
  std::unique_ptr<shm::ShmTransport> transport;
  DK_RETURN_IF_ERROR(
      shm::ShmTransport::attach(std::move(segment), rank, options.oversubscribed, &transport));
  transport->setDescriptorChecks(options.checkDescriptors);
  std::unique_ptr<CpuCommunicator> comm(new CpuCommunicator(std::move(transport), options));
  // The queue's dispatcher thread takes the liveness mutex first thing and holds it until
  // close() (a robust mutex must be unlocked by the thread that locked it).
  CpuCommunicator* c = comm.get();
  DK_RETURN_IF_ERROR(c->queue_.start(
      [c](const Request& r) { return c->executeLocked(r, /*queued=*/true); },
      [c] { return c->transport_->holdLiveness(); }, [c] { c->transport_->markClosed(); }));
  *out = std::move(comm);
  return Status::Ok();
}

CpuCommunicator::~CpuCommunicator() { close(); }

shm::Lane CpuCommunicator::laneOf(const Request& r) {
  if (r.kind != CollectiveKind::kSendRecv) return shm::Lane::kBoth;
  return r.isSend ? shm::Lane::kSend : shm::Lane::kRecv;
}

Status CpuCommunicator::run(Request request) {
  if (closed_) return Status(Code::kPeerFailure, "the communicator is closed");
  record(request);
  queue_.drain(laneOf(request));
  return executeLocked(request, /*queued=*/false);
}

Status CpuCommunicator::executeLocked(const Request& request, bool queued) {
  const shm::Lane lane = laneOf(request);
  std::unique_lock<std::mutex> sendLock(sendLane_, std::defer_lock);
  std::unique_lock<std::mutex> recvLock(recvLane_, std::defer_lock);
  if (lane == shm::Lane::kBoth) {
    std::lock(sendLock, recvLock);
  } else {
    (lane == shm::Lane::kSend ? sendLock : recvLock).lock();
  }
  // A close() that ran while this thread waited for its lane has cancelled the transport
  // (queued operations still run: close() drains the queue before it cancels).
  if (closed_ && !queued) return Status(Code::kPeerFailure, "the communicator is closed");
  return execute(request);
}

Status CpuCommunicator::submit(Request request, std::shared_ptr<Work>* work) {
  if (closed_) return Status(Code::kPeerFailure, "the communicator is closed");
  *work = std::make_shared<Work>();
  record(request);
  if (request.kind == CollectiveKind::kSendRecv && request.isSend && sendAtOnce(request, **work)) {
    return Status::Ok();
  }
  const shm::Lane lane = laneOf(request);
  return queue_.submit(std::move(request), *work, lane);
}

// An isend that fits in the free slots of its FIFO runs on the caller's thread, copied even
// from registered memory: it then cannot wait (no slot, no in-place reader), and handing it to
// the send worker costs a thread wake-up and a context switch on the caller's core, far more
// than copying 32 KiB (the pipeline benchmark's 2-rank 1F1B went from 1.09-1.14x to
// 1.19-1.29x torch's throughput with this). Only when nothing queued or running uses the send
// lane, so issue order is kept.
bool CpuCommunicator::sendAtOnce(const Request& request, Work& work) {
  return queue_.ifQuiet(shm::Lane::kSend, [&] {
    std::unique_lock<std::mutex> lane(sendLane_, std::try_to_lock);
    if (!lane.owns_lock() || closed_) return false;
    const size_t bytes = request.args.count * dtypeSize(request.args.dtype);
    if (!transport_->sendFitsNow(request.args.root, bytes)) return false;
    work.complete(execute(request, /*inPlace=*/false));
    return true;
  });
}

Status CpuCommunicator::registerBuffer(uint32_t id, std::shared_ptr<shm::Segment> local,
                                       std::vector<std::shared_ptr<shm::Segment>> peers) {
  queue_.drain(shm::Lane::kBoth);
  std::scoped_lock lanes(sendLane_, recvLane_);
  return transport_->registerBuffer(id, std::move(local), std::move(peers));
}

Status CpuCommunicator::close() {
  if (closed_.exchange(true)) return Status::Ok();
  // Queued operations run to completion first (close() promises that), then any synchronous
  // call still blocked on another thread is cancelled and waited for, so that nothing is left
  // inside the transport when the caller destroys it.
  queue_.stop();
  transport_->cancel();
  std::scoped_lock lanes(sendLane_, recvLane_);
  return Status::Ok();
}

namespace {

// Auto's size limits for one-shot, as fractions of a slot (explicit "one_shot" goes up to a
// whole slot). All-reduce: half, because at a full slot (512 KiB) one-shot lost to the ring at
// 2 and 4 ranks (20 vs 16 us, 142 vs 81 us), the model's constants notwithstanding.
// All-gather and reduce-scatter, per rank's chunk (the per-peer message): an eighth (64 KiB up
// to 4 ranks), because at 4 ranks on 2 cores (2026-12-01,
// benchmarks/results/2026-12-01-one-shot-gather-scatter.md) one-shot all_gather won 1.2-2.4x
// up to 32 KiB chunks (reduce_scatter 1.0-2.6x), was within the noise of the ring at 64 KiB
// (0.84-1.17x) and lost down to 0.47x at 128-256 KiB, where every rank copying n-1 chunks at
// once outweighs the n-2 steps saved.
constexpr size_t kAllReduceAutoOneShotDivisor = 2;
constexpr size_t kGatherScatterAutoOneShotDivisor = 8;

}  // namespace

// "one_shot" on a message larger than one slot runs what auto picks among the others. Any
// collective other than all-reduce, all-gather and reduce-scatter runs its one algorithm.
algo::Algorithm CpuCommunicator::resolve(const Request& r) const {
  switch (r.kind) {
    case CollectiveKind::kAllReduce:
      return resolveAllReduce(r);
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter:
      return resolveGatherScatter(r);
    default:
      return r.algorithm == algo::Algorithm::kAuto ? algo::Algorithm::kRing : r.algorithm;
  }
}

algo::Algorithm CpuCommunicator::resolveAllReduce(const Request& r) const {
  using algo::Algorithm;
  const size_t bytes = r.args.count * dtypeSize(r.args.dtype);
  if (r.algorithm == Algorithm::kRing || r.algorithm == Algorithm::kTree ||
      (r.algorithm == Algorithm::kOneShot && algo::oneShotFits(*transport_, bytes))) {
    return r.algorithm;
  }
  if (r.algorithm == Algorithm::kAuto && fitsSmallBoxes(bytes)) return Algorithm::kOneShot;
  const bool autoFits = bytes <= transport_->maxMessageBytes() / kAllReduceAutoOneShotDivisor;
  return algo::chooseAllReduce(costModels(), worldSize(), bytes,
                               autoFits && r.algorithm == Algorithm::kAuto);
}

// `bytes` is one rank's chunk: the per-peer message.
algo::Algorithm CpuCommunicator::resolveGatherScatter(const Request& r) const {
  using algo::Algorithm;
  const size_t bytes = r.args.count * dtypeSize(r.args.dtype);
  if (r.algorithm == Algorithm::kOneShot) {
    return algo::oneShotFits(*transport_, bytes) ? Algorithm::kOneShot : Algorithm::kRing;
  }
  if (r.algorithm != Algorithm::kAuto) return Algorithm::kRing;
  // The small reduce-scatter publishes its whole input (one_shot.cc).
  if (fitsSmallBoxes(static_cast<size_t>(worldSize()) * bytes)) return Algorithm::kOneShot;
  const bool autoFits = bytes <= transport_->maxMessageBytes() / kGatherScatterAutoOneShotDivisor;
  const algo::AlgorithmCosts model = costModels();
  const size_t whole = static_cast<size_t>(worldSize()) * bytes;
  return r.kind == CollectiveKind::kAllGather
             ? algo::chooseAllGather(model, worldSize(), whole, autoFits)
             : algo::chooseReduceScatter(model, worldSize(), whole, autoFits);
}

// The built-in model's rule for small messages: one that fits the transport's small-message
// boxes takes one flag line per peer one-shot (transport.h, exchangeSmall), where ring and
// tree take a chain of FIFO steps, so `auto` takes one-shot there. A fitted model (measured
// on the machine, boxes included) decides by its own prices instead.
bool CpuCommunicator::fitsSmallBoxes(size_t bytes) const {
  return !options_.fitted && transport_->fitsSmall(bytes);
}

algo::AlgorithmCosts CpuCommunicator::costModels() const {
  return options_.fitted
             ? *options_.fitted
             : algo::AlgorithmCosts::uniform(algo::shmCostModel(options_.oversubscribed));
}

shm::MessageHeader CpuCommunicator::headerOf(const Request& r) const {
  shm::MessageHeader h;
  h.collective = static_cast<uint32_t>(r.kind) | (static_cast<uint32_t>(r.algorithm) << 8);
  h.dtype = static_cast<uint32_t>(r.args.dtype);
  const bool reduces =
      r.kind == CollectiveKind::kAllReduce || r.kind == CollectiveKind::kReduceScatter;
  h.op = reduces ? static_cast<uint32_t>(r.args.op) : 0;
  if (r.kind == CollectiveKind::kSendRecv) h.op = static_cast<uint32_t>(r.tag);
  h.root = r.kind == CollectiveKind::kBroadcast ? r.args.root : -1;
  // All-to-all blocks differ in size between pairs: each message's byte count is checked
  // against its receiver's instead.
  h.count = r.kind == CollectiveKind::kAllToAll ? 0 : r.args.count;
  h.seq = r.kind == CollectiveKind::kSendRecv ? 0 : collectiveSeq_ + 1;
  return h;
}

void CpuCommunicator::abort(const Status& cause) {
  transport_->poison(cause);
  std::lock_guard<std::mutex> lock(failedMutex_);
  if (failed_.ok()) failed_ = cause;
}

std::vector<int> CpuCommunicator::deadPeers() const {
  std::vector<int> dead;
  for (int peer = 0; peer < worldSize(); ++peer) {
    if (transport_->peerDied(peer)) dead.push_back(peer);
  }
  return dead;
}

Status CpuCommunicator::failure() const {
  std::lock_guard<std::mutex> lock(failedMutex_);
  return failed_;
}

Status CpuCommunicator::execute(const Request& request, bool inPlace) {
  if (Status failed = failure(); !failed.ok()) {
    return Status(failed.code(),
                  "the communicator failed earlier and cannot be used: " + failed.message());
  }
  Request r = request;
  r.algorithm = resolve(request);
  FlightRecorder* recorder = options_.recorder.get();
  if (recorder != nullptr) recorder->started(r.traceId, static_cast<int>(r.algorithm));
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeoutSec_.load()));
  const shm::MessageHeader header = headerOf(r);
  const shm::Lane lane = laneOf(r);
  // One-shot sends copy: a rank overwrites its input (in place) while peers may still read it.
  if (r.algorithm == algo::Algorithm::kOneShot) inPlace = false;
  Status status = transport_->begin(header, deadline, lane, inPlace, r.interruptible);
  if (lane == shm::Lane::kBoth) {
    collectiveSeq_ = header.seq;
    transport_->announce(header);
  }
  if (status.ok() && options_.debug && lane == shm::Lane::kBoth) {
    status = fingerprint(header, deadline);
    if (status.ok()) status = transport_->begin(header, deadline, lane, inPlace, r.interruptible);
  }
  if (status.ok()) status = dispatch(r);
  if (status.ok() && needsAgreement(r) && !boxedBroadcast(r)) status = transport_->agree();
  if (status.ok()) {
    if (recorder != nullptr) recorder->completed(r.traceId);
  } else {
    if (recorder != nullptr) recorder->failed(r.traceId, status.message());
    // A send or receive whose peer died fails alone: the other peers may go on (a parameter
    // server outlives a worker); everything else fails the communicator on every rank.
    if (status.code() != Code::kPeerLost) abort(status);
  }
  return status;
}

void CpuCommunicator::record(Request& request) const {
  if (options_.recorder != nullptr)
    request.traceId = options_.recorder->schedule(traceCallOf(request));
}

TraceCall CpuCommunicator::traceCallOf(const Request& r) const {
  TraceCall call;
  call.dtype = static_cast<int>(r.args.dtype);
  call.algorithm = static_cast<int>(r.algorithm);
  call.inCount = call.outCount = r.args.count;
  call.frames = r.frames;
  const uint64_t n = static_cast<uint64_t>(worldSize());
  switch (r.kind) {
    case CollectiveKind::kAllReduce:
      call.op = TraceOp::kAllReduce;
      call.redOp = static_cast<int>(r.args.op);
      break;
    case CollectiveKind::kReduceScatter:
      call.op = TraceOp::kReduceScatter;
      call.redOp = static_cast<int>(r.args.op);
      call.inCount = n * r.args.count;
      break;
    case CollectiveKind::kAllGather:
      call.op = TraceOp::kAllGather;
      call.outCount = n * r.args.count;
      break;
    case CollectiveKind::kBroadcast:
      call.op = TraceOp::kBroadcast;
      call.peer = r.args.root;
      break;
    case CollectiveKind::kSendRecv:
      call.op = r.isSend ? TraceOp::kSend : TraceOp::kRecv;
      call.peer = r.args.root;
      break;
    case CollectiveKind::kAllToAll:
      call.op = TraceOp::kAllToAll;
      call.inCount = call.outCount = 0;
      for (size_t c : r.sendCounts) call.inCount += c;
      for (size_t c : r.recvCounts) call.outCount += c;
      break;
    case CollectiveKind::kBarrier:
    case CollectiveKind::kFingerprint:
      call.op = TraceOp::kBarrier;
      break;
  }
  return call;
}

// A broadcast small enough for the small-message boxes: every rank reads every rank's flag
// and descriptor there, which is what agree() would check afterwards.
bool CpuCommunicator::boxedBroadcast(const Request& r) const {
  return r.kind == CollectiveKind::kBroadcast &&
         transport_->fitsSmall(r.args.count * dtypeSize(r.args.dtype));
}

// See ShmTransport::agree(): a broadcast root receives nothing, and a zero-byte collective
// may move no bytes, so neither learns from its data flow what the other ranks called.
bool CpuCommunicator::needsAgreement(const Request& r) {
  if (r.kind == CollectiveKind::kSendRecv || r.kind == CollectiveKind::kBarrier) return false;
  return r.kind == CollectiveKind::kBroadcast || r.args.count == 0;
}

Status CpuCommunicator::dispatch(const Request& r) {
  algo::Channel ch{*transport_, compute_, scratch_.data()};
  const algo::CollectiveArgs& args = r.args;
  const bool ring = r.algorithm == algo::Algorithm::kRing;
  switch (r.kind) {
    case CollectiveKind::kAllReduce:
      if (r.algorithm == algo::Algorithm::kOneShot) return algo::oneShotAllReduce(ch, args);
      return ring ? algo::ringAllReduce(ch, args) : algo::treeAllReduce(ch, args);
    case CollectiveKind::kReduceScatter:
      if (r.algorithm == algo::Algorithm::kOneShot) return algo::oneShotReduceScatter(ch, args);
      return algo::ringReduceScatter(ch, args);
    case CollectiveKind::kAllGather:
      if (r.algorithm == algo::Algorithm::kOneShot) return algo::oneShotAllGather(ch, args);
      return algo::ringAllGather(ch, args);
    case CollectiveKind::kBroadcast:
      // Several slices: the chain pipelines them; one slice: the heap tree is shallower.
      if (boxedBroadcast(r)) return algo::oneShotBroadcast(ch, args);
      return algo::treeBroadcast(
          ch, args, args.count * dtypeSize(args.dtype) > transport_->maxMessageBytes());
    case CollectiveKind::kSendRecv:
      if (r.isSend) return algo::sendTo(ch, args);
      if (r.source) return tagged_.receiveAny(ch, *transport_, headerOf(r), args, r.source.get());
      return tagged_.receive(ch, *transport_, headerOf(r), args);
    case CollectiveKind::kBarrier:
      return algo::barrier(ch);
    case CollectiveKind::kAllToAll:
      // Every peer at once: one exchange per message round instead of n-1 pairwise steps.
      return algo::oneShotAllToAll(ch, args, r.sendCounts.data(), r.recvCounts.data());
    case CollectiveKind::kFingerprint:
      break;
  }
  return Internal("unknown collective");
}

// DK_DEBUG: every rank sends its header to every peer and compares, so ranks that disagree
// fail before any data moves, with a message naming what differs on which rank.
Status CpuCommunicator::fingerprint(const shm::MessageHeader& mine,
                                    std::chrono::steady_clock::time_point deadline) {
  shm::MessageHeader probe;
  probe.collective = static_cast<uint32_t>(CollectiveKind::kFingerprint);
  probe.count = sizeof(shm::MessageHeader);
  DK_RETURN_IF_ERROR(transport_->begin(probe, deadline));
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
