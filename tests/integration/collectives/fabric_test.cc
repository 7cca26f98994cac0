// Collectives on real processes over the real fabric (tcp and shm), bootstrapped through a
// FileStore: a representative subset of the reference matrix, a rank killed mid-all-reduce,
// mismatched calls, and trn-collbench itself.
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <signal.h>

#include <chrono>
#include <sstream>
#include <thread>

#include "collectives/bootstrap/file_store.h"
#include "collectives/communicator.h"
#include "collectives/core/error.h"
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

std::shared_ptr<Communicator> join(const std::vector<std::string>& args) {
  int rank = std::stoi(args.at(0)), size = std::stoi(args.at(1));
  FileStore store(args.at(2));
  log::set_rank(rank);
  return std::make_shared<Communicator>(fabric::connect(store, rank, size));
}

std::vector<ProcResult> run_world(const std::string& name, int n, std::map<std::string, std::string> env,
                                  std::chrono::seconds timeout = 90s) {
  TempDir dir;
  env.emplace("TRN_LOG_LEVEL", "warn");
  env.emplace("TRN_TIMEOUT", "30");  // a rank that fails to start fails its peers fast
  std::vector<ProcSpec> specs;
  for (int r = 0; r < n; ++r) specs.push_back(child(name, {std::to_string(r), std::to_string(n), dir.path()}, env));
  return run_all(specs, timeout);
}

const std::map<std::string, std::string> kTcp = {{"TRN_FABRIC_PROVIDER", "tcp"}, {"TRN_FABRIC_SHM", "0"}};
const std::map<std::string, std::string> kShm = {{"TRN_FABRIC_PROVIDER", "shm"}};

}  // namespace

TRN_TEST_CHILD(coll_subset) {
  return run_main("coll_subset", [&] {
    auto comm = join(args);
    const int n = comm->size();
    std::vector<Case> cases;
    for (Coll c : selftest::kAllColls) {
      cases.push_back(Case{c, DataType::kF32, ReduceOp::kSum, 1031, false, 0});
      cases.push_back(Case{c, DataType::kBF16, ReduceOp::kAvg, 4099, true, n - 1});
      cases.push_back(Case{c, DataType::kI64, ReduceOp::kMax, 0, false, 1 % n});
      cases.push_back(Case{c, DataType::kF16, ReduceOp::kProd, 7, true, 0});
    }
    int failures = 0;
    for (Algo algo : {Algo::kRing, Algo::kTree, Algo::kRhd}) {
      comm->set_algorithm(algo);
      for (size_t count : {size_t{1}, size_t{100003}, size_t{(1 << 20) + 7}})
        cases.push_back(Case{Coll::kAllReduce, DataType::kF32, ReduceOp::kSum, count, count % 2 == 1, 0});
      for (const Case& c : cases) {
        std::string e = selftest::run_and_verify(*comm, c, Deadline::after(60s));
        if (!e.empty()) {
          std::fprintf(stderr, "%s: %s\n", to_string(algo), e.c_str());
          ++failures;
        }
      }
      cases.clear();
    }
    comm->barrier()->wait();
    return failures ? 1 : 0;
  });
}

TEST_CASE("collectives over tcp and shm between processes match the reference", "[integration]") {
  for (auto [env, n] : {std::pair{kTcp, 3}, std::pair{kShm, 4}}) {
    auto rs = run_world("coll_subset", n, env);
    for (size_t r = 0; r < rs.size(); ++r) {
      INFO(env.at("TRN_FABRIC_PROVIDER") << " rank " << r << ": " << rs[r].describe());
      CHECK(rs[r].ok());
    }
  }
}

// all_to_all_v between processes: random counts with zeros (up to 3000 elements per pair, so
// that some ranks pass the direct algorithm's threshold and run pairwise), explicit gaps and in
// place, every type, each algorithm forced and then auto.
TRN_TEST_CHILD(a2av_matrix) {
  return run_main("a2av_matrix", [&] {
    auto comm = join(args);
    const int n = comm->size();
    int failures = 0;
    uint64_t seed = 7;
    for (A2aAlgo algo : {A2aAlgo::kDirect, A2aAlgo::kPairwise, A2aAlgo::kAuto}) {
      comm->set_a2a_algorithm(algo);
      for (DataType t : kAllDataTypes)
        for (int layout = 0; layout < 3; ++layout) {
          const size_t max = t == DataType::kU8 ? 300000 : 3000;
          selftest::VCase c{t, selftest::random_counts(seed++, max, n), layout == 1, layout == 2};
          selftest::Outcome o = selftest::run_all_to_all_v(*comm, c, Deadline::after(60s));
          if (o.wrong) {
            std::fprintf(stderr, "%s: %s\n", to_string(algo), o.first.c_str());
            ++failures;
          }
        }
    }
    // Expert dispatch: the counts first, then the data they describe.
    std::vector<size_t> send(n), recv(n);
    for (int j = 0; j < n; ++j) send[j] = size_t((comm->rank() + 2 * j) % 3) * 1000;
    comm->all_to_all_counts(send, recv)->wait();
    for (int i = 0; i < n; ++i)
      if (recv[i] != size_t((i + 2 * comm->rank()) % 3) * 1000) {
        std::fprintf(stderr, "all_to_all_counts: %zu from rank %d\n", recv[i], i);
        ++failures;
      }
    comm->barrier()->wait();
    return failures ? 1 : 0;
  });
}

