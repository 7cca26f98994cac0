// The hierarchical all-reduce between real processes over the real fabric (shm and tcp), with
// the processes grouped as if on two hosts (CommOptions::hosts): every type and op against the
// serial reference, and the same results as the flat ring on values that round.
#include <catch2/catch.hpp>
#include <cmath>

#include "collectives/bootstrap/file_store.h"
#include "collectives/communicator.h"
#include "collectives/core/log.h"
#include "collectives/core/main.h"
#include "collectives/fabric/fabric.h"
#include "collectives/selftest.h"
#include "tests/support/process.h"

using namespace trn;
using namespace trn::test;
using namespace std::chrono_literals;
using selftest::Case;
using selftest::Coll;

namespace {

const std::map<std::string, std::string> kTcp = {{"TRN_FABRIC_PROVIDER", "tcp"}, {"TRN_FABRIC_SHM", "0"}};
const std::map<std::string, std::string> kShm = {{"TRN_FABRIC_PROVIDER", "shm"}};

std::vector<ProcResult> run_world(const std::string& name, int n, std::map<std::string, std::string> env) {
  TempDir dir;
  env.emplace("TRN_LOG_LEVEL", "warn");
  env.emplace("TRN_TIMEOUT", "30");
  std::vector<ProcSpec> specs;
  for (int r = 0; r < n; ++r)
    specs.push_back(child(name, {std::to_string(r), std::to_string(n), dir.path()}, env));
  return run_all(specs, 120s);
}

}  // namespace

// Ranks 2h and 2h+1 form "host" h.
TRN_TEST_CHILD(hier_world) {
  return run_main("hier_world", [&] {
    const int rank = std::stoi(args.at(0)), n = std::stoi(args.at(1));
    FileStore store(args.at(2));
    log::set_rank(rank);
    CommOptions o;
    o.algo = Algo::kHier;
    for (int r = 0; r < n; ++r) o.hosts.push_back(r / 2);
    auto comm = std::make_shared<Communicator>(fabric::connect(store, rank, n), o);
    int failures = 0;
    auto fail = [&](const std::string& what) {
      std::fprintf(stderr, "rank %d: %s\n", rank, what.c_str());
      ++failures;
    };
    std::vector<Case> cases;
    for (DataType t : kAllDataTypes)
      for (ReduceOp op : kAllReduceOps)
        for (size_t count : {size_t{0}, size_t{1}, size_t{1031}})
          cases.push_back(Case{Coll::kAllReduce, t, op, count, count % 2 == 1, 0});
    cases.push_back(Case{Coll::kAllReduce, DataType::kF32, ReduceOp::kSum, (1 << 20) + 7, false, 0});
    cases.push_back(Case{Coll::kAllReduce, DataType::kBF16, ReduceOp::kAvg, 300001, true, 0});
    for (const Case& c : cases) {
      std::string e = selftest::run_and_verify(*comm, c, Deadline::after(60s));
      if (!e.empty()) fail(e);
    }
    // Against the flat ring on values whose sums round (f32) and on large integers (i64).
    const size_t count = 250007;
    std::vector<float> fin(count), fh(count), fr(count);
    std::vector<int64_t> iin(count), ih(count), ir(count);
    for (size_t i = 0; i < count; ++i) {
      fin[i] =
          static_cast<float>(std::sin(0.001 * static_cast<double>(i) * (rank + 1)) * 1000.0 / (1 + i % 17));
      iin[i] = static_cast<int64_t>((i * 2654435761u + rank * 40503u) % 1000003) * 1000003 - 7 * rank;
    }
    comm->all_reduce(fin.data(), fh.data(), count, DataType::kF32, ReduceOp::kSum)->wait();
    comm->all_reduce(iin.data(), ih.data(), count, DataType::kI64, ReduceOp::kSum)->wait();
    comm->set_algorithm(Algo::kRing);
    comm->all_reduce(fin.data(), fr.data(), count, DataType::kF32, ReduceOp::kSum)->wait();
    comm->all_reduce(iin.data(), ir.data(), count, DataType::kI64, ReduceOp::kSum)->wait();
    size_t far = 0, int_diff = 0;
    for (size_t i = 0; i < count; ++i) {
      // |fin| bounds every rank's value at i by this rank's scale times n (inputs are sin-like).
      const double scale = 1000.0 / (1 + i % 17) * n;
      far += std::fabs(static_cast<double>(fh[i]) - fr[i]) > 1e-6 * n * scale;
      int_diff += ih[i] != ir[i];
    }
    if (far) fail(std::to_string(far) + " f32 sums differ from the ring's beyond rounding");
    if (int_diff) fail(std::to_string(int_diff) + " i64 sums differ from the ring's");
    comm->barrier()->wait();
    if (rank == 0) std::printf("layout %s\n", comm->host_layout().describe().c_str());
    return failures ? 1 : 0;
  });
}

TEST_CASE("hier all-reduce between processes grouped as 2 hosts x 2 ranks matches the reference and the ring",
          "[integration]") {
  for (const auto& env : {kShm, kTcp}) {
    auto rs = run_world("hier_world", 4, env);
    for (size_t r = 0; r < rs.size(); ++r) {
      INFO(env.at("TRN_FABRIC_PROVIDER") << " rank " << r << ": " << rs[r].describe());
      CHECK(rs[r].ok());
    }
    CHECK_THAT(rs[0].output, Catch::Contains("layout 2 hosts x 2 ranks"));
  }
}

TEST_CASE("processes of one machine are one host to the fabric", "[integration]") {
  // trn-collbench prints the layout the transport reports (hostname and boot id alike).
  TempDir dir;
  std::vector<ProcSpec> specs;
  for (int r = 0; r < 3; ++r)
    specs.push_back(ProcSpec{{bin("trn-collbench"), "-b", "1K", "-e", "1K", "-n", "1", "-w", "0", "-c", "1"},
                             {{"TRN_STORE_DIR", dir.path()},
                              {"TRN_RANK", std::to_string(r)},
                              {"TRN_WORLD_SIZE", "3"},
                              {"TRN_FABRIC_PROVIDER", "tcp"},
                              {"TRN_LOG_LEVEL", "warn"},
                              {"TRN_TIMEOUT", "30"}}});
  auto rs = run_all(specs, 60s);
  for (auto& r : rs) REQUIRE(r.ok());
  CHECK_THAT(rs[0].output, Catch::Contains("# layout: 1 host x 3 ranks"));
  CHECK(rs[0].output.find("hier") == std::string::npos);  // one host: the cost model never picks it
}
