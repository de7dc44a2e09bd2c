// The shared-memory segment of one host's communicator: control block, one control line per
// rank, then one FIFO of slots per ordered pair of ranks (sender -> receiver).
//
//   offset 0            SegmentHeader        (magic, geometry, abort word + reason)
//   rankControlOffset   RankControl[n]       (liveness mutex, closed flag, the rank's last two
//                                              collective announcements, its doorbell), one
//                                              per rank
//   fifoControlOffset   FifoControl[n(n-1)]  (head, tail, slot descriptors), one per pair
//   lowLatencyOffset    LowLatencyBox[n][2]  (small collectives: flag, descriptor and data
//                                              together), page aligned
//   slotDataOffset      slot data[n(n-1)][slots][slotBytes], page aligned
//
// Every field written by one rank and polled by another sits on its own cache line, so a
// sender bumping `head` does not invalidate the line its receiver writes `tail` on.
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace dk::shm {

constexpr size_t kCacheLine = 64;
constexpr size_t kPage = 4096;
constexpr uint64_t kMagic = 0x646b2d73686d3035ull;  // "dk-shm05"
constexpr int kMaxSlots = 8;
constexpr size_t kReasonBytes = 448;

// The collective a message belongs to (low byte of MessageHeader::collective; the next byte
// holds the algorithm, so ranks that picked different algorithms are told apart too).
enum class CollectiveKind : uint32_t {
  kAllReduce = 1,
  kReduceScatter = 2,
  kAllGather = 3,
  kBroadcast = 4,
  kSendRecv = 5,
  kBarrier = 6,
  kFingerprint = 7,
  kAllToAll = 8,
};

// The collective's name as users call it ("send/recv" for the point-to-point kind).
inline const char* collectiveKindName(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllReduce:
      return "all_reduce";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::kAllGather:
      return "all_gather";
    case CollectiveKind::kBroadcast:
      return "broadcast";
    case CollectiveKind::kSendRecv:
      return "send/recv";
    case CollectiveKind::kBarrier:
      return "barrier";
    case CollectiveKind::kFingerprint:
      return "fingerprint";
    case CollectiveKind::kAllToAll:
      return "all_to_all";
  }
  return "unknown collective";
}

// What a collective message claims to belong to (the call's descriptor): a receiver compares
// it with its own call, so ranks that disagree on the collective, count, dtype, op, root or
// position in the call sequence fail instead of mixing bytes.
struct MessageHeader {
  uint32_t collective = 0;  // CollectiveKind
  uint32_t dtype = 0;
  uint32_t op = 0;
  int32_t root = 0;    // broadcast root / p2p peer / algorithm, -1 when unused
  uint64_t count = 0;  // elements of the collective (per rank for scatter / gather)
  // 1 + the number of collectives this communicator ran before (0: a send / receive, which
  // FIFO order matches, or the DK_DEBUG probe).
  uint64_t seq = 0;
  bool operator==(const MessageHeader& o) const {
    return collective == o.collective && dtype == o.dtype && op == o.op && root == o.root &&
           count == o.count && seq == o.seq;
  }
  bool operator!=(const MessageHeader& o) const { return !(*this == o); }
};
static_assert(sizeof(MessageHeader) == 32, "MessageHeader is part of the shared layout");

enum class PayloadKind : uint32_t {
  kInline = 0,      // bytes copied into the slot
  kRegistered = 1,  // bytes read in place from the sender's registered buffer
};

// One message in flight: written by the sender before it publishes `head`.
struct alignas(kCacheLine) SlotDescriptor {
  uint64_t bytes;
  uint32_t kind;      // PayloadKind
  uint32_t bufferId;  // registered buffer, when kind == kRegistered
  uint64_t offset;    // byte offset inside that buffer
  MessageHeader header;
};
static_assert(sizeof(SlotDescriptor) == kCacheLine, "one descriptor per cache line");

