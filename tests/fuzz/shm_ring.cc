// Fuzz target: trn's shared-memory rings (collectives/fabric/shm_ring.h), what a rank reads from
// the segment its same-host peers write into. A peer may write anything there, so the input is
// the ring's memory. Its parts (fuzz.h):
//
//   0. A ring as a reader finds it: head u64, tail u64, a later head u64, flags u8 (bit 0: this
//      side pulls from the writer), then the data of a 4 KiB ring (missing bytes are zero). A
//      RingReader takes records until there are none, then the head moves to the later value
//      and it takes the rest. Each record must lie in the ring, there can be no more of them
//      than the bytes ready hold, and its payload goes through decode_ring_payload as the
//      transport's would. A broken ring or payload is refused with a remote error in one line.
//      Then a RingWriter starts over that ring as the reader left it (its head and tail from the
//      input, as a peer may have spoiled them) and writes records of every size until it has no
//      room: it must write only inside the ring.
//   1. A script for a round trip: a RingWriter writes records made from it into a fresh ring
//      (every kind, payloads from 0 bytes to a quarter of the ring at any alignment, in one part
//      or two), a RingReader takes them between writes, and each must come back as written.
//      A write may wait only while the ring holds records; into an empty ring it must succeed.
//
// Seeds are rings that a RingWriter wrote (tests/fuzz/wire_seeds.cc).
#include "collectives/fabric/shm_ring.h"

#include <algorithm>
#include <vector>

#include "tests/fuzz/fuzz.h"

namespace {

using namespace trn;
using namespace trn::fabric;

constexpr size_t kImageCap = 4096;  // the ring of part 0
constexpr size_t kTripCap = 8192;   // the ring of the round trip

// A ring's memory, exactly as large as it is, so that ASan sees a read past its end; made once
// and cleared for each input.
struct RingMemory {
  explicit RingMemory(size_t cap)
      : cap(cap), base(static_cast<char*>(std::aligned_alloc(kRingAlign, ring_footprint(cap)))) {}
  RingControl& ctl() { return *reinterpret_cast<RingControl*>(base); }
  char* data() { return base + sizeof(RingControl); }
  char* clear() {
    std::memset(base, 0, ring_footprint(cap));
    return base;
  }
  size_t cap;
  char* base;
};

uint64_t take_u64(std::string_view& in) {
  uint64_t v = 0;
  const size_t n = std::min(in.size(), sizeof(v));
  if (n) std::memcpy(&v, in.data(), n);
  in.remove_prefix(n);
  return v;
}

unsigned take_u8(std::string_view& in) {
  if (in.empty()) return 0;
  const unsigned v = static_cast<unsigned char>(in[0]);
  in.remove_prefix(1);
  return v;
}

// A writer over a ring whose counters the reader set: whatever they say, it writes only inside
// the ring (ASan sees the rest).
void write_over(RingMemory& m, uint64_t head, uint64_t tail) {
  m.ctl().head.store(head);
  m.ctl().tail.store(tail);
  RingWriter writer(m.base, kImageCap);
  alignas(kRingAlign) static char src[kImageCap + kRingAlign];
  const size_t sizes[] = {0, 100, 1500, kImageCap / 2, kImageCap + 1};
  for (int round = 0; round < 2; ++round)
    for (size_t len : sizes) writer.write(len, kRingEager, src + 3, len);
  const RingPull p{1, 2, 3};
  writer.write(1, kRingPull, &p, sizeof(p));
}

void read_image(std::string_view in) {
  static RingMemory m(kImageCap);
  m.clear();
  const uint64_t head = take_u64(in), tail = take_u64(in);
  m.ctl().head.store(head);
  m.ctl().tail.store(tail);
  const uint64_t later = take_u64(in);
  const bool pulls = take_u8(in) & 1;
  if (!in.empty()) std::memcpy(m.data(), in.data(), std::min(in.size(), kImageCap));

  RingReader reader(m.base, kImageCap);
  uint64_t taken = 0;  // records
  const uint64_t from = m.ctl().tail.load();
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) m.ctl().head.store(later);
    for (;;) {
      RingReader::Record r;
      bool got = false;
      if (!fuzz::accepts_wire([&] { got = reader.peek(&r); })) {
        // Refused: it stays refused, and nothing behind the refusal is taken.
        fuzz::require(!fuzz::accepts_wire([&] { reader.peek(&r); }),
                      "a refused ring was taken from afterwards");
        write_over(m, head, tail);
        return;
      }
      if (!got) break;
      fuzz::require(r.data >= m.data() && r.len <= kImageCap && r.data + r.len <= m.data() + kImageCap,
                    "a record's bytes lie outside the ring");
      fuzz::require(r.kind != kRingPad, "a pad came out of peek");
      // Each record takes at least 64 bytes of what the head published, and that is at most the
      // ring: in both passes together, at most twice the ring.
      fuzz::require(++taken <= 2 * kImageCap / kRingAlign, "more records than the ring holds");
      RingPayload p;
      if (fuzz::accepts_wire([&] { p = decode_ring_payload(r.kind, r.data, r.len, pulls); })) {
        fuzz::require(p.kind == r.kind, "the payload's kind changed");
        fuzz::require(p.kind != kRingPull || pulls,
                      "a pull accepted from a writer this side does not pull from");
        if (p.kind == kRingEager) fuzz::require(p.data == r.data && p.len == r.len, "an eager payload moved");
      }
      reader.pop();
      const uint64_t moved = m.ctl().tail.load() - from;
      fuzz::require(moved <= 2 * kImageCap && moved % kRingAlign == 0,
                    "the reader's tail moved by something other than whole records");
    }
  }
  write_over(m, head, tail);
}

