// trn's own intra-host channel: one single-producer / single-consumer byte ring in shared memory
// per ordered pair of ranks on a host. Internal to collectives/fabric.
//
// Why: a small message through libfabric's shm provider pays its command queue, its locks, a
// completion queue entry and an inject copy per message; a ring needs one copy in, one copy out
// and two cache lines of shared counters (bench/results/2026-11-30-shm-rings.md). Transport sends
// messages up to a threshold through the ring and announces longer ones there: the receiver
// copies their bytes straight out of the sender's memory (process_vm_readv) and acknowledges in
// its own ring, or, where the kernel does not allow that, they go by libfabric's shm (ring_channel.h).
// Rings take no locks, so a rank killed at any point cannot leave its peers spinning on one.
//
// Each rank creates one segment (shm_open) holding a ring for every other rank on its host:
// it reads them, the others write. Layout of a ring (positions are byte counts that only grow;
// a position's place in the data is position % capacity):
//
//   cache line 0   head: written by the producer (release) after a record's bytes
//   cache line 1   tail: written by the consumer (release) after it is done with a record
//   cache line 2   closed: set by the producer when it lets go of its buffers (abort, close, or
//                  the loss of a rank, which it names there); a consumer that pulled bytes
//                  checks it afterwards (ring_channel.h)
//   data           records, each 64-byte aligned: {tag u64, len u32, kind u16, offset u16},
//                  then len bytes from offset on (ring_payload_offset). A record never wraps;
//                  the producer pads to the end of the data instead.
//
// The reader trusts nothing in its ring: a peer may write anything into the segment (a bug, or
// a process of the same user that is not trn). It reads a record's header once, takes only
// records that lie within the bytes the head says are ready and before the ring's end, and
// refuses anything else with a remote_error that says what the writer did ("it wrote ..."); the
// transport then loses that peer, naming it (ring_channel.h). The payloads the transport reads out
// of records are checked the same way (decode_ring_payload). tests/fuzz/shm_ring.cc fuzzes both.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace trn::fabric {

inline constexpr size_t kRingAlign = 64;
// The longest message that may travel inside a ring. A ring's data is four times the eager
// limit its reader chose (so a few messages are in flight at once), rounded up to a power of two
// and at least 64 KiB.
inline constexpr size_t kRingMaxEager = size_t{1} << 20;
size_t ring_capacity_for(size_t eager);

struct RingControl {
  alignas(kRingAlign) std::atomic<uint64_t> head;
  alignas(kRingAlign) std::atomic<uint64_t> tail;
  alignas(kRingAlign) std::atomic<uint64_t> closed;
};
static_assert(sizeof(RingControl) == 3 * kRingAlign);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

struct RingRecordHeader {
  uint64_t tag;
  uint32_t len;
  uint16_t kind;
  uint16_t offset;  // of the payload from the record's start
};
static_assert(sizeof(RingRecordHeader) == 16);
// Where a payload of len bytes copied from src starts within its record: right after the
// header, except that from kRingAlignedPayload bytes on it starts at src's offset within a cache
// line (records start on cache lines). memcpy in and out then copies between addresses a
// multiple of 64 bytes apart when both ranks' buffers are aligned alike; a few bytes apart,
// glibc's `rep movsb` runs markedly slower on AMD Zen (core/aligned.h;
// bench/results/2026-11-30-buffer-alignment.md).
inline constexpr size_t kRingAlignedPayload = 1024;
inline size_t ring_payload_offset(const void* src, size_t len) {
  constexpr size_t h = sizeof(RingRecordHeader);
  if (len < kRingAlignedPayload) return h;
  return h + ((reinterpret_cast<uintptr_t>(src) - h) & (kRingAlign - 1));
}
inline constexpr uint16_t kRingPad = 0;  // filler up to the end of the data; skipped
inline constexpr uint16_t kRingEager = 1;  // the payload is the message
inline constexpr uint16_t kRingLong = 2;   // the payload is a RingLong; the bytes follow by libfabric
inline constexpr uint16_t kRingPull = 3;   // the payload is a RingPull: read the bytes from the writer
inline constexpr uint16_t kRingAck = 4;    // the payload is a RingAck: a RingPull's bytes were read
struct RingLong {
  uint64_t length;
  uint64_t seq;  // wire::bulk(seq) tags the bytes
};
struct RingPull {
  uint64_t length;
  uint64_t seq;   // the writer's sequence number of this long message, echoed by the RingAck
  uint64_t addr;  // where the bytes lie in the writer's address space
};
struct RingAck {
  uint64_t seq;
};

// A record's payload as the transport takes it, checked: the message itself (kRingEager: data
// and len, valid until pop()), or a copy of the RingLong, RingPull or RingAck it holds. Throws a
// remote_error for anything else: another kind, a payload of another size, or a pull from a
// writer whose memory this side does not read (pulls false). Inline: it is on every message's
// path.
struct RingPayload {
  uint32_t kind = kRingPad;
  const char* data = nullptr;
  size_t len = 0;
  RingLong long_msg{};
  RingPull pull{};
  RingAck ack{};
};
[[noreturn]] void throw_malformed_ring_payload(uint32_t kind, size_t len);
inline RingPayload decode_ring_payload(uint32_t kind, const char* data, size_t len, bool pulls) {
  RingPayload m;
  m.kind = kind;
  switch (kind) {
    case kRingEager:
      m.data = data;
      m.len = len;
      return m;
    case kRingLong:
      if (len != sizeof(RingLong)) break;
      std::memcpy(&m.long_msg, data, sizeof(RingLong));
      return m;
    case kRingPull:
      if (len != sizeof(RingPull) || !pulls) break;
      std::memcpy(&m.pull, data, sizeof(RingPull));
      return m;
    case kRingAck:
      if (len != sizeof(RingAck)) break;
      std::memcpy(&m.ack, data, sizeof(RingAck));
      return m;
  }
  throw_malformed_ring_payload(kind, len);
}

