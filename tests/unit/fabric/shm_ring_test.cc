// The shared-memory ring on its own: records in order, pads at the wrap, back-pressure when full,
// the restart at the front when empty, a producer and a consumer thread moving many records
// (run under tsan, this checks the ring's memory ordering), and a ring its writer broke refused
// (tests/fuzz/shm_ring.cc tries many more).
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <thread>
#include <vector>

#include "collectives/core/error.h"
#include "collectives/fabric/shm_ring.h"

using namespace trn;
using namespace trn::fabric;

namespace {

constexpr size_t kCap = 64 << 10;

std::vector<char> payload(uint64_t seed, size_t len) {
  std::vector<char> v(len);
  for (size_t i = 0; i < len; ++i) v[i] = static_cast<char>((seed * 31 + i * 7) & 0xff);
  return v;
}

bool shm_exists(const std::string& name) {
  int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd >= 0) close(fd);
  return fd >= 0;
}

}  // namespace

TEST_CASE("shm ring: records come out in order with their tag, kind and bytes") {
  RingSegment seg = RingSegment::create(2, kCap);
  RingWriter w(seg.ring(1), kCap);
  RingReader r(seg.ring(1), kCap);
  RingReader::Record rec;
  CHECK_FALSE(r.peek(&rec));
  for (uint64_t i = 0; i < 20; ++i) {
    auto p = payload(i, i * 37);
    REQUIRE(w.write(100 + i, kRingEager, p.data(), p.size()));
  }
  for (uint64_t i = 0; i < 20; ++i) {
    REQUIRE(r.peek(&rec));
    CHECK(rec.tag == 100 + i);
    CHECK(rec.kind == kRingEager);
    REQUIRE(rec.len == i * 37);
    CHECK((rec.len == 0 || std::memcmp(rec.data, payload(i, i * 37).data(), rec.len) == 0));
    r.pop();
  }
  CHECK_FALSE(r.peek(&rec));
  // Two parts land back to back.
  const RingLong lr{123456, 9};
  const char extra[3] = {'a', 'b', 'c'};
  REQUIRE(w.write(7, kRingLong, &lr, sizeof(lr), extra, sizeof(extra)));
  REQUIRE(r.peek(&rec));
  REQUIRE(rec.len == sizeof(lr) + 3);
  RingLong back;
  std::memcpy(&back, rec.data, sizeof(back));
  CHECK(back.length == 123456);
  CHECK(back.seq == 9);
  CHECK(std::memcmp(rec.data + sizeof(lr), "abc", 3) == 0);
}

TEST_CASE("shm ring: a large payload sits at its source's offset within a cache line") {
  // So that memcpy in and out copies between addresses a multiple of 64 bytes apart
  // (ring_payload_offset); a small one stays right after the header.
  RingSegment seg = RingSegment::create(1, kCap);
  RingWriter w(seg.ring(0), kCap);
  RingReader r(seg.ring(0), kCap);
  std::vector<char> src(8192 + 64);
  const auto base = reinterpret_cast<uintptr_t>(src.data());
  for (size_t shift : {0, 8, 16, 24, 40, 63}) {
    for (size_t len : {size_t{100}, kRingAlignedPayload, size_t{5000}}) {
      char* from = src.data() + shift;
      for (size_t i = 0; i < len; ++i) from[i] = static_cast<char>(i * 13 + shift);
      REQUIRE(w.write(shift, kRingEager, from, len));
      RingReader::Record rec;
      REQUIRE(r.peek(&rec));
      INFO("shift " << shift << ", " << len << " bytes");
      REQUIRE(rec.len == len);
      CHECK(std::memcmp(rec.data, from, len) == 0);
      const auto at = reinterpret_cast<uintptr_t>(rec.data) % kRingAlign;
      if (len >= kRingAlignedPayload)
        CHECK(at == (base + shift) % kRingAlign);
      else
        CHECK(at == sizeof(RingRecordHeader));
      r.pop();
    }
  }
}

