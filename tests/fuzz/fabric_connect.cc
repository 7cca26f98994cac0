// Fuzz target: what ranks tell each other while the fabric connects (collectives/fabric/
// messages.h), through the store and in the handshake. An input's parts (fuzz.h) are what a peer
// published or sent:
//
//   0. its address record (<prefix>/addr/<rank>: "key=value" lines, addresses in hex);
//   1. its ring segment (<prefix>/ring/<rank>: "<name> <capacity> <pid> <probe address> <probe>");
//   2. its ring report (<prefix>/ring-mapped/<rank>: "pull <rank>..."), in a world of 16 ranks;
//   3. its handshake message (rank 3's int32, as this rank expects it).
//
// Each is accepted or refused with one usage or remote error (fuzz::accepts_wire). What is
// accepted is encoded again with its encoder and must decode to the same value; a ring segment
// accepted must be one RingSegment::open can size without overflow.
#include "collectives/fabric/messages.h"
#include "collectives/fabric/shm_ring.h"
#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace trn;
  using namespace trn::fabric;
  constexpr int kWorld = 16;
  const auto parts = fuzz::split(data, size, 4);
  const auto part = [&](size_t i) { return i < parts.size() ? parts[i] : std::string_view(); };

  AddressRecord a;
  if (fuzz::accepts_wire([&] { a = AddressRecord::decode(part(0)); })) {
    AddressRecord back;
    if (!fuzz::accepts_wire([&] { back = AddressRecord::decode(a.encode()); }))
      fuzz::fail("an encoded address record is refused");
    fuzz::require(back == a, "an address record encoded again decodes differently");
    fuzz::require(a.live >= 0 && a.live <= 65535, "a liveness port out of range");
  }

  RingOffer o;
  if (fuzz::accepts_wire([&] { o = RingOffer::decode(part(1)); })) {
    RingOffer back;
    if (!fuzz::accepts_wire([&] { back = RingOffer::decode(o.encode()); }))
      fuzz::fail("an encoded ring segment is refused");
    fuzz::require(back == o, "a ring segment encoded again decodes differently");
    // RingSegment::open maps slots * ring_footprint(capacity) bytes: a host's ranks, at most
    // thousands, must not make that wrap.
    fuzz::require(o.capacity >= 4096 && (o.capacity & (o.capacity - 1)) == 0 &&
                      ring_footprint(o.capacity) <= (size_t{1} << 32),
                  "an accepted ring capacity is not one a segment can be made of");
    fuzz::require(o.name.rfind("/trn-ring.", 0) == 0 && o.name.find('/', 1) == std::string::npos,
                  "an accepted ring segment name is not a trn ring's");
  }

  std::vector<int> readers;
  if (fuzz::accepts_wire([&] { readers = decode_pull_report(part(2), kWorld); })) {
    for (int r : readers) fuzz::require(r >= 0 && r < kWorld, "a ring report names a rank outside the world");
    std::vector<int> back;
    if (!fuzz::accepts_wire([&] { back = decode_pull_report(encode_pull_report(readers), kWorld); }))
      fuzz::fail("an encoded ring report is refused");
    fuzz::require(back == readers, "a ring report encoded again decodes differently");
  }

  const std::string_view hs = part(3);
  if (fuzz::accepts_wire([&] { check_handshake(hs.data(), hs.size(), 3); })) {
    int32_t r = -1;
    fuzz::require(hs.size() == sizeof(r), "a handshake of the wrong size accepted");
    std::memcpy(&r, hs.data(), sizeof(r));
    fuzz::require(r == 3, "a handshake from the wrong rank accepted");
  }
  return 0;
}
