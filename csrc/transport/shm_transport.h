// ShmTransport: the Transport of CPU processes on one host, over one shared segment
// (shm_layout.h) holding a FIFO of slots per ordered pair of ranks.
//
// A send either copies its bytes into the next free slot of the (this rank -> peer) FIFO, or,
// when the bytes lie in a registered buffer (comm.empty), publishes only a descriptor so the
// peer reads them in place. A receive waits for the descriptor and returns a pointer into the
// slot or into the sender's registered buffer; the algorithm reduces or copies straight from
// there, then release() hands the slot back. So a plain tensor costs one copy into the slot
// and a registered tensor none.
//
// Every wait polls the segment's abort word (any rank's failure stops every rank), checks the
// collective's deadline and whether the awaited peer is alive.
//
// Lanes: a send only touches this rank's outgoing FIFOs (sent_, zeroCopyUntil_) and a receive
// only its incoming ones (received_, released_), so one send and one receive may run at once on
// two threads: a pipeline stage sends its activation while another thread waits for the next
// gradient, as non-blocking send/recv pairs do. A collective holds both lanes.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "transport/shm_backoff.h"
#include "transport/shm_layout.h"
#include "transport/shm_segment.h"
#include "transport/transport.h"

namespace dk::shm {

// e.g. "all_reduce(count=100, float32, sum, root=-1, algorithm 1)", "send/recv(count=8,
// uint8, tag=3)"
std::string describeHeader(const MessageHeader& header);

// A send / receive's message (its header's op is the tag), not a collective's.
inline bool isPointToPoint(const MessageHeader& h) {
  return static_cast<CollectiveKind>(h.collective & 0xff) == CollectiveKind::kSendRecv &&
         h.seq == 0;
}

// Which side of the FIFOs a call uses (see the file comment); kBoth for collectives.
enum class Lane : int { kSend = 0, kRecv = 1, kBoth = 2 };

class ShmTransport : public Transport {
 public:
  // The local leader formats a freshly created segment before publishing its name.
  static Status formatSegment(Segment& segment, const SegmentGeometry& geometry);
  // Every rank (leader included) attaches to the formatted segment.
  static Status attach(std::shared_ptr<Segment> segment, int rank, bool oversubscribed,
                       std::unique_ptr<ShmTransport>* out);
  ~ShmTransport() override;

  int rank() const override { return rank_; }
  int worldSize() const override { return geometry_.worldSize; }
  bool deviceMemory() const override { return false; }
  size_t maxMessageBytes() const override { return geometry_.slotBytes; }
  Status exchange(const SendOp* sends, int nsends, RecvOp* recvs, int nrecvs) override;
  Status release(const RecvOp* recvs, int nrecvs) override;
  Status finish() override;
  // With descriptor checks on (the boxes' reuse rests on them; see LowLatencyBox).
  size_t smallMessageBytes() const override {
    return checkDescriptors_ && worldSize() > 1 ? kLowLatencyBytes : 0;
  }
  Status exchangeSmall(const void* src, size_t bytes, const void** data) override;
  // Receive lane. Skips peers whose first unreceived message belongs to a collective (a peer
  // may start one while this rank still receives: that message is not for this call) and
  // peers that closed or died with nothing left to receive. A peer found dead is reported once,
  // as Code::kPeerLost (not a failure of the communicator: the caller may go on with the
  // others), and skipped from then on.
  Status waitAnySource(int* source) override;
  // True once some rank found `peer`'s process dead (it exited holding the communicator).
  bool peerDied(int peer) const;
  // Receive lane: waits until `peer` has a message for this rank that this rank has not
  // received, and sets *next to its header without taking it (a tagged receive looks before
  // it takes: CpuCommunicator::receive).
  Status peekMessage(int peer, MessageHeader* next);
  // Receive lane: the header incoming messages must match from now on, in place of the one
  // begin() set (a message of another tag received to be set aside, then the call's own).
  void expect(const MessageHeader& header) { recvLane().header = header; }

