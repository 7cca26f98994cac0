// The hierarchical all-reduce across real hosts of the test bed (tests/multihost/testbed.sh):
// trn-collbench -c 1 under mpirun over 2 hosts x 2 ranks, hier forced and chosen by the cost
// model, with the layout the fabric saw (hosts by hostname) and the algorithm each size ran
// read from its table; and the error a layout hier cannot run gives. Needs root.
#include <fmt/format.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "tests/multihost/bed.h"
#include "tests/support/process.h"

using namespace trn::test;
using namespace std::chrono_literals;

namespace {

// mpirun in host 0 of the bed, ranks_per_host[k] ranks in host k.
ProcResult mpirun(const Bed& bed, const std::vector<int>& ranks_per_host,
                  const std::vector<std::string>& argv, const std::map<std::string, std::string>& env) {
  TempDir dir;
  return run_all({ProcSpec{bed.mpirun(dir.path(), ranks_per_host, argv, env), {}}}, 240s).at(0);
}

const std::map<std::string, std::string> kEnv = {
    {"TRN_LOG_LEVEL", "warn"}, {"TRN_TIMEOUT", "60"}, {"TRN_FABRIC_PROVIDER", "tcp"}};

struct Row {
  size_t bytes;
  std::string type, algo, wrong;
};

// The table rows trn-collbench printed: "  size count type redop algo time algbw busbw #wrong".
std::vector<Row> rows(const std::string& output) {
  std::vector<Row> out;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("  ", 0) != 0) continue;
    std::istringstream w(line);
    Row r;
    std::string count, redop, time, algbw, busbw;
    if (w >> r.bytes >> count >> r.type >> redop >> r.algo >> time >> algbw >> busbw >> r.wrong)
      out.push_back(r);
  }
  return out;
}

// How many sizes trn-collbench -b min -e max -f factor runs.
size_t sizes(size_t min, size_t max, size_t factor) {
  size_t n = 0;
  for (size_t b = min; b <= max; b = b ? b * factor : 1) ++n;
  return n;
}

std::vector<std::string> collbench(std::vector<std::string> args) {
  args.insert(args.begin(), bin("trn-collbench"));
  return args;
}

}  // namespace

TEST_CASE("hier forced across 2 test-bed hosts x 2 ranks gives correct all-reduces of every size and type",
          "[multihost][shared]") {
  Bed bed(2);
  // Counts not divisible by the ranks (3, 21, 147, ... elements of 4 bytes), 0 bytes, and types
  // and ops that round (bf16 avg) or must be exact (i64 sum).
  struct Run {
    std::vector<std::string> args;
    size_t expected_rows;
  };
  const std::vector<Run> runs = {
      {{"-b", "12", "-e", "8M", "-f", "7", "-d", "f32", "-r", "sum"}, sizes(12, 8 << 20, 7)},
      {{"-b", "0", "-e", "0", "-d", "f32", "-r", "sum"}, 1},
      {{"-b", "6", "-e", "2M", "-f", "9", "-d", "bf16", "-r", "avg"}, sizes(6, 2 << 20, 9)},
      {{"-b", "24", "-e", "2M", "-f", "9", "-d", "i64", "-r", "sum"}, sizes(24, 2 << 20, 9)},
      {{"-b", "1", "-e", "1M", "-f", "31", "-d", "u8", "-r", "max"}, sizes(1, 1 << 20, 31)},
  };
  for (const Run& run : runs) {
    std::vector<std::string> args = run.args;
    args.insert(args.end(), {"-a", "hier", "-n", "2", "-w", "1", "-c", "1"});
    ProcResult res = mpirun(bed, {2, 2}, collbench(args), kEnv);
    INFO(fmt::format("{}", fmt::join(args, " ")) << ": " << res.describe());
    REQUIRE(res.ok());
    // The fabric saw two hosts with two ranks each, and same-host ranks reach each other by shm.
    CHECK_THAT(res.output, Catch::Contains("# layout: 2 hosts x 2 ranks"));
    CHECK_THAT(res.output, Catch::Contains("on eth0 + shm to 1 rank(s) on this host"));
    auto table = rows(res.output);
    CHECK(table.size() == run.expected_rows);
    for (const Row& r : table) {
      INFO(r.bytes << " B");
      CHECK(r.algo == "hier");
      CHECK(r.wrong == "0");
    }
  }
}