// Bytes of shared memory one ring of capacity bytes takes.
inline constexpr size_t ring_footprint(size_t capacity) { return sizeof(RingControl) + capacity; }

// Values of RingControl::closed once the writer let go of its buffers.
inline constexpr uint64_t kRingClosed = 1;      // it aborted or closed its fabric
inline constexpr uint64_t kRingClosedLost = 2;  // + r: it lost rank r and fails everything
// The rank a closed word names as lost (kRingClosedLost + r with r in a world of size ranks), or
// -1 when it names none.
inline int ring_lost_rank(uint64_t code, int size) {
  return code >= kRingClosedLost && code - kRingClosedLost < static_cast<uint64_t>(size)
             ? static_cast<int>(code - kRingClosedLost)
             : -1;
}

class RingWriter {
 public:
  RingWriter() = default;
  // base: a ring's start in a mapped segment; capacity: a power of two, at least 4 KiB. The ring
  // lies in the reader's segment, so its head and tail are the reader's to spoil: the writer
  // starts from the head rounded down to a record, and whatever the tail says, it writes only
  // inside the ring (a lying tail can only make it wait, or overwrite what the reader has not
  // read).
  RingWriter(void* base, size_t capacity);
  // Appends a record of kind (not kRingPad) whose payload is a then b; false when the ring has
  // no room for it now. A record of up to half the ring fits once the reader has caught up
  // (the transport's are at most a quarter and a header); one longer than the ring never does.
  bool write(uint64_t tag, uint32_t kind, const void* a, size_t alen, const void* b = nullptr, size_t blen = 0);
  // Tells the reader that buffers this side's records point to may be gone from now on. code:
  // kRingClosed, or kRingClosedLost + r when this side closed because it lost rank r (the
  // reader then fails too, naming r). The first close wins.
  void close(uint64_t code = kRingClosed) {
    uint64_t open = 0;
    if (ctl_) ctl_->closed.compare_exchange_strong(open, code, std::memory_order_seq_cst);
  }

 private:
  RingControl* ctl_ = nullptr;
  char* data_ = nullptr;
  size_t capacity_ = 0;
  uint64_t head_ = 0;         // this side's copy of head
  uint64_t cached_tail_ = 0;  // the consumer's tail when last read
};

class RingReader {
 public:
  struct Record {
    uint64_t tag = 0;
    uint32_t kind = 0;
    uint32_t len = 0;
    const char* data = nullptr;  // valid until pop()
  };
  RingReader() = default;
  RingReader(void* base, size_t capacity);
  // The oldest record not yet popped, skipping pads; false when there is none. Reads the head at
  // most once per call, so a writer cannot keep it going round. Throws a remote_error when the
  // writer broke the ring: a head that is not a whole number of records at most the capacity
  // ahead of the tail, or a record that does not lie within the bytes ready and before the
  // ring's end. The reader does not move past what it refused.
  bool peek(Record* r);
  // Releases the record peek() returned.
  void pop();
  // Whether the writer closed its side (RingWriter::close), and with what code (0: open).
  bool writer_closed() const { return closed_code() != 0; }
  uint64_t closed_code() const { return ctl_ ? ctl_->closed.load(std::memory_order_seq_cst) : 0; }

 private:
  RingControl* ctl_ = nullptr;
  char* data_ = nullptr;
  size_t capacity_ = 0;
  uint64_t tail_ = 0;         // this side's copy of tail
  uint64_t cached_head_ = 0;  // the producer's head when last read
  uint64_t next_ = 0;         // tail after the peeked record
};

// Removes what trn processes that no longer exist left in /dev/shm: libfabric shm regions
// ("trn_<pid>_...", endpoint.cc) and ring segments ("trn-ring.<pid>...."), which a rank killed
// before every peer mapped them leaves behind. Runs once per process, before it creates either.
void remove_stale_shm_files();

// A shared-memory segment of `slots` rings of one capacity. The creator owns the name and
// unlinks it when told (once every peer mapped it) or on destruction.
class RingSegment {
 public:
  // Creates and zeroes a new segment; throws Error on failure.
  static RingSegment create(size_t slots, size_t capacity);
  // Maps a segment another rank created; throws Error naming it on failure.
  static RingSegment open(const std::string& name, size_t slots, size_t capacity);

  RingSegment() = default;
  RingSegment(RingSegment&& o) noexcept;
  RingSegment& operator=(RingSegment&& o) noexcept;
  ~RingSegment();

  const std::string& name() const { return name_; }
  void* ring(size_t slot) const;
  size_t capacity() const { return capacity_; }
  // Removes the name (peers that mapped it keep their mapping). Creator only; idempotent.
  void unlink();

 private:
  void release();
  std::string name_;
  bool owner_ = false;
  void* base_ = nullptr;
  size_t bytes_ = 0, slots_ = 0, capacity_ = 0;
};

}  // namespace trn::fabric
