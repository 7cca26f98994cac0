// Communicator::all_to_all_v on the in-process transport: both algorithms (and ranks choosing
// differently), every type, random counts with zeros, packed and explicit displacements, in
// place, the counts exchange before it, and one usage error per bad argument.
#include <catch2/catch.hpp>

#include <chrono>
#include <numeric>

#include "collectives/core/error.h"
#include "collectives/selftest.h"
#include "tests/unit/collectives/local_world.h"

using namespace trn;
using namespace trn::test;
using namespace trn::selftest;
using namespace std::chrono_literals;

namespace {

CommOptions with_algo(A2aAlgo a, size_t chunk = 0) {
  CommOptions o;
  o.a2a_algo = a;
  o.chunk_bytes = chunk;  // messages travel in chunks of this (0: the cost model's, 512 KiB here)
  o.timeout = 30s;
  // No agreement on the cost model as operation #0: worlds that never run a collective on every
  // rank then close at once.
  o.params_set = true;
  o.params = uniform_model(CostParams{});
  return o;
}

// Runs every case on every rank; "" or the first failure.
std::string run_v(LocalWorld& world, const std::vector<VCase>& cases) {
  return first_failure(world.run([&](Communicator& comm, int) -> std::string {
    for (const VCase& c : cases) {
      Outcome o = run_all_to_all_v(comm, c, Deadline::after(30s));
      if (o.wrong) return o.first;
    }
    return "";
  }));
}

// The usage error a call on rank 0 of a 3-rank world throws at once, or "no error" (no other
// rank calls, so an accepted call is aborted rather than left to its deadline).
std::string refusal(const std::function<void(Communicator&)>& call) {
  LocalWorld world(3, with_algo(A2aAlgo::kAuto));
  try {
    call(world.comm(0));
  } catch (const Error& e) {
    return (e.kind() == ErrorKind::kUsage ? "" : "not a usage error: ") + std::string(e.what());
  }
  world.comm(0).abort("the test is over");
  return "no error";
}

}  // namespace

TEST_CASE("all_to_all_v matches the reference for every type, both algorithms and world sizes 1 to 5") {
  for (A2aAlgo algo : {A2aAlgo::kDirect, A2aAlgo::kPairwise})
    for (size_t chunk : {size_t{0}, size_t{64}})  // one chunk per message, and many
    for (int n = 1; n <= 5; ++n) {
      LocalWorld world(n, with_algo(algo, chunk));
      std::vector<VCase> cases;
      uint64_t seed = 1;
      for (DataType t : kAllDataTypes)
        for (bool gaps : {false, true})
          for (bool in_place : {false, true}) cases.push_back(VCase{t, random_counts(seed++, 40, n), gaps, in_place});
      cases.push_back(VCase{DataType::kF32, CountMatrix(size_t(n) * n, 0), false, false});  // nothing at all
      cases.push_back(VCase{DataType::kBF16, uneven_counts(size_t(1000) * n, n), true, false});
      cases.push_back(VCase{DataType::kF64, random_counts(99, 20000, n), false, false});  // past the threshold
      INFO(to_string(algo) << ", chunk " << chunk << ", world size " << n);
      CHECK(run_v(world, cases) == "");
    }
}

TEST_CASE("all_to_all_v chunks each pair's messages by their link: many chunks within a host, one between") {
  // 2 hosts x 2 ranks whose model chunks same-host messages in 64 bytes and others in 1 MiB: a
  // pair always agrees, and each rank sends both kinds in one operation.
  for (A2aAlgo algo : {A2aAlgo::kDirect, A2aAlgo::kPairwise}) {
    CommOptions o = with_algo(algo);
    CostModel m = uniform_model(CostParams{});
    m.intra.a2a_chunk_kib = 64.0 / 1024;
    m.inter.a2a_chunk_kib = 1024;
    o.params = m;
    LocalWorld world(4, o, {0, 0, 1, 1});
    std::vector<VCase> cases;
    uint64_t seed = 7;
    for (bool in_place : {false, true}) cases.push_back(VCase{DataType::kF32, random_counts(seed++, 300, 4), true, in_place});
    cases.push_back(VCase{DataType::kI64, uneven_counts(size_t(64) * 4, 4), false, false});  // 8-chunk multiples
    INFO(to_string(algo));
    CHECK(run_v(world, cases) == "");
  }
}