  // Starts one collective (or one send / receive, on its lane): later messages carry `header`,
  // incoming ones must match it, and every wait gives up at `deadline`. Calls on different
  // lanes may run concurrently; calls on one lane may not. `inPlace` false: sends copy even
  // bytes in registered memory (so they never wait for the peer to read them).
  // `interruptible`: a SIGINT from now on ends every wait of the call (Code::kInterrupted).
  Status begin(const MessageHeader& header, std::chrono::steady_clock::time_point deadline,
               Lane lane = Lane::kBoth, bool inPlace = true, bool interruptible = false);
  // Posts this rank's descriptor of the collective it starts (header.seq > 0; both lanes
  // held) before anything is sent: while a peer waits for this rank it compares, so ranks
  // that called different things fail at once instead of at the deadline.
  void announce(const MessageHeader& header);
  // Ends a collective whose data flow does not make every rank check every other (a
  // broadcast: the root receives nothing; a zero-byte call): waits until every rank has
  // announced this collective and fails if any announced something else. Collectives that
  // need every rank's data (all-reduce, reduce-scatter, all-gather, barrier) need not call
  // it: each rank's last receive depends, through the chain of checked headers, on every
  // rank having sent this collective's header.
  Status agree();
  // Off: no announcements, no agreement, and a receive compares only the byte count, not the
  // descriptor: what the disagreement check costs, for the benchmark (DK_CHECK_DESCRIPTORS=0).
  // Every rank of the segment must use the same setting (local rank 0 decides).
  void setDescriptorChecks(bool on) { checkDescriptors_ = on; }
  // Makes every wait of this rank (on any thread) fail within one futex timeout: close() uses
  // it so that no thread is left blocked inside a communicator that is going away.
  void cancel() { cancelled_.store(true, std::memory_order_release); }
  // Liveness: the calling thread takes this rank's robust mutex and keeps it until
  // markClosed(); it must be a thread that lives as long as the communicator.
  Status holdLiveness();
  void markClosed();
  // True if a send of `bytes` to `peer`, copied (begin() with inPlace false), can complete
  // now without waiting: every slice fits in a free slot. Send lane only.
  bool sendFitsNow(int peer, size_t bytes) const;
  // Records a failure in the segment (first one wins) so every rank's waits stop.
  void poison(const Status& failure);
  // OK, or the failure some rank recorded.
  Status health() const;
  // A collective (comm.empty) registered `local` on this rank and `peers[r]` on rank r.
  Status registerBuffer(uint32_t id, std::shared_ptr<Segment> local,
                        std::vector<std::shared_ptr<Segment>> peers);