struct alignas(kCacheLine) FifoControl {
  alignas(kCacheLine) std::atomic<uint64_t> head;  // messages posted (sender writes)
  std::atomic<uint32_t> headSleepers;              // receivers asleep on head (futex)
  alignas(kCacheLine) std::atomic<uint64_t> tail;  // messages released (receiver writes)
  std::atomic<uint32_t> tailSleepers;              // senders asleep on tail (futex)
  SlotDescriptor slots[kMaxSlots];
};
static_assert(offsetof(FifoControl, head) == 0, "head on the first line");
static_assert(offsetof(FifoControl, tail) == kCacheLine, "tail on its own line");
static_assert(offsetof(FifoControl, slots) == 2 * kCacheLine, "descriptors after the counters");
static_assert(sizeof(FifoControl) == (2 + kMaxSlots) * kCacheLine, "FifoControl size");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared atomics must be lock-free");

// A rank's descriptor of the collective it has started, posted before it sends anything, so a
// peer that waits for it can tell a rank that called something else (and would never send
// what it waits for) from a slow one, and a broadcast root, which receives nothing, can check
// every rank's call. Written like a seqlock: `seq` 0 while the header is rewritten.
struct alignas(kCacheLine) Announcement {
  std::atomic<uint64_t> seq;       // MessageHeader::seq of `header`, 0 while being written
  std::atomic<uint32_t> sleepers;  // peers asleep on `seq` (futex)
  MessageHeader header;
};
static_assert(sizeof(Announcement) == kCacheLine, "one announcement per cache line");
// Two announcements per rank, indexed by seq % 2: a rank finishes collective s only after
// every rank has announced s (an all-reduce, gather or scatter needs every rank's data; a
// broadcast checks the announcements), so no rank announces s + 2 while a peer still reads s.
constexpr int kAnnouncements = 2;

// A rank's box for small collectives (NCCL's low-latency protocol, done with a cache line's
// flag): the writer copies its bytes and descriptor, then stores `seq` last; a reader that sees
// `seq` holds the whole message. A FIFO message costs a descriptor line, a head line, the
// payload and a tail line handed back; this costs the flag line (which carries the descriptor
// and the first 16 bytes: an 8 B all-reduce moves one line per peer) and nothing to hand back.
// Two boxes per rank, by collective seq % 2; box s % 2 is rewritten at s + 2, which a rank
// starts only after it finished s + 1, and no rank finishes s + 1 before every rank has started
// it (ShmTransport::agree(), with descriptor checks on), so before every rank finished reading
// s. Without descriptor checks broadcasts do not wait for that, and these boxes stay unused.
// 8 KiB: the sizes benchmarks and latency-bound calls use most (4 and 8 KiB included), where
// the FIFO one-shot took 2.4 and 3.0 us against 1.8 us through a box at 2 KiB.
constexpr size_t kLowLatencyBytes = 8192;
struct alignas(kCacheLine) LowLatencyBox {
  std::atomic<uint64_t> seq;       // MessageHeader::seq of the message, stored last (0: none)
  std::atomic<uint32_t> sleepers;  // peers asleep on `seq` (futex)
  uint32_t bytes;
  MessageHeader header;
  unsigned char data[kLowLatencyBytes];
};
static_assert(offsetof(LowLatencyBox, data) == 48, "16 bytes of data on the flag line");
static_assert(sizeof(LowLatencyBox) % kCacheLine == 0, "boxes on their own lines");
constexpr int kLowLatencyBoxes = 2;

// What a receive from any source sleeps on. A named receive sleeps on its FIFO's `head`; one
// that waits for whichever peer sends first cannot sleep on n - 1 words, so while `waiting` is
// set every sender to this rank also rings `rings` after publishing its message (Dekker: the
// receiver sets `waiting`, then scans the heads; a sender stores `head`, then reads `waiting`;
// one of the two sees the other). A send to a rank that is not waiting reads one shared line.
struct alignas(kCacheLine) Doorbell {
  std::atomic<uint64_t> rings;     // bumped by senders while `waiting` is 1
  std::atomic<uint32_t> sleepers;  // this rank asleep on `rings` (futex)
  std::atomic<uint32_t> waiting;   // 1 while this rank waits for a message from any peer
};
static_assert(sizeof(Doorbell) == kCacheLine, "one doorbell per cache line");