TEST_CASE("all_to_all_v ranks that choose different algorithms still exchange") {
  // Both algorithms send one message per pair with the same tag, so ranks may differ: here by
  // their own bytes (auto), and by force, rank by rank.
  const int n = 4;
  LocalWorld world(n, with_algo(A2aAlgo::kAuto));
  auto res = world.run([&](Communicator& comm, int r) -> std::string {
    comm.set_a2a_algorithm(r % 2 ? A2aAlgo::kPairwise : A2aAlgo::kDirect);
    for (uint64_t seed = 1; seed <= 6; ++seed) {
      Outcome o = run_all_to_all_v(comm, VCase{DataType::kI32, random_counts(seed, 3000, n), seed % 2 == 1, false},
                                   Deadline::after(30s));
      if (o.wrong) return o.first;
    }
    comm.set_a2a_algorithm(A2aAlgo::kAuto);
    // Rank 0 sends each rank half the threshold's bytes, the others send little: rank 0 runs
    // pairwise, the others (receiving half the threshold and a little) direct.
    CountMatrix m(n * n, 3);
    for (int j = 0; j < n; ++j) m[j] = kA2avDirectMaxBytes / 8;  // f32
    size_t sent = 0, received = 0;
    for (int j = 0; j < n; ++j) sent += 4 * m[r * n + j], received += 4 * m[j * n + r];
    if (comm.a2a_algorithm_for(sent, received) != (r == 0 ? A2aAlgo::kPairwise : A2aAlgo::kDirect))
      return "not the intended choice";
    Outcome o = run_all_to_all_v(comm, VCase{DataType::kF32, m, false, false}, Deadline::after(30s));
    return o.first;
  });
  CHECK(first_failure(res) == "");
}

TEST_CASE("all_to_all_v chooses direct up to the threshold and pairwise above, unless forced") {
  LocalWorld world(2, with_algo(A2aAlgo::kAuto));
  Communicator& c = world.comm(0);
  CHECK(c.a2a_algorithm_for(0, 0) == A2aAlgo::kDirect);
  CHECK(c.a2a_algorithm_for(kA2avDirectMaxBytes, 10) == A2aAlgo::kDirect);
  CHECK(c.a2a_algorithm_for(10, kA2avDirectMaxBytes + 1) == A2aAlgo::kPairwise);
  CHECK(c.a2a_algorithm_for(kA2avDirectMaxBytes + 1, 0) == A2aAlgo::kPairwise);
  c.set_a2a_algorithm(A2aAlgo::kDirect);
  CHECK(c.a2a_algorithm_for(size_t(1) << 30, size_t(1) << 30) == A2aAlgo::kDirect);
  LocalWorld forced(2, with_algo(A2aAlgo::kPairwise));
  CHECK(forced.comm(1).a2a_algorithm_for(8, 8) == A2aAlgo::kPairwise);
  CHECK(parse_a2a_algo("direct") == A2aAlgo::kDirect);
  CHECK_THROWS_WITH(parse_a2a_algo("ring"), "unknown all-to-all algorithm 'ring' (use pairwise, direct or auto)");
}