// The round trip. Script bytes, one record or read per step:
//   op % 8 == 7: the reader takes (next byte % 8) records;
//   otherwise a record of kind op % 4 + 1 (eager, long, pull, ack) with a 64-bit tag; an eager
//   one takes a length (two bytes, up to a quarter of the ring), the alignment of its bytes (one
//   byte) and where it splits in two parts (op & 0x10: one byte), its bytes a pattern from the
//   tag. Long, pull and ack records carry their structs made from the tag.
struct Expected {
  uint64_t tag;
  uint32_t kind;
  const char* eager;  // an eager record's bytes, in the pattern
  size_t len;
  char own[sizeof(RingPull)];  // another record's struct
  const char* bytes() const { return kind == kRingEager ? eager : own; }
};

// Payload bytes: the source is this pattern at an offset from the tag (no loop per input byte).
constexpr size_t kMaxEager = kTripCap / 4;
const char* pattern() {
  alignas(kRingAlign) static char p[2 * kMaxEager + 2 * kRingAlign];
  static const bool made = [] {
    for (size_t i = 0; i < sizeof(p); ++i) p[i] = static_cast<char>(i * 7 + (i >> 8) + 1);
    return true;
  }();
  (void)made;
  return p;
}

void round_trip(std::string_view in) {
  static RingMemory m(kTripCap);
  RingWriter writer(m.clear(), kTripCap);
  RingReader reader(m.base, kTripCap);
  static std::vector<Expected> queued;  // [first, end) not read yet
  queued.clear();
  size_t first = 0;

  auto take_one = [&] {
    RingReader::Record r;
    bool got = false;
    if (!fuzz::accepts_wire([&] { got = reader.peek(&r); }))
      fuzz::fail("a ring a RingWriter wrote was refused");
    fuzz::require(got == (first < queued.size()),
                  got ? "a record nobody wrote" : "a record written went missing");
    if (!got) return;
    const Expected& e = queued[first];
    fuzz::require(
        r.tag == e.tag && r.kind == e.kind && r.len == e.len && std::memcmp(r.data, e.bytes(), r.len) == 0,
        "a record came back different");
    RingPayload p;
    if (!fuzz::accepts_wire([&] { p = decode_ring_payload(r.kind, r.data, r.len, true); }))
      fuzz::fail("a record a RingWriter wrote does not decode");
    fuzz::require(p.kind != kRingLong || std::memcmp(&p.long_msg, e.own, sizeof(RingLong)) == 0,
                  "RingLong differs");
    fuzz::require(p.kind != kRingPull || std::memcmp(&p.pull, e.own, sizeof(RingPull)) == 0,
                  "RingPull differs");
    fuzz::require(p.kind != kRingAck || std::memcmp(&p.ack, e.own, sizeof(RingAck)) == 0, "RingAck differs");
    reader.pop();
    ++first;
  };

  for (int steps = 0; !in.empty() && steps < 256; ++steps) {
    const unsigned op = take_u8(in);
    if (op % 8 == 7) {
      for (unsigned n = take_u8(in) % 8; n > 0; --n) take_one();
      continue;
    }
    Expected e{take_u64(in), op % 4 + 1, nullptr, 0, {}};
    size_t split;
    if (e.kind == kRingEager) {
      e.len = (take_u8(in) | take_u8(in) << 8) % (kMaxEager + 1);
      const size_t shift = take_u8(in) % kRingAlign;
      split = op & 0x10 ? take_u8(in) * e.len / 255 : e.len;
      e.eager = pattern() + (e.tag % kMaxEager) / kRingAlign * kRingAlign + shift;
    } else {
      const uint64_t t = e.tag;
      const RingLong l{t ^ 0x5555, t};
      const RingPull p{t ^ 0xaaaa, t, t * 3};
      const RingAck k{t};
      e.len = e.kind == kRingLong ? sizeof(l) : e.kind == kRingPull ? sizeof(p) : sizeof(k);
      std::memcpy(e.own,
                  e.kind == kRingLong   ? static_cast<const void*>(&l)
                  : e.kind == kRingPull ? static_cast<const void*>(&p)
                                        : static_cast<const void*>(&k),
                  e.len);
      split = e.len;
    }
    queued.push_back(e);
    // One part, or two back to back (a then b), as RingWriter::write allows.
    const char* a = e.bytes();
    while (!writer.write(e.tag, e.kind, a, split, e.len > split ? a + split : nullptr, e.len - split)) {
      fuzz::require(first + 1 < queued.size(),
                    "a record of a quarter of the ring or less did not fit into an empty ring");
      take_one();
    }
  }
  while (first < queued.size()) take_one();
  take_one();  // and then there is nothing
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto parts = fuzz::split(data, size, 2);
  read_image(parts[0]);
  if (parts.size() > 1) round_trip(parts[1]);
  return 0;
}
