// Every collective x algorithm x type x op x world size 1..8 x count x in-place, on the
// in-process transport, against the serial reference (verify.h).
#include <catch2/catch.hpp>

#include "tests/unit/collectives/local_world.h"
#include "collectives/selftest.h"

using namespace trn;
using namespace trn::test;
using namespace trn::selftest;

namespace {

CommOptions options(Algo algo, size_t chunk) {
  CommOptions o;
  o.algo = algo;
  o.chunk_bytes = chunk;
  return o;
}

constexpr size_t kSmallCounts[] = {0, 1, 2, 3, 7, 13, 31, 257};

// Runs every case on every rank; returns the first failure, or "".
std::string run_cases(LocalWorld& world, const std::vector<Case>& cases) {
  auto results = world.run([&](Communicator& comm, int) -> std::string {
    for (const Case& c : cases) {
      std::string e = run_and_verify(comm, c, Deadline::after(std::chrono::seconds(60)));
      if (!e.empty()) return e;
    }
    return "";
  });
  return first_failure(results);
}

std::vector<Case> small_cases(Coll coll, int n) {
  std::vector<Case> cases;
  for (DataType t : kAllDataTypes)
    for (ReduceOp op : kAllReduceOps) {
      if (!reduces(coll) && op != ReduceOp::kSum) continue;
      for (size_t count : kSmallCounts)
        for (bool in_place : {false, true})
          cases.push_back(Case{coll, t, op, count, in_place, static_cast<int>(count % n)});
    }
  return cases;
}

}  // namespace

TEST_CASE("all-reduce: ring, tree and rhd match the reference for every type, op, world size and count") {
  for (Algo algo : {Algo::kRing, Algo::kTree, Algo::kRhd}) {
    for (int n = 1; n <= 8; ++n) {
      CommOptions opts;
      opts.algo = algo;
      opts.chunk_bytes = 16;  // many chunks even for small counts: exercises the pipelines
      LocalWorld world(n, opts);
      INFO("algorithm " << to_string(algo) << ", world size " << n);
      CHECK(run_cases(world, small_cases(Coll::kAllReduce, n)) == "");
    }
  }
}

TEST_CASE("reduce-scatter, all-gather, broadcast, reduce, all-to-all and all_to_all_v match the reference") {
  for (Coll coll : {Coll::kReduceScatter, Coll::kAllGather, Coll::kBroadcast, Coll::kReduce, Coll::kAllToAll,
                    Coll::kAllToAllV}) {
    for (int n = 1; n <= 8; ++n) {
      CommOptions opts;
      opts.chunk_bytes = 16;
      LocalWorld world(n, opts);
      INFO(to_string(coll) << ", world size " << n);
      CHECK(run_cases(world, small_cases(coll, n)) == "");
    }
  }
}

TEST_CASE("collectives of a few MiB match the reference") {
  const size_t count = (3u << 20) / 4 + 5;  // ~3 MiB of f32, not a multiple of any world size
  for (int n : {2, 3, 5, 8}) {
    LocalWorld world(n, options(Algo::kAuto, 128 * 1024));
    std::vector<Case> cases;
    for (DataType t : {DataType::kF32, DataType::kBF16, DataType::kF16, DataType::kI64})
      cases.push_back(Case{Coll::kAllReduce, t, ReduceOp::kSum, count, t == DataType::kF32, 0});
    cases.push_back(Case{Coll::kReduceScatter, DataType::kF32, ReduceOp::kMax, count / n, false, 0});
    cases.push_back(Case{Coll::kAllGather, DataType::kF32, ReduceOp::kSum, count / n, true, 0});
    cases.push_back(Case{Coll::kBroadcast, DataType::kF32, ReduceOp::kSum, count, false, n - 1});
    cases.push_back(Case{Coll::kReduce, DataType::kF32, ReduceOp::kSum, count, false, n / 2});
    cases.push_back(Case{Coll::kAllToAll, DataType::kF32, ReduceOp::kSum, count / n, false, 0});
    INFO("world size " << n);
    CHECK(run_cases(world, cases) == "");
  }
}

TEST_CASE("all-reduce of a few MiB is right with every algorithm") {
  const size_t count = (2u << 20) / 4 + 3;
  for (Algo algo : {Algo::kRing, Algo::kTree, Algo::kRhd})
    for (int n : {3, 4, 6, 7}) {
      LocalWorld world(n, options(algo, 64 * 1024));
      std::vector<Case> cases = {Case{Coll::kAllReduce, DataType::kF32, ReduceOp::kSum, count, false, 0},
                                 Case{Coll::kAllReduce, DataType::kBF16, ReduceOp::kAvg, count, true, 0}};
      INFO("algorithm " << to_string(algo) << ", world size " << n);
      CHECK(run_cases(world, cases) == "");
    }
}