TEST_CASE("all_to_all_counts exchanges the counts, then all_to_all_v moves the data (expert dispatch)") {
  const int n = 3;
  LocalWorld world(n, with_algo(A2aAlgo::kAuto));
  auto res = world.run([&](Communicator& comm, int r) -> std::string {
    // Each rank decides alone what it sends each rank (as a router does), learns the rest.
    std::vector<size_t> send(n), recv(n, 12345);
    for (int j = 0; j < n; ++j) send[j] = size_t((r * 5 + j * 3) % 4) * 100;  // zeros included
    comm.all_to_all_counts(send, recv)->wait(Deadline::after(30s));
    for (int i = 0; i < n; ++i)
      if (recv[i] != size_t((i * 5 + r * 3) % 4) * 100) return "count from rank " + std::to_string(i);
    std::vector<float> in(std::accumulate(send.begin(), send.end(), size_t{0}));
    std::vector<float> out(std::accumulate(recv.begin(), recv.end(), size_t{0}), -1.0f);
    size_t at = 0;
    for (int j = 0; j < n; ++j)
      for (size_t k = 0; k < send[j]; ++k) in[at++] = float(r * 1000 + j * 100 + int(k % 100));
    comm.all_to_all_v(in.data(), send, {}, out.data(), recv, {}, DataType::kF32)->wait(Deadline::after(30s));
    at = 0;
    for (int i = 0; i < n; ++i)
      for (size_t k = 0; k < recv[i]; ++k)
        if (out[at++] != float(i * 1000 + r * 100 + int(k % 100))) return "element from rank " + std::to_string(i);
    return "";
  });
  CHECK(first_failure(res) == "");
  CHECK(refusal([](Communicator& c) {
          std::vector<size_t> s(2), r(3);
          c.all_to_all_counts(s, r);
        }) == "all_to_all_counts: send_counts has 2 entries and recv_counts 3, but the communicator has 3 ranks");
}

TEST_CASE("all_to_all_v refuses bad arguments with one usage error at the call") {
  float buf[64] = {};
  const std::vector<size_t> three{1, 2, 3}, zeros{0, 0, 0};
  auto call = [&](std::vector<size_t> sc, std::vector<size_t> sd, std::vector<size_t> rc, std::vector<size_t> rd,
                  const void* in = nullptr, void* out = nullptr) {
    return refusal([&](Communicator& c) {
      c.all_to_all_v(in ? in : buf, sc, sd, out ? out : buf + 32, rc, rd, DataType::kF32);
    });
  };
  CHECK(call({1, 2}, {}, three, {}) == "all_to_all_v: send_counts has 2 entries but the communicator has 3 ranks");
  CHECK(call(three, {0, 1}, three, {}) ==
        "all_to_all_v: send_displs has 2 entries but the communicator has 3 ranks (or pass none: packed)");
  CHECK(call(three, {}, {1, 2, 3, 4}, {}) == "all_to_all_v: recv_counts has 4 entries but the communicator has 3 ranks");
  CHECK(call({2, 2, 3}, {}, three, {}) ==
        "all_to_all_v: rank 0 sends itself 2 elements (send_counts[0]) but receives 1 (recv_counts[0])");
  CHECK(call(three, {}, three, {0, 2, 3}) ==
        "all_to_all_v: the receive regions from ranks 1 and 2 overlap (elements [2, 4) and [3, 6))");
  CHECK(call(three, {}, {1, 0, 3}, {0, 0, 1}) == "no error");  // the empty region overlaps nothing
  CHECK(call(three, {}, three, {SIZE_MAX / 2, 0, 1}) ==
        "all_to_all_v: recv_displs[0] = 9223372036854775807 elements is more bytes than memory holds");
  CHECK(call(three, {SIZE_MAX / 4, 0, 0}, three, {}) ==
        "all_to_all_v: send_displs[0] + send_counts[0] is past the end of memory");
  CHECK_THAT(refusal([&](Communicator& c) {
               c.all_to_all_v(nullptr, three, {}, buf, three, {}, DataType::kF32);
             }),
             Catch::Equals("all_to_all_v: in is null but send_counts are not all zero"));
  CHECK_THAT(refusal([&](Communicator& c) {
               c.all_to_all_v(buf, three, {}, nullptr, three, {}, DataType::kF32);
             }),
             Catch::Equals("all_to_all_v: out is null but recv_counts are not all zero"));
  // Nothing to move: null buffers are fine (rank 0 alone posts nothing that needs a peer to
  // refuse; the operation itself is not awaited).
  CHECK(refusal([&](Communicator& c) { c.all_to_all_v(nullptr, zeros, {}, nullptr, zeros, {}, DataType::kF32); }) ==
        "no error");
}