TEST_CASE("shm ring: a full ring refuses a write until the reader pops, and records never wrap") {
  RingSegment seg = RingSegment::create(1, kCap);
  RingWriter w(seg.ring(0), kCap);
  RingReader r(seg.ring(0), kCap);
  const auto p = payload(1, 5000);  // 5056-byte records: the ring's end falls inside one
  int written = 0;
  while (w.write(written, kRingEager, p.data(), p.size())) ++written;
  CHECK(written == static_cast<int>(kCap / 5056));
  RingReader::Record rec;
  int read = 0;
  // Keep the ring full: each pop makes room for one more, across the wrap many times.
  for (int round = 0; round < 200; ++round) {
    REQUIRE(r.peek(&rec));
    CHECK(rec.tag == static_cast<uint64_t>(read));
    REQUIRE(rec.len == p.size());
    CHECK(std::memcmp(rec.data, p.data(), p.size()) == 0);
    r.pop();
    ++read;
    REQUIRE(w.write(written, kRingEager, p.data(), p.size()));
    ++written;
  }
  while (r.peek(&rec)) {
    CHECK(rec.tag == static_cast<uint64_t>(read++));
    r.pop();
  }
  CHECK(read == written);
}

TEST_CASE("shm ring: once the reader caught up, the writer starts again at the front") {
  RingSegment seg = RingSegment::create(1, kCap);
  RingWriter w(seg.ring(0), kCap);
  RingReader r(seg.ring(0), kCap);
  RingReader::Record rec;
  const char* first = nullptr;
  for (int i = 0; i < 100; ++i) {
    const auto p = payload(i, 4096);
    REQUIRE(w.write(i, kRingEager, p.data(), p.size()));
    REQUIRE(r.peek(&rec));
    CHECK(rec.tag == static_cast<uint64_t>(i));
    CHECK(std::memcmp(rec.data, p.data(), p.size()) == 0);
    if (i == 0) first = rec.data;
    CHECK(rec.data == first);  // the same cache lines every time
    r.pop();
  }
  // A record that would not fit between the front and the current place goes in place (a pad
  // holds its space until the reader passes it) and still arrives whole.
  const auto big = payload(3, kCap / 4);
  REQUIRE(w.write(1, kRingEager, big.data(), big.size()));
  REQUIRE(r.peek(&rec));
  CHECK(rec.data != first);
  REQUIRE(rec.len == big.size());
  CHECK(std::memcmp(rec.data, big.data(), big.size()) == 0);
  r.pop();
  CHECK_FALSE(r.peek(&rec));
}

TEST_CASE("shm ring: a producer and a consumer thread move 200k records intact") {
  RingSegment seg = RingSegment::create(1, kCap);
  RingWriter w(seg.ring(0), kCap);
  RingReader r(seg.ring(0), kCap);
  constexpr uint64_t kCount = 200000;
  auto size_of = [](uint64_t i) { return static_cast<size_t>((i * 2654435761u) % 9000); };
  std::thread producer([&] {
    std::vector<char> buf(9000);
    for (uint64_t i = 0; i < kCount; ++i) {
      const size_t n = size_of(i);
      for (size_t k = 0; k < n; ++k) buf[k] = static_cast<char>(i + k);
      while (!w.write(i, kRingEager, buf.data(), n)) std::this_thread::yield();
    }
  });
  uint64_t bad = 0;
  RingReader::Record rec;
  for (uint64_t i = 0; i < kCount; ++i) {
    while (!r.peek(&rec)) std::this_thread::yield();
    bool ok = rec.tag == i && rec.len == size_of(i);
    for (size_t k = 0; ok && k < rec.len; ++k) ok = rec.data[k] == static_cast<char>(i + k);
    bad += !ok;
    r.pop();
  }
  producer.join();
  CHECK(bad == 0);
  CHECK_FALSE(r.peek(&rec));
}

TEST_CASE("shm ring: a segment is shared by name until unlinked, and a missing one is an error") {
  RingSegment mine = RingSegment::create(3, kCap);
  const std::string name = mine.name();
  CHECK(shm_exists(name));
  RingSegment theirs = RingSegment::open(name, 3, kCap);
  RingWriter w(theirs.ring(2), kCap);
  RingReader r(mine.ring(2), kCap);
  const int v = 42;
  REQUIRE(w.write(5, kRingEager, &v, sizeof(v)));
  RingReader::Record rec;
  REQUIRE(r.peek(&rec));
  CHECK(rec.tag == 5);
  mine.unlink();
  CHECK_FALSE(shm_exists(name));
  CHECK_THROWS_AS(RingSegment::open(name, 3, kCap), Error);
  CHECK_THROWS_WITH(RingSegment::open("/trn-ring.no-such", 1, kCap), Catch::Contains("/trn-ring.no-such"));
  CHECK(ring_capacity_for(0) == (64 << 10));
  CHECK(ring_capacity_for(65536) == (256 << 10));
  CHECK(ring_capacity_for(65537) == (512 << 10));
}

