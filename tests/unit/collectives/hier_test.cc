// The hierarchical all-reduce on the in-process transport with ranks grouped into "hosts": the
// reference matrix (every type, op, count, in and out of place) on several layouts, agreement
// with the flat ring on values that round, splits that inherit the grouping, and the error for
// a layout it cannot run.
#include <catch2/catch.hpp>
#include <cmath>

#include "collectives/core/error.h"
#include "collectives/selftest.h"
#include "tests/unit/collectives/local_world.h"

using namespace trn;
using namespace trn::test;
using namespace trn::selftest;
using namespace std::chrono_literals;

namespace {

CommOptions hier(size_t chunk = 0) {
  CommOptions o;
  o.algo = Algo::kHier;
  o.chunk_bytes = chunk;
  o.timeout = 30s;
  return o;
}

std::string run_cases(LocalWorld& world, const std::vector<Case>& cases) {
  return first_failure(world.run([&](Communicator& comm, int) -> std::string {
    for (const Case& c : cases) {
      std::string e = run_and_verify(comm, c, Deadline::after(30s));
      if (!e.empty()) return e;
    }
    return "";
  }));
}

// Layouts: host of each rank.
const std::vector<std::vector<int>> kLayouts = {
    {0, 0, 1, 1},              // 2 hosts x 2
    {0, 0, 0, 1, 1, 1},        // 2 x 3
    {0, 0, 1, 1, 2, 2},        // 3 x 2
    {5, 9, 5, 9},              // 2 x 2, interleaved, arbitrary host numbers
    {0, 0, 0, 0},              // one host: the ring
    {0, 1, 2},                 // one rank per host: the cross-host phase alone
    {0, 0, 1, 1, 2, 2, 3, 3},  // 4 x 2
};

}  // namespace

TEST_CASE("hier all-reduce matches the reference for every type, op, count and layout") {
  for (const auto& hosts : kLayouts) {
    // A 16-byte chunk makes even small pieces travel in several chunks (pipelines exercised).
    for (size_t chunk : {size_t{16}, size_t{0}}) {
      LocalWorld world(static_cast<int>(hosts.size()), hier(chunk), hosts);
      INFO(world.comm(0).host_layout().describe() << ", chunk " << chunk);
      std::vector<Case> cases;
      for (DataType t : kAllDataTypes)
        for (ReduceOp op : kAllReduceOps)
          for (size_t count : {0, 1, 2, 3, 7, 13, 257, 1031})
            for (bool in_place : {false, true})
              cases.push_back(Case{Coll::kAllReduce, t, op, count, in_place, 0});
      // Long enough for 64-byte aligned pieces and several default chunks per piece.
      cases.push_back(Case{Coll::kAllReduce, DataType::kF32, ReduceOp::kSum, (1 << 20) + 7, false, 0});
      cases.push_back(Case{Coll::kAllReduce, DataType::kBF16, ReduceOp::kAvg, 300001, true, 0});
      CHECK(run_cases(world, cases) == "");
    }
  }
}

TEST_CASE("hier all-reduce gives the flat ring's results: within rounding for floats, exact for integers") {
  const std::vector<int> hosts = {0, 0, 0, 1, 1, 1};
  const int n = 6;
  const size_t count = 100003;  // not a multiple of the ranks or of the pieces
  LocalWorld world(n, hier(), hosts);
  std::vector<std::vector<float>> fin(n), fhier(n, std::vector<float>(count)),
      fring(n, std::vector<float>(count));
  std::vector<std::vector<int64_t>> iin(n), ihier(n, std::vector<int64_t>(count)),
      iring(n, std::vector<int64_t>(count));
  for (int r = 0; r < n; ++r)
    for (size_t i = 0; i < count; ++i) {
      fin[r].push_back(std::sin(0.001 * static_cast<double>(i) * (r + 1)) * 1000.0f / (1 + (i % 17)));
      iin[r].push_back(static_cast<int64_t>((i * 2654435761u + r * 40503u) % 1000003) * 1000003 - 7 * r);
    }
  auto res = world.run([&](Communicator& comm, int r) -> std::string {
    comm.all_reduce(fin[r].data(), fhier[r].data(), count, DataType::kF32, ReduceOp::kSum)->wait();
    comm.all_reduce(iin[r].data(), ihier[r].data(), count, DataType::kI64, ReduceOp::kSum)->wait();
    comm.set_algorithm(Algo::kRing);
    comm.all_reduce(fin[r].data(), fring[r].data(), count, DataType::kF32, ReduceOp::kSum)->wait();
    comm.all_reduce(iin[r].data(), iring[r].data(), count, DataType::kI64, ReduceOp::kSum)->wait();
    return "";
  });
  REQUIRE(first_failure(res) == "");
  size_t far = 0, int_diff = 0, not_identical = 0;
  for (size_t i = 0; i < count; ++i) {
    double exact = 0, magnitude = 0;
    for (int r = 0; r < n; ++r) exact += fin[r][i], magnitude += std::fabs(fin[r][i]);
    // Both orders are within n rounding steps of the exact sum.
    if (std::fabs(fhier[0][i] - fring[0][i]) > 1e-6 * n * magnitude + 1e-30) ++far;
    if (std::fabs(fhier[0][i] - exact) > 1e-6 * n * magnitude + 1e-30) ++far;
    int_diff += ihier[0][i] != iring[0][i];
    for (int r = 1; r < n; ++r) not_identical += fhier[r][i] != fhier[0][i] || ihier[r][i] != ihier[0][i];
  }
  CHECK(far == 0);
  CHECK(int_diff == 0);
  CHECK(not_identical == 0);  // every rank ends bit-identical
}