TEST_CASE("all_to_all_v fails the receive whose count disagrees with its sender's") {
  // Rank 0 sends rank 1 `sent` i32 elements in chunks of 16 bytes; rank 1 expects `expected`.
  // Whichever is longer, some chunk has the wrong length.
  auto mismatch = [](size_t sent, size_t expected) {
    LocalWorld world(2, with_algo(A2aAlgo::kAuto, 16));
    return world.run([&](Communicator& comm, int r) -> std::string {
      std::vector<int32_t> in(64, r), out(64, -1);
      std::vector<size_t> sc = r == 0 ? std::vector<size_t>{1, sent} : std::vector<size_t>{1, 1};
      std::vector<size_t> rc = r == 0 ? std::vector<size_t>{1, 1} : std::vector<size_t>{expected, 1};
      try {
        comm.all_to_all_v(in.data(), sc, {}, out.data(), rc, {}, DataType::kI32)->wait(Deadline::after(30s));
      } catch (const Error& e) {
        return e.what();
      }
      return "";
    })[1];
  };
  CHECK_THAT(mismatch(2, 3), Catch::Contains("all_to_all_v: rank 0 sent 8 bytes in part 0 of its message, but rank 1 "
                                             "expected 12"));
  CHECK_THAT(mismatch(9, 8), Catch::Contains("received message of 4 bytes into a buffer of 0"));  // the transport's
  CHECK_THAT(mismatch(8, 9), Catch::Contains("rank 0 sent 0 bytes in part 2 of its message, but rank 1 expected 4"));
  CHECK(mismatch(8, 8) == "");
}

TEST_CASE("TRN_CHECK_COLLECTIVES names all_to_all_v in a mismatch") {
  CommOptions o = with_algo(A2aAlgo::kAuto);
  o.check = true;
  LocalWorld world(2, o);
  auto res = world.run([](Communicator& comm, int r) -> std::string {
    std::vector<float> in(4, 1.0f), out(4);
    std::vector<size_t> counts{2, 2};
    try {
      (r == 0 ? comm.all_to_all_v(in.data(), counts, {}, out.data(), counts, {}, DataType::kF32)
              : comm.all_to_all(in.data(), out.data(), 2, DataType::kF32))
          ->wait(Deadline::after(30s));
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  });
  for (const auto& e : res)
    CHECK_THAT(e, Catch::Contains("rank 0 called all_to_all_v(f32); rank 1 called all_to_all(count=2, f32)"));
}

TEST_CASE("TRN_CHECK_COLLECTIVES: counts that disagree between ranks fail all_to_all_v on every rank, naming both") {
  CommOptions o = with_algo(A2aAlgo::kAuto);
  o.check = true;
  LocalWorld world(3, o);
  auto res = world.run([](Communicator& comm, int r) -> std::string {
    std::vector<float> in(16, 1.0f), out(16);
    std::vector<size_t> counts{2, 2, 2}, recv = counts;
    if (r == 2) recv[1] = 3;  // rank 1 sends rank 2 two elements; rank 2 expects three
    try {
      comm.all_to_all_v(in.data(), counts, {}, out.data(), recv, {}, DataType::kF32)->wait(Deadline::after(30s));
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  });
  for (const auto& e : res)
    CHECK_THAT(e, Catch::Contains("all_to_all_v: rank 1 sends rank 2 2 elements but rank 2 expects 3 (send_counts[2] "
                                  "on rank 1 and recv_counts[1] on rank 2 must agree)"));
}
