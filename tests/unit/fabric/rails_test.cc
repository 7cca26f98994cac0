// The pure parts of rails (collectives/fabric/rails.h): how a message is cut into stripes, which
// rail a rank calls its own, which rail a message to another host takes, the stripe tags, and the
// rails in a rank's address record.
#include <catch2/catch.hpp>

#include <map>

#include "collectives/core/error.h"
#include "collectives/fabric/messages.h"
#include "collectives/fabric/rails.h"
#include "collectives/fabric/tag.h"
#include "collectives/tag.h"

using namespace trn;
using namespace trn::fabric;

TEST_CASE("stripes cover a message exactly once, in 64-byte aligned parts") {
  for (size_t len : {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{1000}, size_t{262144}, size_t{262147},
                     size_t{16} << 20, (size_t{16} << 20) + 7}) {
    for (int n : {1, 2, 3, 4, 8, 16, 32}) {
      INFO(len << " bytes over " << n << " rails");
      size_t next = 0;
      for (int i = 0; i < n; ++i) {
        const auto [first, end] = stripe_range(len, n, i);
        CHECK(first == std::min(next, len));
        CHECK(end >= first);
        if (end > first) CHECK(first % 64 == 0);
        next = std::max(next, end);
      }
      CHECK(next == len);
    }
  }
  // Equal shares for a large message: within 64 bytes of each other.
  const auto a = stripe_range(size_t{16} << 20, 2, 0), b = stripe_range(size_t{16} << 20, 2, 1);
  CHECK(a.second - a.first == b.second - b.first);
}

TEST_CASE("a rank's own rail is a NIC on its NUMA node, else round robin over all") {
  // Two NUMA nodes of two NICs each: the ranks of node 1 share rails 2 and 3.
  const std::vector<int> numa = {0, 0, 1, 1};
  CHECK(choose_own_rail(0, numa, 1) == 2);
  CHECK(choose_own_rail(1, numa, 1) == 3);
  CHECK(choose_own_rail(2, numa, 1) == 2);
  CHECK(choose_own_rail(1, numa, 0) == 1);
  // Unknown locality (virtual NICs, a rank spanning nodes): position mod rails.
  CHECK(choose_own_rail(5, {-1, -1, -1}, 0) == 2);
  CHECK(choose_own_rail(3, numa, -1) == 3);
  CHECK(choose_own_rail(4, {1, 1}, 0) == 0);  // no NIC on its node
  CHECK(choose_own_rail(7, {}, 0) == 0);
}

TEST_CASE("a rank's near rails are the NICs on its NUMA node, else all") {
  CHECK(near_rails({0, 0, 1, 1}, 1) == std::vector<int>{2, 3});
  CHECK(near_rails({0, 0, 1, 1}, 0) == std::vector<int>{0, 1});
  CHECK(near_rails({0, 0, 1, 1}, -1) == std::vector<int>{0, 1, 2, 3});
  CHECK(near_rails({1, 1}, 0) == std::vector<int>{0, 1});  // no NIC on its node
  CHECK(near_rails({-1, -1, -1}, 0) == std::vector<int>{0, 1, 2});
  CHECK(near_rails({}, 0).empty());
}