TEST_CASE("all_to_all_v over tcp and shm between 2, 3 and 4 processes matches the reference", "[integration]") {
  for (int n : {2, 3, 4})
    for (const auto& env : {kShm, kTcp}) {
      auto rs = run_world("a2av_matrix", n, env, 180s);
      for (size_t r = 0; r < rs.size(); ++r) {
        INFO(env.at("TRN_FABRIC_PROVIDER") << ", " << n << " ranks, rank " << r << ": " << rs[r].describe());
        CHECK(rs[r].ok());
      }
    }
}

// udp;ofi_rxd: reliable messages over datagrams, with the provider's own sequencing and
// retransmission (as EFA's RDM is over SRD), and every buffer registered as EFA requires.
TEST_CASE("collectives over udp;ofi_rxd with every buffer registered match the reference", "[integration][udp]") {
  const std::map<std::string, std::string> udp = {
      {"TRN_FABRIC_PROVIDER", "udp"}, {"TRN_FABRIC_SHM", "0"}, {"TRN_FABRIC_MR_LOCAL", "1"}, {"TRN_LOG_LEVEL", "info"}, {"TRN_LOG_SUBSYS", "fabric"}};
  auto rs = run_world("coll_subset", 3, udp);
  for (size_t r = 0; r < rs.size(); ++r) {
    INFO("rank " << r << ": " << rs[r].describe());
    CHECK(rs[r].ok());
    CHECK_THAT(rs[r].output, Catch::Contains(fmt::format("rank {}/3 udp;ofi_rxd on", r)) &&
                                 Catch::Contains("(buffers registered)"));
  }
}

TRN_TEST_CHILD(allreduce_forever) {
  return run_main("allreduce_forever", [&] {
    auto comm = join(args);
    std::vector<float> buf(1 << 20, 1.0f);
    for (long i = 0;; ++i) {
      comm->all_reduce(buf.data(), buf.data(), buf.size(), DataType::kF32, ReduceOp::kMax)->wait();
      if (i == 0) {
        std::printf("running\n");
        std::fflush(stdout);
      }
    }
    return 0;
  });
}