TEST_CASE("across 2 test-bed hosts x 2 ranks the cost model chooses hier and its results are correct",
          "[multihost][shared]") {
  Bed bed(2);
  ProcResult res = mpirun(
      bed, {2, 2}, collbench({"-b", "8", "-e", "1M", "-f", "8", "-n", "2", "-w", "1", "-c", "1"}), kEnv);
  INFO(res.describe());
  REQUIRE(res.ok());
  CHECK_THAT(res.output, Catch::Contains("# layout: 2 hosts x 2 ranks"));
  CHECK_THAT(res.output, Catch::Contains("# cost model: hier from 8 B"));
  auto table = rows(res.output);
  CHECK(table.size() == sizes(8, 1 << 20, 8));
  for (const Row& r : table) {
    INFO(r.bytes << " B");
    CHECK(r.algo == "hier");  // the default table models hier fastest up to 8 MiB on this layout
    CHECK(r.wrong == "0");
  }
}

TEST_CASE("hier forced on test-bed hosts with 2 and 1 ranks is one usage error, and auto runs flat there",
          "[multihost][shared]") {
  Bed bed(2);
  auto env = kEnv;
  env["TRN_ALGO"] = "hier";
  ProcResult forced = mpirun(bed, {2, 1}, collbench({"-b", "1K", "-e", "1K", "-n", "1", "-w", "0"}), env);
  INFO(forced.describe());
  CHECK(forced.exit_code != 0);
  CHECK_THAT(forced.output,
             Catch::Contains("trn-collbench: error: all-reduce algorithm hier: communicator 0 has 3 "
                             "ranks on 2 hosts (2 + 1), but the hierarchical all-reduce needs the same "
                             "number of ranks on every host (use ring, tree, rhd or auto)"));
  ProcResult autos = mpirun(
      bed, {2, 1}, collbench({"-b", "8", "-e", "1M", "-f", "32", "-n", "2", "-w", "1", "-c", "1"}), kEnv);
  INFO(autos.describe());
  REQUIRE(autos.ok());
  CHECK_THAT(autos.output, Catch::Contains("# layout: 3 ranks on 2 hosts (2 + 1)"));
  auto table = rows(autos.output);
  CHECK(table.size() == sizes(8, 1 << 20, 32));
  for (const Row& r : table) {
    CHECK(r.algo != "hier");
    CHECK(r.wrong == "0");
  }
}

TEST_CASE("a test bed with 2 rails: an interface per rail on a switch of its own, each capped, and trn runs over rail 1 alone",
          "[rails]") {
  Bed bed(2, 2, "200mbit");
  for (int k = 0; k < 2; ++k) {
    auto ifs = run_all({ProcSpec{bed.in(k, {"ip", "-br", "addr"}), {}}}, 30s).at(0);
    INFO(ifs.describe());
    REQUIRE(ifs.ok());
    CHECK_THAT(ifs.output, Catch::Contains(bed.addr(k, 0) + "/24") && Catch::Contains(bed.addr(k, 1) + "/24"));
    CHECK(bed.addr(k, 0) != bed.addr(k, 1));
    // Each rail link is shaped both ways: the host's interface and its switch port.
    for (const char* dev : {"eth0", "eth1"}) {
      auto tc = run_all({ProcSpec{bed.in(k, {"tc", "qdisc", "show", "dev", dev}), {}}}, 30s).at(0);
      INFO(tc.describe());
      CHECK_THAT(tc.output, Catch::Contains("tbf") && Catch::Contains("rate 200Mbit"));
    }
    for (const std::string& port : {fmt::format("h{}", k), fmt::format("h{}r1", k)}) {
      auto tc = run_all({ProcSpec{{"tc", "-n", bed.name() + "-sw", "qdisc", "show", "dev", port}, {}}}, 30s).at(0);
      INFO(tc.describe());
      CHECK_THAT(tc.output, Catch::Contains("tbf") && Catch::Contains("rate 200Mbit"));
    }
  }
  // libfabric's tcp provider lists a domain per rail, so a rank can open an endpoint on each.
  auto domains = run_all({ProcSpec{bed.in(0, {"fi_info", "-p", "tcp"}), {}}}, 30s).at(0);
  INFO(domains.describe());
  CHECK_THAT(domains.output, Catch::Contains("domain: eth0") && Catch::Contains("domain: eth1"));
  // Every collective across the hosts over rail 1 alone is correct.
  auto env = kEnv;
  env["TRN_FABRIC_IFACE"] = "eth1";
  env["TRN_LOG_LEVEL"] = "info";
  env["TRN_LOG_SUBSYS"] = "fabric";
  auto r = mpirun(bed, {1, 1}, collbench({"-c", "1", "-b", "8", "-e", "1M", "-f", "16"}), env);
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK_THAT(r.output, Catch::Contains("tcp;ofi_rxm on eth1"));
  const auto rs = rows(r.output);
  CHECK(rs.size() == sizes(8, 1 << 20, 16));
  for (const auto& row : rs) CHECK(row.wrong == "0");
}