TEST_CASE("a split of a grouped world keeps the grouping and runs hier on its own layout") {
  LocalWorld world(8, hier(), {0, 0, 0, 0, 1, 1, 1, 1});
  auto res = world.run([&](Communicator& comm, int r) -> std::string {
    auto sub = comm.split(r % 2, r);  // even ranks: 2 hosts x 2
    if (sub->host_layout().describe() != "2 hosts x 2 ranks")
      return "layout " + sub->host_layout().describe();
    return run_and_verify(*sub, Case{Coll::kAllReduce, DataType::kI32, ReduceOp::kSum, 1001, false, 0},
                          Deadline::after(30s));
  });
  CHECK(first_failure(res) == "");
}

TEST_CASE(
    "hier forced on hosts with different numbers of ranks is one usage error, and auto runs flat there") {
  LocalWorld world(3, hier(), {0, 0, 1});
  auto res = world.run([&](Communicator& comm, int) -> std::string {
    std::vector<float> buf(10, 1.0f);
    try {
      comm.all_reduce(buf.data(), buf.data(), buf.size(), DataType::kF32, ReduceOp::kSum)->wait();
      return "no error";
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kUsage) return std::string("not a usage error: ") + e.what();
      return e.what();
    }
  });
  for (const auto& r : res)
    CHECK(r ==
          "all-reduce algorithm hier: communicator 0 has 3 ranks on 2 hosts (2 + 1), but the hierarchical "
          "all-reduce needs the same number of ranks on every host (use ring, tree, rhd or auto)");
  CommOptions o = hier();
  o.algo = Algo::kRing;
  LocalWorld flat(3, o, {0, 0, 1});
  auto ok = flat.run([&](Communicator& comm, int) -> std::string {
    comm.set_algorithm(Algo::kAuto);
    if (comm.algorithm_for(1 << 20) == Algo::kHier) return "auto chose hier";
    return run_and_verify(comm, Case{Coll::kAllReduce, DataType::kF32, ReduceOp::kSum, 4097, false, 0},
                          Deadline::after(30s));
  });
  CHECK(first_failure(ok) == "");
}

TEST_CASE("ranks that disagree on the host grouping fail the agreement with a usage error") {
  auto group = make_local_group(2);
  std::vector<std::shared_ptr<Communicator>> comms;
  for (int r = 0; r < 2; ++r) {
    CommOptions o;
    o.timeout = 10s;
    o.hosts = r == 0 ? std::vector<int>{0, 0} : std::vector<int>{0, 1};
    comms.push_back(std::make_shared<Communicator>(group[r], o));
  }
  std::vector<std::string> got(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      try {
        comms[r]->cost_model();
      } catch (const Error& e) {
        got[r] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (const auto& g : got) CHECK_THAT(g, Catch::Contains("disagree on which ranks share a host"));
}

TEST_CASE("auto picks hier on every rank where the host-aware model says so, and never on one host") {
  CommOptions o;
  o.timeout = 30s;
  o.params_set = true;
  o.params = model_for_transport("rank 0/4 tcp;ofi_rxm on eth0 + shm to 1 rank(s) on this host");
  for (const std::vector<int>& hosts : {std::vector<int>{0, 0, 1, 1}, std::vector<int>{0, 0, 0, 0}}) {
    LocalWorld world(4, o, hosts);
    const bool grouped = hosts[3] == 1;
    auto res = world.run([&](Communicator& comm, int) -> std::string {
      std::string got;
      for (size_t b = 8; b <= (size_t{1} << 30); b *= 2) {
        const Algo a = comm.algorithm_for(b);
        if (a != choose_allreduce(comm.host_layout(), b, o.params)) return "not the model's choice";
        if (!grouped && a == Algo::kHier) return "hier on one host";
        got += to_string(a);
      }
      // The choice runs: an all-reduce of a size where it is hier (grouped) or flat.
      std::string e = run_and_verify(
          comm, Case{Coll::kAllReduce, DataType::kF32, ReduceOp::kSum, 1000, false, 0}, Deadline::after(30s));
      return e.empty() ? got : e;
    });
    INFO(world.comm(0).host_layout().describe());
    for (int r = 1; r < 4; ++r) CHECK(res[r] == res[0]);  // every rank chose alike at every size
    CHECK((res[0].find("hier") != std::string::npos) == grouped);
  }
}
