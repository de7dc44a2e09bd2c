#include "transport/shm_transport.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/dtype.h"
#include "common/interrupt.h"
#include "transport/shm_backoff.h"

namespace dk::shm {

namespace {

const char* kindName(uint32_t collective) {
  return collectiveKindName(static_cast<CollectiveKind>(collective & 0xff));
}

constexpr const char* kAnySourceWait = "waiting for a message from any rank";

// "rank 3", or for a receive from any source (peer < 0) "any rank".
std::string awaited(int peer) { return peer < 0 ? "any rank" : "rank " + std::to_string(peer); }

}  // namespace

// e.g. "all_reduce(count=100, float32, sum, algorithm 1)"
std::string describeHeader(const MessageHeader& h) {
  const auto dtype = static_cast<DType>(h.dtype);
  char buf[160];
  const char* dtypeText = isValidDType(h.dtype) ? dtypeName(dtype) : "?";
  if (isPointToPoint(h)) {  // op carries the tag
    std::snprintf(buf, sizeof(buf), "send/recv(count=%llu, %s, tag=%d)",
                  static_cast<unsigned long long>(h.count), dtypeText, static_cast<int32_t>(h.op));
    return buf;
  }
  std::snprintf(buf, sizeof(buf), "%s(count=%llu, %s, %s, root=%d, algorithm %u)",
                kindName(h.collective), static_cast<unsigned long long>(h.count), dtypeText,
                isValidRedOp(h.op) ? redOpName(static_cast<RedOp>(h.op)) : "?", h.root,
                h.collective >> 8);
  std::string out = buf;
  if (h.seq != 0) out += " as collective #" + std::to_string(h.seq);
  return out;
}

Status ShmTransport::formatSegment(Segment& segment, const SegmentGeometry& g) {
  if (g.slotsPerFifo < 1 || g.slotsPerFifo > kMaxSlots) return InvalidArgument("bad slot count");
  if (segment.size() < g.totalBytes) return InvalidArgument("segment smaller than its layout");
  auto* base = static_cast<char*>(segment.data());
  auto* h = new (base) SegmentHeader();
  h->worldSize = g.worldSize;
  h->slotsPerFifo = g.slotsPerFifo;
  h->slotBytes = g.slotBytes;
  h->totalBytes = g.totalBytes;
  h->abortRank.store(0);
  h->abortReady.store(0);
  pthread_mutexattr_t attr;
  if (pthread_mutexattr_init(&attr) != 0) return Internal("pthread_mutexattr_init failed");
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  for (int r = 0; r < g.worldSize; ++r) {
    auto* rc = new (base + g.rankControlOffset + r * sizeof(RankControl)) RankControl();
    const int err = pthread_mutex_init(&rc->alive, &attr);
    if (err != 0) {
      pthread_mutexattr_destroy(&attr);
      errno = err;
      return SystemError("pthread_mutex_init");
    }
  }
  pthread_mutexattr_destroy(&attr);
  for (int f = 0; f < g.numFifos(); ++f)
    new (base + g.fifoControlOffset + f * sizeof(FifoControl)) FifoControl();
  for (int b = 0; b < g.worldSize * kLowLatencyBoxes; ++b)
    new (base + g.lowLatencyOffset + b * sizeof(LowLatencyBox)) LowLatencyBox();
  // Publish the format last: attach() checks the magic.
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kMagic;
  return Status::Ok();
}

ShmTransport::ShmTransport(std::shared_ptr<Segment> segment, int rank, bool oversubscribed)
    : segment_(std::move(segment)), rank_(rank), oversubscribed_(oversubscribed) {}

Status ShmTransport::attach(std::shared_ptr<Segment> segment, int rank, bool oversubscribed,
                            std::unique_ptr<ShmTransport>* out) {
  const auto* h = static_cast<const SegmentHeader*>(segment->data());
  if (segment->size() < sizeof(SegmentHeader) || h->magic != kMagic) {
    return InvalidArgument("shared-memory segment " + segment->name() + " is not formatted");
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  const auto g = makeGeometry(h->worldSize, h->slotsPerFifo, h->slotBytes);
  if (g.totalBytes != h->totalBytes || g.totalBytes > segment->size()) {
    return InvalidArgument("shared-memory segment layout does not match this build");
  }
  if (rank < 0 || rank >= g.worldSize) return InvalidArgument("rank out of range");
  std::unique_ptr<ShmTransport> t(new ShmTransport(std::move(segment), rank, oversubscribed));
  t->geometry_ = g;
  t->sent_.assign(g.worldSize, 0);
  t->received_.assign(g.worldSize, 0);
  t->released_.assign(g.worldSize, 0);
  t->zeroCopyUntil_.assign(g.worldSize, 0);
  t->gone_.assign(g.worldSize, 0);
  *out = std::move(t);
  return Status::Ok();
}

ShmTransport::~ShmTransport() { markClosed(); }

SegmentHeader* ShmTransport::header() const {
  return static_cast<SegmentHeader*>(segment_->data());
}

RankControl* ShmTransport::rankControl(int r) const {
  auto* base = static_cast<char*>(segment_->data()) + geometry_.rankControlOffset;
  return reinterpret_cast<RankControl*>(base + r * sizeof(RankControl));
}

FifoControl* ShmTransport::fifo(int sender, int receiver) const {
  auto* base = static_cast<char*>(segment_->data()) + geometry_.fifoControlOffset;
  return reinterpret_cast<FifoControl*>(base + geometry_.fifoIndex(sender, receiver) *
                                                   sizeof(FifoControl));
}

char* ShmTransport::slotData(int sender, int receiver, uint64_t seq) const {
  const size_t slot =
      geometry_.fifoIndex(sender, receiver) * geometry_.slotsPerFifo + seq % geometry_.slotsPerFifo;
  return static_cast<char*>(segment_->data()) + geometry_.slotDataOffset +
         slot * geometry_.slotBytes;
}

LowLatencyBox* ShmTransport::lowLatencyBox(int r, uint64_t seq) const {
  const size_t box = static_cast<size_t>(r) * kLowLatencyBoxes + seq % kLowLatencyBoxes;
  return reinterpret_cast<LowLatencyBox*>(static_cast<char*>(segment_->data()) +
                                          geometry_.lowLatencyOffset + box * sizeof(LowLatencyBox));
}

Status ShmTransport::holdLiveness() {
  RankControl* rc = rankControl(rank_);
  const int err = pthread_mutex_lock(&rc->alive);
  if (err == EOWNERDEAD) {
    pthread_mutex_consistent(&rc->alive);
  } else if (err != 0) {
    errno = err;
    return SystemError("pthread_mutex_lock(liveness)");
  }
  rc->pid = static_cast<int32_t>(getpid());
  rc->attached.store(1, std::memory_order_release);
  holdsLiveness_ = true;
  return Status::Ok();
}

void ShmTransport::markClosed() {
  if (!holdsLiveness_) return;
  holdsLiveness_ = false;
  RankControl* rc = rankControl(rank_);
  rc->closed.store(1, std::memory_order_release);
  pthread_mutex_unlock(&rc->alive);
}

Status ShmTransport::peerAlive(int peer) {
  RankControl* rc = rankControl(peer);
  if (rc->dead.load(std::memory_order_acquire)) {
    return Status(Code::kPeerFailure, "peer rank " + std::to_string(peer) + " died");
  }
  if (rc->closed.load(std::memory_order_acquire)) {
    return Status(Code::kPeerFailure,
                  "peer rank " + std::to_string(peer) + " closed the communicator");
  }
  if (!rc->attached.load(std::memory_order_acquire)) return Status::Ok();
  const int err = pthread_mutex_trylock(&rc->alive);
  if (err == EBUSY) return Status::Ok();
  if (err == EOWNERDEAD) {
    pthread_mutex_consistent(&rc->alive);
    rc->dead.store(1, std::memory_order_release);
    pthread_mutex_unlock(&rc->alive);
    return Status(Code::kPeerFailure, "peer rank " + std::to_string(peer) + " died (pid " +
                                          std::to_string(rc->pid) +
                                          " exited while holding the communicator)");
  }
  if (err == 0) {
    // Unlocked but neither closed nor dead: it is between close() steps; look again later.
    pthread_mutex_unlock(&rc->alive);
    return Status::Ok();
  }
  if (err == ENOTRECOVERABLE) {
    return Status(Code::kPeerFailure, "peer rank " + std::to_string(peer) + " died");
  }
  errno = err;
  return SystemError("pthread_mutex_trylock(liveness of rank " + std::to_string(peer) + ")");
}

void ShmTransport::poison(const Status& failure) {
  SegmentHeader* h = header();
  uint32_t expected = 0;
  if (!h->abortRank.compare_exchange_strong(expected, static_cast<uint32_t>(rank_ + 1))) return;
  std::snprintf(h->abortReason, kReasonBytes, "%s", failure.message().c_str());
  h->abortCode = static_cast<int32_t>(failure.code());
  h->abortReady.store(1, std::memory_order_release);
}

Status ShmTransport::health() const {
  const SegmentHeader* h = header();
  const uint32_t who = h->abortRank.load(std::memory_order_acquire);
  if (who == 0) return Status::Ok();
  // The failing rank writes its reason right after claiming the word; wait for it briefly.
  for (int i = 0; i < 1000000 && !h->abortReady.load(std::memory_order_acquire); ++i) {
    sched_yield();
  }
  std::string reason(h->abortReason, strnlen(h->abortReason, kReasonBytes));
  const auto code = static_cast<Code>(h->abortCode);
  if (static_cast<int>(who) - 1 == rank_) return Status(code, reason);
  return Status(code, reason + " (reported by rank " + std::to_string(who - 1) + ")");
}

Status ShmTransport::waitChecks(const LaneState& lane, const Backoff& backoff, bool* armed,
                                int peer, const char* what) const {
  if (cancelled_.load(std::memory_order_acquire)) {
    return Status(Code::kPeerFailure, "rank " + std::to_string(rank_) +
                                          " closed the communicator while a call waited for " +
                                          awaited(peer) + " (" + what + ")");
  }
  if (lane.interruptible) {
    if (!*armed && backoff.sleeping()) {
      interrupt::armSigint();
      *armed = true;
    }
    if (interrupt::sigintCount() != lane.sigintsAtStart) return interrupted(lane, peer, what);
  }
  return Status::Ok();
}

template <typename Ready>
Status ShmTransport::waitFor(const LaneState& lane, int peer, const char* what,
                             const std::atomic<uint64_t>& word, std::atomic<uint32_t>& sleepers,
                             Ready ready) {
  Backoff backoff(oversubscribed_, &spinBudget_);
  bool armed = false;
  for (uint64_t seen = word.load(std::memory_order_acquire); !ready(seen);
       seen = word.load(std::memory_order_acquire)) {
    if (header()->abortRank.load(std::memory_order_relaxed) != 0) return health();
    if (backoff.shouldCheck()) {
      DK_RETURN_IF_ERROR(waitChecks(lane, backoff, &armed, peer, what));
      // A peer stores what this wait is for before it closes or exits (its closed flag and
      // its robust mutex are released after), and it may have done both since `seen` was
      // read: a peer that is gone fails the wait only if the word is still not ready.
      const Status alive = pointToPointPeerAlive(lane, peer);
      if (!alive.ok()) {
        if (ready(word.load(std::memory_order_acquire))) return Status::Ok();
        return alive;
      }
      // A peer announces its next collective only after its calls before it have ended, so
      // after it stored what this wait is for; it may have done both since `seen` was read.
      // Read the word again after the announcement: not ready yet is a real disagreement.
      const Status agrees = peerCallAgrees(lane, peer);
      if (!agrees.ok() && !ready(word.load(std::memory_order_acquire))) return agrees;
      if (std::chrono::steady_clock::now() >= lane.deadline) return timedOut(lane, peer, what);
    }
    backoff.pause(word, seen, sleepers);
  }
  return Status::Ok();
}

Status ShmTransport::interrupted(const LaneState& lane, int peer, const char* what) const {
  return Status(Code::kInterrupted,
                "rank " + std::to_string(rank_) + " was interrupted (SIGINT) while waiting for " +
                    awaited(peer) + " (" + describeHeader(lane.header) + "; " + what + ")");
}

Status ShmTransport::timedOut(const LaneState& lane, int peer, const char* what) const {
  const double secs = std::chrono::duration<double>(lane.deadline - lane.started).count();
  char buf[320];
  // "Timed out", as torch's backends word it (torch's tests match it).
  if (peer < 0) {
    std::snprintf(buf, sizeof(buf), "Timed out after %.1f s %s (%s)", secs, what,
                  describeHeader(lane.header).c_str());
    return Status(Code::kTimeout, buf);
  }
  // Only a collective owns both directions; a send or receive must not read the other lane's
  // counters, which a concurrent call on that lane may be writing.
  std::string counters;
  if (lane.lane != Lane::kRecv) {
    counters += "messages to it " + std::to_string(sent_[peer]);
  }
  if (lane.lane != Lane::kSend) {
    counters += std::string(counters.empty() ? "" : ", ") + "messages from it " +
                std::to_string(received_[peer]);
  }
  std::snprintf(buf, sizeof(buf), "Timed out after %.1f s waiting for rank %d (%s; %s; %s)", secs,
                peer, describeHeader(lane.header).c_str(), what, counters.c_str());
  return Status(Code::kTimeout, buf);
}

void ShmTransport::announce(const MessageHeader& header) {
  if (!checkDescriptors_) return;
  Announcement& a = rankControl(rank_)->announced[header.seq % kAnnouncements];
  a.seq.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  a.header = header;
  a.seq.store(header.seq, std::memory_order_seq_cst);
  wakeSleepers(a.seq, a.sleepers);
  announcedSeq_ = header.seq;
}

bool ShmTransport::announcement(int peer, uint64_t seq, MessageHeader* out) const {
  const Announcement& a = rankControl(peer)->announced[seq % kAnnouncements];
  if (a.seq.load(std::memory_order_acquire) != seq) return false;
  *out = a.header;
  std::atomic_thread_fence(std::memory_order_acquire);
  return a.seq.load(std::memory_order_relaxed) == seq;  // not rewritten while we copied
}

Status ShmTransport::peerCallAgrees(const LaneState& lane, int peer) const {
  MessageHeader theirs;
  if (!checkDescriptors_ || lane.collectiveSeq == 0 ||
      !announcement(peer, lane.collectiveSeq, &theirs)) {
    return Status::Ok();
  }
  if (lane.lane == Lane::kBoth && theirs == lane.header) return Status::Ok();
  return mismatch(lane, peer, theirs, 0, 0);
}

Status ShmTransport::agree() {
  if (!checkDescriptors_) return Status::Ok();
  const LaneState& lane = sendLane();
  const uint64_t seq = lane.collectiveSeq;
  for (int peer = 0; peer < worldSize(); ++peer) {
    if (peer == rank_) continue;
    Announcement& a = rankControl(peer)->announced[seq % kAnnouncements];
    DK_RETURN_IF_ERROR(waitFor(lane, peer, "waiting for it to start this collective", a.seq,
                               a.sleepers, [&](uint64_t s) { return s == seq; }));
    MessageHeader theirs;
    if (!announcement(peer, seq, &theirs)) return Internal("announcement rewritten while read");
    if (theirs != lane.header) return mismatch(lane, peer, theirs, 0, 0);
  }
  return Status::Ok();
}

Status ShmTransport::begin(const MessageHeader& header,
                           std::chrono::steady_clock::time_point deadline, Lane lane, bool inPlace,
                           bool interruptible) {
  LaneState state;
  state.header = header;
  state.lane = lane;
  state.inPlace = inPlace;
  state.collectiveSeq = lane == Lane::kBoth ? header.seq : announcedSeq_ + 1;
  state.interruptible = interruptible;
  state.sigintsAtStart = interruptible ? interrupt::sigintCount() : 0;
  state.deadline = deadline;
  state.started = std::chrono::steady_clock::now();
  if (lane != Lane::kRecv) sendLane() = state;
  if (lane != Lane::kSend) recvLane() = state;
  return health();
}

bool ShmTransport::findRegistered(const void* p, size_t bytes, uint32_t* id,
                                  uint64_t* offset) const {
  for (const auto& reg : registrations_) {
    if (reg.local->contains(p, bytes)) {
      *id = reg.id;
      *offset = static_cast<const char*>(p) - static_cast<const char*>(reg.local->data());
      return true;
    }
  }
  return false;
}

bool ShmTransport::sendFitsNow(int peer, size_t bytes) const {
  if (peer < 0 || peer >= worldSize() || peer == rank_) return false;
  const uint64_t slices = bytes == 0 ? 1 : (bytes + geometry_.slotBytes - 1) / geometry_.slotBytes;
  const uint64_t inFlight = sent_[peer] - fifo(rank_, peer)->tail.load(std::memory_order_acquire);
  return inFlight + slices <= static_cast<uint64_t>(geometry_.slotsPerFifo);
}

Status ShmTransport::postSend(const SendOp& send) {
  const int peer = send.peer;
  if (peer < 0 || peer >= worldSize() || peer == rank_) return Internal("send to a bad peer");
  if (send.bytes > geometry_.slotBytes) return Internal("message larger than a slot");
  FifoControl* f = fifo(rank_, peer);
  const uint64_t seq = sent_[peer];
  const uint64_t slots = geometry_.slotsPerFifo;
  DK_RETURN_IF_ERROR(waitFor(sendLane(), peer, "waiting for a free slot", f->tail, f->tailSleepers,
                             [&](uint64_t tail) { return seq - tail < slots; }));
  SlotDescriptor& desc = f->slots[seq % slots];
  uint32_t id = 0;
  uint64_t offset = 0;
  if (send.bytes > 0 && sendLane().inPlace && findRegistered(send.src, send.bytes, &id, &offset)) {
    desc.kind = static_cast<uint32_t>(PayloadKind::kRegistered);
    desc.bufferId = id;
    desc.offset = offset;
    zeroCopyUntil_[peer] = seq + 1;
  } else {
    if (send.bytes > 0) std::memcpy(slotData(rank_, peer, seq), send.src, send.bytes);
    desc.kind = static_cast<uint32_t>(PayloadKind::kInline);
  }
  desc.bytes = send.bytes;
  desc.header = sendLane().header;
  f->head.store(seq + 1, std::memory_order_seq_cst);
  wakeSleepers(f->head, f->headSleepers);
  ringDoorbell(peer);
  sent_[peer] = seq + 1;
  return Status::Ok();
}

void ShmTransport::ringDoorbell(int peer) {
  Doorbell& bell = rankControl(peer)->doorbell;
  if (bell.waiting.load(std::memory_order_seq_cst) == 0) return;  // after our head store
  bell.rings.fetch_add(1, std::memory_order_seq_cst);
  wakeSleepers(bell.rings, bell.sleepers);
}

Status ShmTransport::mismatch(const LaneState& lane, int peer, const MessageHeader& theirs,
                              uint64_t bytes, uint64_t expected) const {
  const MessageHeader& mine = lane.header;
  std::string msg = "ranks disagree: rank " + std::to_string(peer) + " called " +
                    describeHeader(theirs) + " but rank " + std::to_string(rank_) + " called " +
                    describeHeader(mine);
  if (lane.lane != Lane::kBoth && theirs.seq != 0) {
    msg += " (a " + std::string(lane.lane == Lane::kSend ? "send to" : "receive from") +
           " it, which must end before this rank can join a collective)";
  }
  if (theirs == mine) {
    msg = "ranks disagree: rank " + std::to_string(peer) + " sent " + std::to_string(bytes) +
          " bytes where rank " + std::to_string(rank_) + " expected " + std::to_string(expected) +
          " in " + describeHeader(mine);
  }
  return Status(Code::kMismatch, msg);
}

Status ShmTransport::payloadPointer(int peer, const SlotDescriptor& desc, const void** data) const {
  if (desc.kind == static_cast<uint32_t>(PayloadKind::kInline)) {
    *data = slotData(peer, rank_, received_[peer]);
    return Status::Ok();
  }
  for (const auto& reg : registrations_) {
    if (reg.id != desc.bufferId) continue;
    const Segment& theirs = *reg.peers[peer];
    if (desc.offset > theirs.size() || desc.bytes > theirs.size() - desc.offset) break;
    *data = static_cast<const char*>(theirs.data()) + desc.offset;
    return Status::Ok();
  }
  return Status(Code::kMismatch, "rank " + std::to_string(peer) + " sent from registered buffer " +
                                     std::to_string(desc.bufferId) +
                                     " which this rank has not registered");
}

Status ShmTransport::completeRecv(RecvOp& recv) {
  const int peer = recv.peer;
  if (peer < 0 || peer >= worldSize() || peer == rank_) return Internal("recv from a bad peer");
  FifoControl* f = fifo(peer, rank_);
  const uint64_t seq = received_[peer];
  DK_RETURN_IF_ERROR(waitFor(recvLane(), peer, "waiting for a message", f->head, f->headSleepers,
                             [&](uint64_t head) { return head > seq; }));
  const SlotDescriptor& desc = f->slots[seq % geometry_.slotsPerFifo];
  if ((checkDescriptors_ && desc.header != recvLane().header) || desc.bytes != recv.bytes) {
    return mismatch(recvLane(), peer, desc.header, desc.bytes, recv.bytes);
  }
  DK_RETURN_IF_ERROR(payloadPointer(peer, desc, &recv.data));
  received_[peer] = seq + 1;
  return Status::Ok();
}

Status ShmTransport::peekMessage(int peer, MessageHeader* next) {
  if (peer < 0 || peer >= worldSize() || peer == rank_) return Internal("peek at a bad peer");
  FifoControl* f = fifo(peer, rank_);
  const uint64_t seq = received_[peer];
  DK_RETURN_IF_ERROR(waitFor(recvLane(), peer, "waiting for a message", f->head, f->headSleepers,
                             [&](uint64_t head) { return head > seq; }));
  *next = f->slots[seq % geometry_.slotsPerFifo].header;
  return Status::Ok();
}

Status ShmTransport::exchange(const SendOp* sends, int nsends, RecvOp* recvs, int nrecvs) {
  for (int i = 0; i < nsends; ++i) DK_RETURN_IF_ERROR(postSend(sends[i]));
  for (int i = 0; i < nrecvs; ++i) DK_RETURN_IF_ERROR(completeRecv(recvs[i]));
  return Status::Ok();
}

Status ShmTransport::exchangeSmall(const void* src, size_t bytes, const void** data) {
  const LaneState& lane = sendLane();
  const uint64_t seq = lane.header.seq;
  if (lane.lane != Lane::kBoth || seq == 0) return Internal("small exchange outside a collective");
  if (!fitsSmall(bytes)) return Internal("small exchange of too many bytes, or boxes off");
  LowLatencyBox* mine = lowLatencyBox(rank_, seq);
  if (bytes > 0) std::memcpy(mine->data, src, bytes);
  mine->bytes = static_cast<uint32_t>(bytes);
  mine->header = lane.header;
  // seq_cst: the Dekker pairing with a peer that registers in `sleepers` before it sleeps.
  mine->seq.store(seq, std::memory_order_seq_cst);
  wakeSleepers(mine->seq, mine->sleepers);
  const int n = worldSize();
  for (int d = 1; d < n; ++d) {  // nearest peer first, as exchange() sends
    const int peer = (rank_ + d) % n;
    LowLatencyBox* theirs = lowLatencyBox(peer, seq);
    // No peer reaches seq + 2 before this rank has finished seq + 1 (see LowLatencyBox).
    DK_RETURN_IF_ERROR(waitFor(lane, peer, "waiting for its small message", theirs->seq,
                               theirs->sleepers, [&](uint64_t s) { return s == seq; }));
    if (theirs->header != lane.header || theirs->bytes != bytes) {
      return mismatch(lane, peer, theirs->header, theirs->bytes, bytes);
    }
    data[peer] = theirs->data;
  }
  return Status::Ok();
}

bool ShmTransport::peerDied(int peer) const {
  return peer >= 0 && peer < worldSize() && rankControl(peer)->dead.load(std::memory_order_acquire);
}

bool ShmTransport::pendingFrom(int peer) const {
  const FifoControl* f = fifo(peer, rank_);
  const uint64_t seq = received_[peer];
  if (f->head.load(std::memory_order_seq_cst) <= seq) return false;
  // A collective's message (the peer has started one) is not for a receive.
  const MessageHeader& h = f->slots[seq % geometry_.slotsPerFifo].header;
  return isPointToPoint(h);
}

bool ShmTransport::pendingSource(int* source) const {
  const int n = worldSize();
  for (int i = 1; i <= n; ++i) {
    const int peer = (lastSource_ + i) % n;
    if (peer != rank_ && !gone_[peer] && pendingFrom(peer)) {
      *source = peer;
      return true;
    }
  }
  return false;
}

Status ShmTransport::pointToPointPeerAlive(const LaneState& lane, int peer) {
  Status alive = peerAlive(peer);
  if (alive.ok() || lane.lane == Lane::kBoth || !peerDied(peer)) return alive;
  if (lane.lane == Lane::kRecv) {
    gone_[peer] = 1;
  } else {
    zeroCopyUntil_[peer] = 0;  // it will never read our buffer: later finish() calls go on
  }
  return Status(Code::kPeerLost, alive.message());
}

Status ShmTransport::sourceAlive(int peer) {
  Status alive = peerAlive(peer);
  if (alive.ok() || pendingFrom(peer)) return Status::Ok();  // what it sent before it went
  const bool closed = rankControl(peer)->closed.load(std::memory_order_acquire);
  if (!closed && !peerDied(peer)) return alive;  // not gone: a system call failed
  gone_[peer] = 1;
  // Closed cleanly: it sends nothing more, and no receive from any source needs it.
  return closed ? Status::Ok() : Status(Code::kPeerLost, alive.message());
}

Status ShmTransport::checkSources(const LaneState& lane) {
  int live = 0, example = -1;
  bool allInCollective = checkDescriptors_;
  MessageHeader theirs, exampleCall;
  for (int peer = 0; peer < worldSize(); ++peer) {
    if (peer == rank_ || gone_[peer]) continue;
    DK_RETURN_IF_ERROR(sourceAlive(peer));
    if (gone_[peer]) continue;
    ++live;
    // A peer that started the next collective cannot send to this rank before it ends, and
    // this rank cannot join it before this receive ends. Its announcement is read before its
    // head, so a message it sent before announcing is seen.
    if (allInCollective && announcement(peer, lane.collectiveSeq, &theirs) && !pendingFrom(peer)) {
      if (example < 0) example = peer, exampleCall = theirs;
    } else {
      allInCollective = false;
    }
  }
  if (live == 0) {
    return Status(Code::kPeerFailure,
                  "every other rank closed the communicator or died: none is left to send to "
                  "this one (" +
                      describeHeader(lane.header) + " from any rank)");
  }
  if (!allInCollective) return Status::Ok();
  return Status(Code::kMismatch, "ranks disagree: rank " + std::to_string(rank_) + " called " +
                                     describeHeader(lane.header) +
                                     " from any rank, but every other rank has started a "
                                     "collective (rank " +
                                     std::to_string(example) + " called " +
                                     describeHeader(exampleCall) + ")");
}

Status ShmTransport::waitAnySource(int* source) {
  const LaneState& lane = recvLane();
  Doorbell& bell = rankControl(rank_)->doorbell;
  bell.waiting.store(1, std::memory_order_seq_cst);  // before the heads are read
  Backoff backoff(oversubscribed_, &spinBudget_);
  bool armed = false;
  Status status;
  for (uint64_t rung = bell.rings.load(std::memory_order_seq_cst); !pendingSource(source);
       rung = bell.rings.load(std::memory_order_seq_cst)) {
    if (header()->abortRank.load(std::memory_order_relaxed) != 0) {
      status = health();
    } else if (backoff.shouldCheck()) {
      status = waitChecks(lane, backoff, &armed, -1, kAnySourceWait);
      if (status.ok()) status = checkSources(lane);
      if (status.ok() && std::chrono::steady_clock::now() >= lane.deadline) {
        status = timedOut(lane, -1, kAnySourceWait);
      }
    }
    if (!status.ok()) break;
    backoff.pause(bell.rings, rung, bell.sleepers);
  }
  bell.waiting.store(0, std::memory_order_relaxed);
  if (status.ok()) lastSource_ = *source;
  return status;
}

Status ShmTransport::release(const RecvOp* recvs, int nrecvs) {
  for (int i = 0; i < nrecvs; ++i) {
    const int peer = recvs[i].peer;
    if (released_[peer] >= received_[peer]) return Internal("release without a receive");
    released_[peer] += 1;
    FifoControl* f = fifo(peer, rank_);
    f->tail.store(released_[peer], std::memory_order_seq_cst);
    wakeSleepers(f->tail, f->tailSleepers);
  }
  return Status::Ok();
}

Status ShmTransport::finish() {
  for (int peer = 0; peer < worldSize(); ++peer) {
    const uint64_t until = zeroCopyUntil_[peer];
    if (peer == rank_ || until == 0) continue;
    FifoControl* f = fifo(rank_, peer);
    DK_RETURN_IF_ERROR(waitFor(sendLane(), peer, "waiting for it to read our buffer in place",
                               f->tail, f->tailSleepers,
                               [&](uint64_t tail) { return tail >= until; }));
    zeroCopyUntil_[peer] = 0;
  }
  return Status::Ok();
}

Status ShmTransport::registerBuffer(uint32_t id, std::shared_ptr<Segment> local,
                                    std::vector<std::shared_ptr<Segment>> peers) {
  if (static_cast<int>(peers.size()) != worldSize()) return Internal("one segment per rank");
  registrations_.push_back({id, std::move(local), std::move(peers)});
  return Status::Ok();
}

}  // namespace dk::shm
