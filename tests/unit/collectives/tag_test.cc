#include <catch2/catch.hpp>

#include "collectives/p2p.h"
#include "collectives/tag.h"

using namespace trn;

TEST_CASE("tags keep communicator, operation and step apart within 56 bits") {
  const uint64_t a = tag::collective(7, 5, 3);
  CHECK((a & ~kUserTagMask) == 0);
  CHECK(tag::comm_of(a) == 7);
  CHECK(a != tag::collective(7, 5, 4));
  CHECK(a != tag::collective(7, 6, 3));
  CHECK(a != tag::collective(8, 5, 3));
  // Point-to-point messages never collide with collectives of the same communicator.
  for (uint64_t n = 0; n < 100; ++n)
    for (uint64_t seq = 0; seq < 100; ++seq) CHECK(tag::p2p(7, n) != tag::collective(7, seq, 0));
  // The largest values stay inside the user bits.
  const uint64_t big = tag::collective(tag::kMaxCommIds - 1, ~uint64_t{0}, ~uint64_t{0});
  CHECK((big & ~kUserTagMask) == 0);
  CHECK(tag::comm_of(big) == tag::kMaxCommIds - 1);
  CHECK((tag::p2p(tag::kMaxCommIds - 1, ~uint64_t{0}) & ~kUserTagMask) == 0);
}