TEST_CASE("messages to other hosts take the sender's near rails round robin by tag") {
  const std::vector<int> two = {0, 1}, upper = {2, 3}, three = {0, 1, 2};
  // A collective's steps (a chunked ring's chunks) go round robin, over any set of rails.
  const int first2 = spread_rail(tag::collective(7, 1000, 0), two);
  const int first3 = spread_rail(tag::collective(7, 1000, 0), three);
  for (uint64_t step = 0; step < 12; ++step) {
    INFO("step " << step);
    const uint64_t t = tag::collective(7, 1000, step);
    CHECK(spread_rail(t, two) == (first2 + int(step)) % 2);
    CHECK(spread_rail(t, upper) - 2 == spread_rail(t, two));
    CHECK(spread_rail(t, three) == (first3 + int(step)) % 3);
  }
  // So do a collective's sequence numbers at one step, and the messages of a send/recv pair.
  for (uint64_t n = 0; n < 12; ++n) {
    INFO("n " << n);
    CHECK(spread_rail(tag::collective(7, 1000 + n, 0), three) == (first3 + int(n)) % 3);
    CHECK(spread_rail(tag::p2p(2, n), two) == (spread_rail(tag::p2p(2, 0), two) + int(n)) % 2);
  }
  // A ring all-reduce of 2 ranks (2 steps of `chunks` messages each way, collectives/algorithms/
  // ring.cc): its messages split evenly over 2 rails, the odd one out of one collective
  // balanced by the next.
  for (uint64_t chunks = 1; chunks <= 9; ++chunks) {
    std::map<int, int> per_rail;
    for (uint64_t seq = 40; seq < 42; ++seq)
      for (uint64_t step = 0; step < 2 * chunks; ++step) ++per_rail[spread_rail(tag::collective(1, seq, step), two)];
    INFO(chunks << " chunks");
    CHECK(per_rail[0] == per_rail[1]);
  }
  // The fabric's wide tags: every 16-bit field counts, the top one being 8 bits wide.
  CHECK(spread_rail(kUserTagMask, two) == (0xffff * 3 + 0xff) % 2);
}

TEST_CASE("stripe tags are control tags of their own, apart from ring bulk tags") {
  CHECK((wire::stripe(5) & wire::kControlBit) != 0);
  CHECK(wire::stripe(5) != wire::bulk(5));
  CHECK(wire::stripe(5) != wire::stripe(6));
  CHECK((wire::stripe(5) & wire::kPieceMask) == 0);
  CHECK(wire::stripe(wire::kSeqMask + 1) == wire::stripe(0));  // the sequence wraps within its bits
}

TEST_CASE("an address record carries its rails and refuses malformed ones") {
  AddressRecord r;
  r.host = "a";
  r.host_id = "a/1";
  r.provider = "tcp;ofi_rxm";
  r.main = std::string("\x02\x00\x1f\x90\x0a\x00\x00\x01\0\0\0\0\0\0\0\0", 16);
  r.framing = "plain";
  CHECK(AddressRecord::decode(r.encode()) == r);
  CHECK(r.encode().find("rails=") == std::string::npos);  // one rail: the record is as before rails
  CHECK(r.encode().find("cpus=") == std::string::npos);   // no mask known: none said
  r.cpus = std::string("\x05\x00\x80", 3);                // cpus 0, 2 and 23
  CHECK(r.encode().find("cpus=050080\n") != std::string::npos);
  CHECK(AddressRecord::decode(r.encode()) == r);
  r.rails = {std::string("\x02\x00\x1f\x90\x0a\x01\x00\x01\0\0\0\0\0\0\0\0", 16)};
  r.rail_numa = {1, -1};
  r.numa = 1;
  r.stripes = true;
  CHECK(AddressRecord::decode(r.encode()) == r);
  const std::string base = "host=a\nid=a/1\nprov=tcp\nmain=00\n";
  for (const char* bad : {"rails=00\nrailnuma=0\n", "rails=00,\nrailnuma=0,0,0\n", "rails=0g\nrailnuma=0,0\n",
                          "numa=x\n", "numa=1,2\n", "railnuma=-2\n", "stripes=2\n", "cpus=0g\n", "cpus=123\n"}) {
    INFO(bad);
    CHECK_THROWS_AS(AddressRecord::decode(base + bad), Error);
  }
}

TEST_CASE("an address record refuses a cpu mask larger than any machine's") {
  const std::string base = "host=a\nid=a/1\nprov=tcp\nmain=00\n";
  CHECK(AddressRecord::decode(base + "cpus=" + std::string(2 * kMaxCpuBytes, 'f') + "\n").cpus.size() == kMaxCpuBytes);
  CHECK_THROWS_AS(AddressRecord::decode(base + "cpus=" + std::string(2 * kMaxCpuBytes + 2, 'f') + "\n"), Error);
}