TEST_CASE("a rank killed mid-all-reduce makes every survivor fail within the deadline", "[integration]") {
  for (auto env : {kTcp, kShm}) {
    TempDir dir;
    env.insert_or_assign("TRN_TIMEOUT", std::string("5"));
    env.insert_or_assign("TRN_LOG_LEVEL", std::string("warn"));
    const int n = 3;
    std::vector<std::unique_ptr<Process>> procs;
    for (int r = 0; r < n; ++r)
      procs.push_back(std::make_unique<Process>(child("allreduce_forever", {std::to_string(r), std::to_string(n), dir.path()}, env)));
    auto deadline = std::chrono::steady_clock::now() + 60s;
    for (auto& p : procs)
      while (p->output_so_far().find("running") == std::string::npos && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(10ms);
    std::this_thread::sleep_for(100ms);
    procs[1]->signal(SIGKILL);
    // TRN_TIMEOUT is 5 s; allow for a loaded machine but not for a hang.
    auto survivors_deadline = std::chrono::steady_clock::now() + 30s;
    for (int r : {0, 2}) {
      ProcResult res = procs[r]->wait(survivors_deadline);
      INFO(env.at("TRN_FABRIC_PROVIDER") << " rank " << r << ": " << res.describe());
      CHECK(!res.timed_out);
      CHECK(res.exit_code == 1);
      CHECK(res.output.find("allreduce_forever: ") != std::string::npos);
      // Over shm the survivors notice the ended process itself, not only the deadline.
      if (env.at("TRN_FABRIC_PROVIDER") == "shm") CHECK(res.output.find("ended: its process") != std::string::npos);
    }
    procs[1]->wait(std::chrono::steady_clock::now() + 5s);
  }
}

// Rank 0 sends its last message and exits; rank 1 reads it only after a probe tick has passed
// with an earlier operation pending, so the peer watch's next tick finds rank 0 gone while the
// message is still to be read.
TRN_TEST_CHILD(send_and_leave) {
  return run_main("send_and_leave", [&] {
    auto comm = join(args);
    std::vector<float> x(1, 1.0f), y(1 << 20);
    if (comm->rank() == 0) {
      std::this_thread::sleep_for(1200ms);  // rank 1's receive of x waits through two probe ticks
      comm->send(x.data(), 1, DataType::kF32, 1)->wait();
      for (size_t i = 0; i < y.size(); ++i) y[i] = float(i % 1000);
      comm->send(y.data(), y.size(), DataType::kF32, 1)->wait();
      return 0;  // and leaves at once
    }
    comm->recv(x.data(), 1, DataType::kF32, 0)->wait();
    std::this_thread::sleep_for(700ms);  // rank 0 is gone by now, its last message not yet read
    comm->recv(y.data(), y.size(), DataType::kF32, 0)->wait();
    for (size_t i = 0; i < y.size(); ++i)
      if (y[i] != float(i % 1000)) throw internal_error("element {} of the last message is {}", i, y[i]);
    std::printf("received\n");
    return 0;
  });
}

TEST_CASE("a peer that sends its last message and exits is not taken for lost while the message is read", "[integration]") {
  for (int run = 0; run < 2; ++run) {
    auto results = run_world("send_and_leave", 2, kTcp);
    for (auto& r : results) {
      INFO(r.describe());
      CHECK(r.exit_code == 0);
    }
    CHECK_THAT(results.at(1).output, Catch::Contains("received"));
  }
}

TRN_TEST_CHILD(mismatch) {
  return run_main("mismatch", [&] {
    auto comm = join(args);
    std::vector<int32_t> buf(16, 1);
    if (comm->rank() == 0)
      comm->all_reduce(buf.data(), buf.data(), 16, DataType::kI32, ReduceOp::kSum)->wait();
    else
      comm->broadcast(buf.data(), 12, DataType::kI32, 0)->wait();
    return 0;
  });
}

TEST_CASE("mismatched collectives under TRN_CHECK_COLLECTIVES=1 fail on every rank naming both sides", "[integration]") {
  auto env = kShm;
  env.insert_or_assign("TRN_CHECK_COLLECTIVES", std::string("1"));
  auto rs = run_world("mismatch", 2, env, 60s);
  for (size_t r = 0; r < rs.size(); ++r) {
    INFO("rank " << r << ": " << rs[r].describe());
    CHECK(rs[r].exit_code == 2);
    CHECK(rs[r].output.find("rank 0 called all_reduce(count=16, i32, sum); rank 1 called broadcast(count=12, i32, "
                            "root=0)") != std::string::npos);
  }
}

TEST_CASE("trn-collbench checks every collective over a FileStore bootstrap", "[integration]") {
  for (std::string op : {"allreduce", "reducescatter", "allgather", "broadcast", "reduce", "alltoall", "alltoallv"}) {
    TempDir dir;
    std::vector<ProcSpec> specs;
    for (int r = 0; r < 3; ++r)
      specs.push_back(ProcSpec{{bin("trn-collbench"), "-b", "0", "-e", "1M", "-f", "32", "-o", op, "-d", "bf16", "-r",
                                "max", "-n", "2", "-w", "1", "-c", "1", "--root", "2"},
                               {{"TRN_STORE_DIR", dir.path()}, {"TRN_RANK", std::to_string(r)},
                                {"TRN_WORLD_SIZE", "3"}, {"TRN_FABRIC_PROVIDER", "shm"}, {"TRN_LOG_LEVEL", "warn"},
                                {"TRN_TIMEOUT", "30"}}});
    auto rs = run_all(specs, 90s);
    for (auto& r : rs) {
      INFO(op << ": " << r.describe());
      REQUIRE(r.ok());
    }
    // rank 0 prints one row per size (0, 1, 32, 1K, 32K, 1M), each with 0 wrong (the 9th column),
    // and p50 <= p99 (the 10th and 11th).
    INFO(rs[0].output);
    int rows = 0;
    std::istringstream lines(rs[0].output);
    for (std::string line; std::getline(lines, line);) {
      if (line.empty() || line[0] != ' ') continue;
      ++rows;
      std::istringstream w(line);
      std::string col[9];
      double p50 = -1, p99 = -1;
      for (auto& c : col) w >> c;
      w >> p50 >> p99;
      CHECK(col[8] == "0");
      CHECK(p50 >= 0);
      CHECK(p50 <= p99);
    }
    CHECK(rows == 6);
  }
}

TEST_CASE("trn-collbench rejects bad flags with one line and exit 2", "[integration]") {
  auto rs = run_all({ProcSpec{{bin("trn-collbench"), "-o", "allsum"}, {}}, ProcSpec{{bin("trn-collbench"), "-b", "1Q"}, {}},
                     ProcSpec{{bin("trn-collbench")}, {{"TRN_STORE_DIR", ""}}}},
                    30s);
  CHECK(rs[0].exit_code == 2);
  CHECK(rs[0].output == "trn-collbench: error: unknown operation 'allsum' (use allreduce, reducescatter, allgather, "
                        "broadcast, reduce, alltoall or alltoallv)\n");
  CHECK(rs[1].exit_code == 2);
  CHECK_THAT(rs[1].output, Catch::Contains("-b 1Q: not a size"));
  CHECK(rs[2].exit_code == 2);
  CHECK_THAT(rs[2].output, Catch::Contains("no bootstrap: run under mpirun, or give --store-dir"));
}