 private:
  ShmTransport(std::shared_ptr<Segment> segment, int rank, bool oversubscribed);
  SegmentHeader* header() const;
  RankControl* rankControl(int r) const;
  FifoControl* fifo(int sender, int receiver) const;
  char* slotData(int sender, int receiver, uint64_t seq) const;
  // Rank r's small-message box for collective `seq`.
  LowLatencyBox* lowLatencyBox(int r, uint64_t seq) const;
  // The call in progress on one lane.
  struct LaneState {
    MessageHeader header;
    Lane lane = Lane::kBoth;  // of the call: errors report only the counters of its lanes
    bool inPlace = true;      // registered bytes are published for the peer to read in place
    // The collective a peer's announcement is compared with: the one running (both lanes),
    // or for a send / receive the next one, which a peer starts only once its own side of
    // this call has ended (so waitFor reads the awaited word again before it reports a
    // mismatch: the peer may have delivered and moved on meanwhile). 0: no comparison.
    uint64_t collectiveSeq = 0;
    bool interruptible = false;
    uint64_t sigintsAtStart = 0;  // interrupt::sigintCount() when the call began
    std::chrono::steady_clock::time_point deadline;
    std::chrono::steady_clock::time_point started;
  };
  LaneState& sendLane() { return lanes_[static_cast<int>(Lane::kSend)]; }
  LaneState& recvLane() { return lanes_[static_cast<int>(Lane::kRecv)]; }
  // Waits until ready(word) holds, polling abort, cancel, deadline and the peer's liveness.
  template <typename Ready>
  Status waitFor(const LaneState& lane, int peer, const char* what,
                 const std::atomic<uint64_t>& word, std::atomic<uint32_t>& sleepers, Ready ready);
  // The checks of a wait's slow path that concern no peer: close(), Ctrl-C, the deadline.
  Status waitChecks(const LaneState& lane, const Backoff& backoff, bool* armed, int peer,
                    const char* what) const;
  // peer < 0: a wait for any source.
  Status timedOut(const LaneState& lane, int peer, const char* what) const;
  Status interrupted(const LaneState& lane, int peer, const char* what) const;
  // Fails if `peer` announced a collective this call cannot be paired with (see announce()).
  Status peerCallAgrees(const LaneState& lane, int peer) const;
  // The peer's announcement of collective `seq`, if it has made it (false otherwise).
  bool announcement(int peer, uint64_t seq, MessageHeader* out) const;
  Status peerAlive(int peer);
  // peerAlive() of a wait inside a call. A send or receive whose peer died fails alone
  // (Code::kPeerLost: no other rank depends on this call, and the communicator stays usable
  // with them; a receive from any source skips the peer from then on); a collective, or a
  // peer that closed while a call needed it, fails the communicator.
  Status pointToPointPeerAlive(const LaneState& lane, int peer);
  // A candidate of a receive from any source that has sent nothing: one that closed is
  // skipped, one that died is reported once (Code::kPeerLost) and skipped from then on.
  Status sourceAlive(int peer);
  // The next peer in turn (after the last source) with an unreceived point-to-point message.
  bool pendingSource(int* source) const;
  bool pendingFrom(int peer) const;
  // Slow path of waitAnySource: drops closed peers, reports dead ones, fails when every
  // peer is gone or in a collective (none of them can send this rank a message then).
  Status checkSources(const LaneState& lane);
  Status postSend(const SendOp& send);
  Status completeRecv(RecvOp& recv);
  Status payloadPointer(int peer, const SlotDescriptor& desc, const void** data) const;
  Status mismatch(const LaneState& lane, int peer, const MessageHeader& theirs, uint64_t bytes,
                  uint64_t expected) const;
  bool findRegistered(const void* p, size_t bytes, uint32_t* id, uint64_t* offset) const;
  // After a message to `peer` is published: wakes it if it waits for any source.
  void ringDoorbell(int peer);

  struct Registration {
    uint32_t id;
    std::shared_ptr<Segment> local;
    std::vector<std::shared_ptr<Segment>> peers;
  };

  std::shared_ptr<Segment> segment_;
  SegmentGeometry geometry_;
  int rank_;
  bool oversubscribed_;
  SpinBudget spinBudget_;  // the spin of its waits (a core per rank), adapted as they go
  bool checkDescriptors_ = true;
  bool holdsLiveness_ = false;
  LaneState lanes_[2];  // indexed by Lane::kSend, Lane::kRecv
  std::atomic<bool> cancelled_{false};
  uint64_t announcedSeq_ = 0;            // seq of the last announce(); changed with both lanes held
  std::vector<uint64_t> sent_;           // per peer: messages posted (local copy of head)
  std::vector<uint64_t> received_;       // per peer: messages taken
  std::vector<uint64_t> released_;       // per peer: messages handed back (local copy of tail)
  std::vector<uint64_t> zeroCopyUntil_;  // per peer: head after our last in-place send
  std::vector<uint8_t> gone_;            // per peer: closed or died, skipped by any-source waits
  int lastSource_ = 0;                   // the last any-source receive's source (round robin)
  std::vector<Registration> registrations_;
};

}  // namespace dk::shm