TEST_CASE("shm ring: the reader sees the writer close its side, records written before still arrive") {
  RingSegment seg = RingSegment::create(2, kCap);
  RingWriter w(seg.ring(1), kCap);
  RingReader r(seg.ring(1), kCap);
  CHECK(!r.writer_closed());
  const RingPull pull{1 << 20, 7, 0x1000};
  REQUIRE(w.write(42, kRingPull, &pull, sizeof(pull)));
  w.close();
  CHECK(r.writer_closed());
  RingReader::Record rec;
  REQUIRE(r.peek(&rec));
  CHECK(rec.kind == kRingPull);
  RingPull got;
  REQUIRE(rec.len == sizeof(got));
  std::memcpy(&got, rec.data, sizeof(got));
  CHECK(got.seq == 7);
  CHECK(got.addr == 0x1000);
}

TEST_CASE("shm ring: a reader refuses a ring its writer broke, and never reads outside it") {
  // A peer may write anything into the segment. Each broken ring is refused with one remote error
  // saying what the writer did; the reader stays where it was.
  struct Case {
    const char* what;
    uint64_t head;
    RingRecordHeader h;
  };
  const Case cases[] = {
      {"a head more than the ring ahead", kCap + 64, {1, 8, kRingEager, 16}},
      {"a head behind the tail", ~uint64_t{0} - 63, {1, 8, kRingEager, 16}},
      {"a head inside a record", 40, {1, 8, kRingEager, 16}},
      {"a record longer than the bytes ready", 64, {1, 100, kRingEager, 16}},
      {"a record past the ring's end", kCap, {1, kCap, kRingEager, 16}},
      {"a payload inside its header", 64, {1, 8, kRingEager, 4}},
      // A pad of no bytes: a reader that skipped it by its length would spin on it forever.
      {"an empty pad", 64, {0, 0, kRingPad, 0}},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    RingSegment seg = RingSegment::create(1, kCap);
    auto* ctl = static_cast<RingControl*>(seg.ring(0));
    std::memcpy(static_cast<char*>(seg.ring(0)) + sizeof(RingControl), &c.h, sizeof(c.h));
    ctl->head.store(c.head);
    RingReader r(seg.ring(0), kCap);
    RingReader::Record rec;
    for (int again = 0; again < 2; ++again) {
      try {
        r.peek(&rec);
        FAIL("a broken ring was read");
      } catch (const Error& e) {
        CHECK(e.kind() == ErrorKind::kRemote);
        CHECK(std::string(e.what()).rfind("it ", 0) == 0);
      }
    }
    CHECK(ctl->tail.load() == 0);
  }
}

TEST_CASE("shm ring: a record's payload is checked as the transport takes it") {
  const RingLong l{10, 2};
  const RingPull p{20, 3, 0x1000};
  const RingAck a{4};
  const char msg[5] = {'h', 'e', 'l', 'l', 'o'};
  CHECK(decode_ring_payload(kRingEager, msg, 5, false).data == msg);
  CHECK(decode_ring_payload(kRingLong, reinterpret_cast<const char*>(&l), sizeof(l), false).long_msg.seq ==
        2);
  CHECK(decode_ring_payload(kRingPull, reinterpret_cast<const char*>(&p), sizeof(p), true).pull.addr ==
        0x1000);
  CHECK(decode_ring_payload(kRingAck, reinterpret_cast<const char*>(&a), sizeof(a), false).ack.seq == 4);
  // A pull from a writer this side does not read from, payloads of another size, other kinds.
  CHECK_THROWS_WITH(decode_ring_payload(kRingPull, reinterpret_cast<const char*>(&p), sizeof(p), false),
                    "it wrote a malformed record (kind 3, 24 bytes) into its shared-memory ring");
  CHECK_THROWS_WITH(decode_ring_payload(kRingAck, msg, 5, true),
                    "it wrote a malformed ack (5 bytes) into its shared-memory ring");
  CHECK_THROWS_AS(decode_ring_payload(kRingLong, msg, 5, true), Error);
  CHECK_THROWS_AS(decode_ring_payload(kRingPad, msg, 0, true), Error);
  CHECK_THROWS_AS(decode_ring_payload(77, msg, 5, true), Error);
  CHECK(ring_lost_rank(kRingClosedLost + 3, 4) == 3);
  CHECK(ring_lost_rank(kRingClosedLost + 4, 4) == -1);
  CHECK(ring_lost_rank(kRingClosed, 4) == -1);
}