// One per rank. The rank's dispatcher thread (OpQueue) holds `alive` (a robust, process-shared
// mutex) for the communicator's whole life: when the process dies the kernel marks the mutex
// owner-dead, and a peer's trylock returns EOWNERDEAD, even while the dead process is still a
// zombie.
struct alignas(kCacheLine) RankControl {
  pthread_mutex_t alive;
  alignas(kCacheLine) std::atomic<uint32_t> attached;  // 1 once the rank holds `alive`
  std::atomic<uint32_t> closed;                        // 1 after a clean close()
  std::atomic<uint32_t> dead;                          // 1 once a peer saw it owner-dead
  int32_t pid;
  Announcement announced[kAnnouncements];
  Doorbell doorbell;
};
static_assert(sizeof(pthread_mutex_t) <= kCacheLine, "mutex fits one line");
static_assert(offsetof(RankControl, announced) == 2 * kCacheLine, "announcements on own lines");
static_assert(offsetof(RankControl, doorbell) == (2 + kAnnouncements) * kCacheLine,
              "doorbell on its own line");
static_assert(sizeof(RankControl) == (3 + kAnnouncements) * kCacheLine, "RankControl size");

struct alignas(kCacheLine) SegmentHeader {
  uint64_t magic;
  uint32_t worldSize;
  uint32_t slotsPerFifo;
  uint64_t slotBytes;
  uint64_t totalBytes;
  // First failure wins: 0 = healthy, else 1 + the failing rank. Every wait polls it, so one
  // rank's error (mismatch, timeout, dead peer) stops every rank promptly.
  alignas(kCacheLine) std::atomic<uint32_t> abortRank;
  std::atomic<uint32_t> abortReady;  // 1 once `abortReason` and `abortCode` are written
  int32_t abortCode;                 // dk::Code of the failure
  char abortReason[kReasonBytes];
};
static_assert(offsetof(SegmentHeader, abortRank) == kCacheLine, "abort word on its own line");
static_assert(sizeof(SegmentHeader) == 2 * kCacheLine + kReasonBytes, "SegmentHeader size");

// Byte offsets of each region, computed identically by every rank from (n, slots, slotBytes).
struct SegmentGeometry {
  int worldSize;
  int slotsPerFifo;
  size_t slotBytes;
  size_t rankControlOffset;
  size_t fifoControlOffset;
  size_t lowLatencyOffset;
  size_t slotDataOffset;
  size_t totalBytes;

  int numFifos() const { return worldSize * (worldSize - 1); }
  // Pairs are numbered sender-major, skipping the diagonal (a rank never sends to itself).
  int fifoIndex(int sender, int receiver) const {
    return sender * (worldSize - 1) + (receiver < sender ? receiver : receiver - 1);
  }
};

inline size_t alignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

inline SegmentGeometry makeGeometry(int worldSize, int slotsPerFifo, size_t slotBytes) {
  SegmentGeometry g{worldSize, slotsPerFifo, slotBytes, 0, 0, 0, 0, 0};
  g.rankControlOffset = alignUp(sizeof(SegmentHeader), kCacheLine);
  g.fifoControlOffset = g.rankControlOffset + worldSize * sizeof(RankControl);
  g.lowLatencyOffset = alignUp(g.fifoControlOffset + g.numFifos() * sizeof(FifoControl), kPage);
  g.slotDataOffset =
      alignUp(g.lowLatencyOffset + worldSize * kLowLatencyBoxes * sizeof(LowLatencyBox), kPage);
  g.totalBytes = g.slotDataOffset + static_cast<size_t>(g.numFifos()) * slotsPerFifo * slotBytes;
  g.totalBytes = alignUp(g.totalBytes, kPage);
  return g;
}

}  // namespace dk::shm

namespace dk::shm {

// Default FIFO geometry: 4 slots of 512 KiB per ordered pair up to 4 ranks, then smaller slots
// so the segment stays under ~64 MiB of address space (only pairs actually used get touched).
// Measured at 2 ranks (fp32 all_reduce, 64 MiB, registered buffers): see docs/architecture.md.
inline SegmentGeometry defaultGeometry(int worldSize) {
  constexpr int kSlots = 4;
  constexpr size_t kBudget = size_t{64} << 20;
  size_t slotBytes = size_t{512} << 10;
  const size_t fifos = static_cast<size_t>(worldSize) * (worldSize > 1 ? worldSize - 1 : 0);
  while (slotBytes > (size_t{64} << 10) && fifos * kSlots * slotBytes > kBudget) slotBytes /= 2;
  return makeGeometry(worldSize, kSlots, slotBytes);
}

}  // namespace dk::shm