TEST_CASE("2 test-bed hosts x 2 ranks with 2 rails each: messages to the other host spread over both, large "
          "ones stripe, every collective is correct, and the rails carry equal shares",
          "[rails]") {
  Bed bed(2, 2, "400mbit");
  auto env = kEnv;
  env["TRN_FABRIC_RAILS"] = "eth0,eth1";
  env["TRN_LOG_LEVEL"] = "info";
  env["TRN_LOG_SUBSYS"] = "fabric";
  // Every collective and sizes on both sides of the striping threshold (256 KiB), flat and
  // hierarchical, checked element by element.
  for (const char* op : {"allreduce", "reducescatter", "allgather", "broadcast", "alltoall"}) {
    auto r = mpirun(bed, {2, 2}, collbench({"-o", op, "-c", "1", "-b", "8", "-e", "4M", "-f", "8", "-n", "2", "-w", "1"}),
                    env);
    INFO(op << ": " << r.describe());
    REQUIRE(r.ok());
    CHECK_THAT(r.output, Catch::Contains("2 rails eth0+eth1") && Catch::Contains("striped over all"));
    // Each host's two ranks take a rail each as their own (for same-host messages off shm), and
    // both spread their messages to the other host over both rails.
    CHECK_THAT(r.output, Catch::Contains("own rail eth0") && Catch::Contains("own rail eth1"));
    CHECK_THAT(r.output, Catch::Contains("spread over eth0+eth1 by tag"));
    const auto rs = rows(r.output);
    CHECK(rs.size() == sizes(8, 4 << 20, 8));
    for (const auto& row : rs) CHECK(row.wrong == "0");
  }
  for (const char* algo : {"ring", "hier"}) {
    auto r = mpirun(bed, {2, 2}, collbench({"-a", algo, "-c", "1", "-b", "3", "-e", "9M", "-f", "7", "-n", "2", "-w", "1"}),
                    env);
    INFO(algo << ": " << r.describe());
    REQUIRE(r.ok());
    for (const auto& row : rows(r.output)) CHECK(row.wrong == "0");
  }
  // Large all-reduces alone: each host's rails carry within 20% of each other's bytes, with the
  // default chunk and with chunks below the striping threshold (spread by tag, not striped).
  for (const char* chunk : {"", "131072"}) {
    uint64_t before[2][2];
    for (int k = 0; k < 2; ++k)
      for (int rail = 0; rail < 2; ++rail) before[k][rail] = bed.tx_bytes(k, fmt::format("eth{}", rail));
    std::vector<std::string> args = {"-b", "16M", "-e", "16M", "-n", "4", "-w", "1"};
    if (*chunk) args.insert(args.end(), {"--chunk", chunk});
    auto r = mpirun(bed, {2, 2}, collbench(args), env);
    INFO("chunk " << (*chunk ? chunk : "default") << ": " << r.describe());
    REQUIRE(r.ok());
    CHECK_THAT(r.output, Catch::Contains("spread over eth0+eth1 by tag"));
    for (int k = 0; k < 2; ++k) {
      const double a = double(bed.tx_bytes(k, "eth0") - before[k][0]);
      const double b = double(bed.tx_bytes(k, "eth1") - before[k][1]);
      INFO("host " << k << ": eth0 " << a << " B, eth1 " << b << " B");
      CHECK(a > 16e6);
      CHECK(std::abs(a - b) <= 0.2 * std::max(a, b));
    }
  }
}
