// Jobs across hosts of a test bed (tests/multihost/bed.h): an external trn-coordinator in host 0,
// one trnrun per worker host, or mpirun with an rsh agent that enters the hosts. Whatever the
// layout and however it spans hosts, the per-step losses equal one process's; a host that dies
// or is cut off ends the job with an error naming it, or, with restarts and an elastic node
// range, the job resumes from its last checkpoint on the hosts that remain.
#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <map>
#include <memory>
#include <regex>
#include <thread>

#include "tests/multihost/bed.h"
#include "tests/support/jobs.h"
#include "tests/support/process.h"

using namespace trn::test;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

// tiny with 8 heads (tp up to 8), at the learning rate the layout tests use: layouts then differ
// from one process only by rounding, far below 1e-5 of the loss (tests/integration/parallel).
std::vector<std::string> train_args(int steps, int batch, int seq = 32) {
  return {bin("trn-train"),
          "--model",
          "tiny",
          "--n-head",
          "8",
          "--steps",
          std::to_string(steps),
          "--batch-size",
          std::to_string(batch),
          "--seq-len",
          std::to_string(seq),
          "--log-every",
          "10",
          "--bucket-mb",
          "0.25",
          "--lr",
          "1e-4"};
}

std::vector<std::string> plus(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

bool exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

// step -> loss of a --metrics-jsonl file; a resumed run appends, and its lines win.
std::map<int, double> step_losses(const std::string& jsonl) {
  std::ifstream f(jsonl);
  std::map<int, double> out;
  std::string line;
  const std::regex re("\"step\": ([0-9]+), \"loss\": ([-0-9.eE+]+)");
  while (std::getline(f, line)) {
    std::smatch m;
    if (std::regex_search(line, m, re)) out[std::stoi(m[1])] = std::stod(m[2]);
  }
  return out;
}

// One process on the same arguments: the losses every layout must reproduce.
std::map<int, double> one_process(int steps, int batch, int seq = 32) {
  static std::map<std::tuple<int, int, int>, std::map<int, double>> cache;
  auto key = std::make_tuple(steps, batch, seq);
  if (cache.count(key)) return cache[key];
  TempDir dir;
  auto r =
      run_all(
          {ProcSpec{plus(train_args(steps, batch, seq), {"--metrics-jsonl", dir.path() + "/one.jsonl"}), {}}},
          300s)
          .at(0);
  INFO(r.describe());
  REQUIRE(r.ok());
  return cache[key] = step_losses(dir.path() + "/one.jsonl");
}

// The same one-process run, started in the background: a test that spends most of its time
// waiting out a fault's timeouts (the cores idle) computes its reference meanwhile. Start it
// once the fault is made: before, the cluster's ranks must keep their pace to the checkpoint.
class OneProcessMeanwhile {
 public:
  OneProcessMeanwhile(int steps, int batch, int seq)
      : jsonl_(dir_.path() + "/one.jsonl"),
        run_(ProcSpec{plus(train_args(steps, batch, seq), {"--metrics-jsonl", jsonl_}), {}}) {}
  std::map<int, double> losses() {
    auto r = run_.wait(Clock::now() + 300s);
    INFO(r.describe());
    REQUIRE(r.ok());
    return step_losses(jsonl_);
  }

 private:
  TempDir dir_;
  std::string jsonl_;
  Process run_;
};

void check_losses(const std::map<int, double>& one, const std::map<int, double>& got) {
  REQUIRE(!one.empty());
  REQUIRE(got.size() == one.size());
  for (const auto& [step, loss] : one) {
    INFO("step " << step);
    REQUIRE(got.count(step));
    CHECK(std::abs(got.at(step) - loss) <= 1e-5 * std::abs(loss));
  }
}

// A bed with the coordinator in host 0 and `workers` worker hosts 1..workers.
struct Cluster {
  Bed bed;
  TempDir dir;
  std::unique_ptr<Process> coordinator;
  std::string address;

  explicit Cluster(int workers, const std::vector<std::string>& coordinator_flags = {}, int rails = 1)
      : bed(workers + 1, rails) {
    const std::string port_file = dir.path() + "/coordinator.port";
    coordinator = std::make_unique<Process>(ProcSpec{
        bed.in(0, plus({bin("trn-coordinator"), "--listen", bed.addr(0) + ":0", "--port-file", port_file},
                       coordinator_flags)),
        {}});
    const auto until = Clock::now() + 30s;
    while (!exists(port_file) && Clock::now() < until && coordinator->running())
      std::this_thread::sleep_for(20ms);
    INFO(coordinator->output_so_far());
    REQUIRE(exists(port_file));
    address = bed.addr(0) + ":" + file_bytes(port_file);
    while (!address.empty() && (address.back() == '\n' || address.back() == ' ')) address.pop_back();
  }

  // trnrun on worker host k (1-based) for job `job`; its workers inherit env.
  std::unique_ptr<Process> trnrun(int k, const std::string& job, const std::vector<std::string>& opts,
                                  const std::vector<std::string>& program,
                                  const std::map<std::string, std::string>& env = {}) {
    auto argv = plus({bin("trnrun"), "--coordinator", address, "--job-id", job}, opts);
    argv.push_back("--");
    return std::make_unique<Process>(ProcSpec{bed.in(k, plus(argv, program)), env});
  }
};

// Waits at most 120 s for pred to hold on the nodes' output so far, which it leaves in *seen.
bool wait_for_output(std::vector<std::unique_ptr<Process>>& nodes, std::string* seen,
                     const std::function<bool(const std::string&)>& pred) {
  const auto until = Clock::now() + 120s;
  while (Clock::now() < until) {
    seen->clear();
    for (auto& n : nodes) *seen += n->output_so_far();
    if (pred(*seen)) return true;
    std::this_thread::sleep_for(50ms);
  }
  return false;
}

std::vector<ProcResult> wait_all(std::vector<std::unique_ptr<Process>>& procs, std::chrono::seconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::vector<ProcResult> out;
  for (auto& p : procs) out.push_back(p->wait(deadline));
  return out;
}

// Every rank's "fabric up" line: it reaches exactly its host mates over shared memory, and every
// other rank over the network through `provider` (with `registered`: every buffer registered).
void check_paths(const std::string& output, int ranks_per_host, const std::string& provider = "tcp;ofi_rxm",
                 bool registered = false) {
  const std::regex up("fabric up: rank [0-9]+/[0-9]+ " + provider + " on eth0" +
                      (registered ? " \\(buffers registered\\)" : "") + "( \\+ shm to ([0-9]+) rank)?");
  int lines = 0;
  for (auto it = std::sregex_iterator(output.begin(), output.end(), up); it != std::sregex_iterator(); ++it) {
    ++lines;
    const int shm = (*it)[2].matched ? std::stoi((*it)[2]) : 0;
    INFO((*it)[0]);
    CHECK(shm == ranks_per_host - 1);
  }
  CHECK(lines > 0);
}

// udp;ofi_rxd between hosts (reliable messages over datagrams, as EFA's RDM is over SRD) with every
// buffer registered, as EFA requires.
const std::map<std::string, std::string> kUdp = {{"TRN_FABRIC_PROVIDER", "udp"}, {"TRN_FABRIC_MR_LOCAL", "1"}};

// A job of `hosts` trnrun nodes x `per_host` ranks, against one process.
void check_trnrun_layout(int hosts, int per_host, const std::vector<std::string>& layout,
                         const std::map<std::string, std::string>& env = {}) {
  const int steps = 30, batch = 8;
  Cluster c(hosts);
  const std::string jsonl = c.dir.path() + "/job.jsonl";
  std::vector<std::unique_ptr<Process>> nodes;
  for (int k = 1; k <= hosts; ++k)
    nodes.push_back(c.trnrun(k, "layout",
                             {"--nnodes", std::to_string(hosts), "--nproc-per-node", std::to_string(per_host),
                              "--node-rank", std::to_string(k - 1)},
                             plus(plus(train_args(steps, batch), layout), {"--metrics-jsonl", jsonl}), env));
  auto results = wait_all(nodes, 300s);
  std::string all;
  for (auto& r : results) {
    INFO(r.describe());
    CHECK(r.ok());
    all += r.output;
  }
  if (env.count("TRN_FABRIC_PROVIDER"))
    check_paths(all, per_host, "udp;ofi_rxd", true);
  else
    check_paths(all, per_host);
  check_losses(one_process(steps, batch), step_losses(jsonl));
}

}  // namespace

TEST_CASE("data parallelism across 2 hosts of 2 ranks trains as one process does", "[shared]") {
  check_trnrun_layout(2, 2, {"--dp", "4"});
}

TEST_CASE("data parallelism across 4 hosts trains as one process does", "[shared]") { check_trnrun_layout(4, 1, {}); }

TEST_CASE("dp 2 x tp 2 x pp 2 across 2 hosts of 4 ranks trains as one process does", "[shared]") {
  // Ranks run tp fastest, then dp, then pp: each host holds one pipeline stage.
  check_trnrun_layout(2, 4, {"--dp", "2", "--tp", "2", "--pp", "2", "--micro-batches", "2"});
}

TEST_CASE("dp 2 x tp 2 x pp 2 across 4 hosts of 2 ranks trains as one process does", "[shared]") {
  // Each host holds one tensor-parallel pair; data and pipeline traffic cross hosts.
  check_trnrun_layout(4, 2, {"--dp", "2", "--tp", "2", "--pp", "2", "--micro-batches", "2"});
}

TEST_CASE("dp 2 x tp 2 x pp 2 across 4 hosts of 2 ranks over udp;ofi_rxd, buffers registered, trains as one process does",
          "[udp]") {
  check_trnrun_layout(4, 2, {"--dp", "2", "--tp", "2", "--pp", "2", "--micro-batches", "2"}, kUdp);
}

namespace {

// Every collective of trn-collbench -c 1 across 2 hosts x 2 ranks, between hosts over `env`'s
// provider (tcp;ofi_rxm when empty).
void check_collbench(const std::map<std::string, std::string>& env) {
  Bed bed(2);
  TempDir dir;
  auto r = run_all({ProcSpec{bed.mpirun(dir.path(), {2, 2}, {bin("trn-collbench"), "-c", "1", "-e", "1M"}, env), {}}},
                   240s)
               .at(0);
  INFO(r.describe());
  REQUIRE(r.ok());
  // Ranks started on both hosts, and each reached its host mate over shared memory.
  for (int k = 0; k < 2; ++k) CHECK(r.output.find(fmt::format("[{}:", bed.hostname(k))) != std::string::npos);
  if (env.empty())
    check_paths(r.output, 2);
  else
    check_paths(r.output, 2, "udp;ofi_rxd", true);
  // The #wrong column (the 9th; p50 and p99 follow) of every size row is 0.
  const std::regex row(
      "^ +[0-9]+ +[0-9]+ +[a-z0-9]+ +[a-z]+ +[a-z]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +([0-9]+) +[0-9.]+ +[0-9.]+$");
  int rows = 0;
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (!std::regex_match(line, m, row)) continue;
    ++rows;
    INFO(line);
    CHECK(m[1] == "0");
  }
  CHECK(rows >= 10);
}

}  // namespace

TEST_CASE("mpirun across 2 hosts: every collective of trn-collbench -c 1 is correct", "[shared]") { check_collbench({}); }

TEST_CASE("mpirun across 2 hosts over udp;ofi_rxd, buffers registered: every collective of trn-collbench -c 1 is correct",
          "[udp]") {
  check_collbench(kUdp);
}

TEST_CASE("mpirun across 2 hosts: trn-train dp 2 x tp 2 trains as one process does", "[shared]") {
  Bed bed(2);
  TempDir dir;
  const std::string jsonl = dir.path() + "/job.jsonl";
  auto r =
      run_all(
          {ProcSpec{bed.mpirun(dir.path(), {2, 2},
                               plus(train_args(30, 8), {"--dp", "2", "--tp", "2", "--metrics-jsonl", jsonl})),
                    {}}},
          300s)
          .at(0);
  INFO(r.describe());
  REQUIRE(r.ok());
  check_paths(r.output, 2);
  check_losses(one_process(30, 8), step_losses(jsonl));
}

namespace {

// Waits until `path` exists (a checkpoint's manifest, a metrics line) or the deadline passes.
bool wait_for(const std::string& path, std::chrono::seconds timeout) {
  const auto until = Clock::now() + timeout;
  while (!exists(path) && Clock::now() < until) std::this_thread::sleep_for(20ms);
  return exists(path);
}

enum class Fault { kKill, kPartition };

// Three worker hosts of one rank each train; once the checkpoint of step 10 is committed, host 3
// dies or is cut off. Without restarts the survivors fail naming it; with --max-restarts and
// --nnodes 2:3 the two that remain resume from the checkpoint and finish with one process's
// losses at every step.
void host_fault(Fault fault, bool elastic) {
  // 12 divides over 3 replicas and over 2. Steps of 128 tokens leave the job seconds of
  // training after the fault, so the fault always lands mid-run.
  const int steps = 120, batch = 12, seq = 128;
  // A silent member ends its generation after 10 s (rather than 30): the partition case waits
  // for that or for the fabric's own 10 s connection deadline, whichever comes first.
  Cluster c(3, {"--heartbeat-timeout", "10"});
  std::unique_ptr<OneProcessMeanwhile> one;
  const std::string ck = c.dir.path() + "/ckpt", jsonl = c.dir.path() + "/job.jsonl";
  ::mkdir(ck.c_str(), 0755);
  std::vector<std::string> opts = {"--nnodes", elastic ? "2:3" : "3", "--nproc-per-node", "1"};
  // The cut-off host's trnrun, its worker failed, tries to join the next generation through the
  // coordinator it cannot reach until --join-timeout: the test waits for that end too.
  if (elastic) opts = plus(opts, {"--max-restarts", "1", "--join-timeout", "10"});
  const auto program = plus(train_args(steps, batch, seq),
                            {"--metrics-jsonl", jsonl, "--checkpoint-dir", ck, "--checkpoint-every", "10"});
  std::vector<std::unique_ptr<Process>> nodes;
  for (int k = 1; k <= 3; ++k)
    nodes.push_back(c.trnrun(k, "faulty", plus(opts, {"--node-rank", std::to_string(k - 1)}), program));
  REQUIRE(wait_for(ck + "/step-00000010/manifest.json", 120s));
  if (fault == Fault::kKill)
    c.bed.kill(3);
  else
    c.bed.netem(3, "loss 100%");
  // The reference runs while the survivors wait out the fault's timeouts, not before: until the
  // checkpoint the cluster's ranks have the cores to themselves.
  if (elastic) one = std::make_unique<OneProcessMeanwhile>(steps, batch, seq);
  auto results = wait_all(nodes, 240s);
  const std::string lost = c.bed.hostname(3);
  std::string survivors;
  for (int i = 0; i < 2; ++i) {
    INFO(results[i].describe());
    CHECK_FALSE(results[i].timed_out);
    survivors += results[i].output;
    if (elastic)
      CHECK(results[i].exit_code == 0);
    else
      CHECK(results[i].exit_code != 0);
  }
  INFO(survivors);
  // The error names the lost rank's host: the fabric's "rank 2 (host H) was lost", the
  // coordinator's "rank 2 (H pid P) missed heartbeats", or, when the rank had not reported yet,
  // its node's "node 2 (H, rank 2) missed heartbeats".
  CHECK(std::regex_search(survivors,
                          std::regex(fmt::format("rank 2 \\((host )?{}[ )]|node 2 \\({}, rank 2\\)", lost, lost))));
  // The cut-off host ends too, with an error, and does not hang.
  INFO(results[2].describe());
  CHECK_FALSE(results[2].timed_out);
  if (fault == Fault::kPartition) CHECK(results[2].exit_code != 0);
  if (!elastic) return;
  std::smatch m;
  REQUIRE(std::regex_search(survivors, m, std::regex("resumed from \\S+ at step ([0-9]+)")));
  CHECK(std::stoi(m[1]) >= 10);
  CHECK(survivors.find("(dp 2, tp 1, pp 1") != std::string::npos);
  check_losses(one->losses(), step_losses(jsonl));
}

}  // namespace

TEST_CASE("a host that dies ends the job on the others with an error naming it") {
  host_fault(Fault::kKill, false);
}

TEST_CASE("a host that dies: an elastic job resumes from its checkpoint on the hosts that remain") {
  host_fault(Fault::kKill, true);
}

TEST_CASE("a host cut off by its link ends the job on the others with an error naming it") {
  host_fault(Fault::kPartition, false);
}

TEST_CASE("a host cut off by its link: an elastic job resumes from its checkpoint on the others") {
  host_fault(Fault::kPartition, true);
}

namespace {


// The pid of job `job`'s trn-train worker of rank `rank`, on whichever host it runs (0: none).
pid_t worker_pid(const std::string& job, int rank) {
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    if (file_bytes(e.path().string() + "/cmdline").find("trn-train") == std::string::npos) continue;
    const std::string env = file_bytes(e.path().string() + "/environ");
    if (env.find("TRN_JOB_ID=" + job + '\0') == std::string::npos) continue;
    if (env.find("TRN_RANK=" + std::to_string(rank) + '\0') == std::string::npos) continue;
    const std::string stat = file_bytes(e.path().string() + "/stat");
    const auto close = stat.rfind(')');
    if (close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'Z') continue;
    return pid_t(std::stol(name));
  }
  return 0;
}

}  // namespace

TEST_CASE("dp 2 x tp 2 x pp 2 over 4 hosts recovers in place from a killed worker, a hung one and a dead host") {
  const int steps = 150, batch = 8;
  const std::vector<std::string> layout = {"--dp", "2", "--tp", "2", "--pp", "2", "--micro-batches", "2"};
  const auto opts = [](int k) {
    return std::vector<std::string>{"--nnodes",        "4", "--nproc-per-node", "2", "--node-rank",
                                    std::to_string(k), "--recovery", "in-place", "--max-restarts", "3"};
  };
  // The fault-free run's weights.
  std::string clean;
  {
    Cluster c(4, {"--heartbeat-timeout", "4"});
    const std::string file = c.dir.path() + "/clean.safetensors";
    std::vector<std::unique_ptr<Process>> nodes;
    for (int k = 1; k <= 4; ++k)
      nodes.push_back(c.trnrun(k, "clean", plus(opts(k - 1), {"--recovery", "restart"}),
                               plus(plus(train_args(steps, batch), layout), {"--save", file})));
    for (auto& r : wait_all(nodes, 300s)) {
      INFO(r.describe());
      REQUIRE(r.ok());
    }
    clean = file_bytes(file);
    REQUIRE(!clean.empty());
  }
  Cluster c(4, {"--heartbeat-timeout", "4"});
  const std::string file = c.dir.path() + "/recovered.safetensors";
  const auto program = plus(plus(train_args(steps, batch), layout), {"--snapshot-every", "1", "--save", file});
  std::vector<std::unique_ptr<Process>> nodes;
  for (int k = 1; k <= 4; ++k) nodes.push_back(c.trnrun(k, "chaos", opts(k - 1), program));
  std::string seen;
  auto progress = [&] {
    seen.clear();
    for (auto& n : nodes) seen += n->output_so_far();
    return seen;
  };
  auto wait_until = [&](const std::function<bool(const std::string&)>& pred) {
    return wait_for_output(nodes, &seen, pred);
  };
  auto recovered = [&](int n) {
    return wait_until([n](const std::string& out) { return out.find(fmt::format("recovery {}:", n)) != std::string::npos; });
  };
  // 1: kill -9 of rank 3 (host 2); the others keep their processes.
  REQUIRE(wait_until([](const std::string& out) { return newest_step(out) >= 20; }));
  const pid_t kept = worker_pid("chaos", 6), killed = worker_pid("chaos", 3);
  REQUIRE(kept > 0);
  REQUIRE(killed > 0);
  ::kill(killed, SIGKILL);
  REQUIRE(recovered(1));
  CHECK(worker_pid("chaos", 6) == kept);
  CHECK(worker_pid("chaos", 3) != killed);
  // 2: rank 4 (host 3) hangs; the heartbeat timeout declares it dead and its agent replaces it.
  const int64_t at = newest_step(progress()) + 15;
  REQUIRE(wait_until([at](const std::string& out) { return newest_step(out) >= at; }));
  const pid_t hung = worker_pid("chaos", 4);
  REQUIRE(hung > 0);
  ::kill(hung, SIGSTOP);
  REQUIRE(recovered(2));
  CHECK(worker_pid("chaos", 6) == kept);
  CHECK(worker_pid("chaos", 4) != hung);
  // 3: host 4 dies with its trnrun (ranks 6 and 7); a new trnrun on it takes its place.
  const int64_t at3 = newest_step(progress()) + 15;
  REQUIRE(wait_until([at3](const std::string& out) { return newest_step(out) >= at3; }));
  const pid_t other = worker_pid("chaos", 0);
  c.bed.kill(4);
  nodes[3]->wait(Clock::now() + 30s);
  // The replacement host comes once the job has noticed the loss (before that, a running job
  // whose members all look alive refuses a new node).
  REQUIRE(wait_until([](const std::string& out) { return out.find("(restart 3 of 3)") != std::string::npos; }));
  nodes[3] = c.trnrun(4, "chaos", opts(3), program);
  const bool third = recovered(3);
  INFO(seen);
  REQUIRE(third);
  CHECK(worker_pid("chaos", 0) == other);
  auto results = wait_all(nodes, 300s);
  std::string all;
  for (auto& r : results) {
    INFO(r.describe());
    CHECK(r.ok());
    all += r.output;
  }
  INFO(all);
  CHECK(count_lines_with(all, "3 recoveries in place") == 1);
  CHECK(file_bytes(file) == clean);
}

TEST_CASE("an elastic job shrinks and grows in place, keeping its global batch and one process's losses") {
  // Hosts of one tensor-parallel pair each: the data-parallel size is the host count. 12 divides
  // over 3 replicas and over 2. The steps leave the returning host time to start and join before
  // the job ends (under load 120 were done first, and the job never grew).
  const int steps = 360, batch = 12, seq = 32;
  Cluster c(3, {"--heartbeat-timeout", "4"});
  const std::string jsonl = c.dir.path() + "/job.jsonl";
  const auto opts = [](int k) {
    return std::vector<std::string>{"--nnodes", "2:3", "--nproc-per-node", "2", "--node-rank", std::to_string(k),
                                    "--recovery", "in-place", "--max-restarts", "3", "--join-timeout", "60"};
  };
  const auto program =
      plus(train_args(steps, batch, seq), {"--tp", "2", "--snapshot-every", "1", "--metrics-jsonl", jsonl});
  std::vector<std::unique_ptr<Process>> nodes;
  for (int k = 1; k <= 3; ++k) nodes.push_back(c.trnrun(k, "elastic", opts(k - 1), program));
  std::string seen;
  auto wait_until = [&](const std::function<bool(const std::string&)>& pred) {
    return wait_for_output(nodes, &seen, pred);
  };
  REQUIRE(wait_until([](const std::string& out) { return newest_step(out) >= 20; }));
  // The middle host dies and nothing replaces it: the last host's ranks 4, 5 become 2, 3.
  const pid_t first = worker_pid("elastic", 0), last = worker_pid("elastic", 4);
  REQUIRE(first > 0);
  REQUIRE(last > 0);
  c.bed.kill(2);
  nodes[1]->wait(Clock::now() + 30s);
  REQUIRE(wait_until([](const std::string& out) { return out.find("recovery 1:") != std::string::npos; }));
  INFO(seen);
  CHECK(seen.find("data parallel 3 -> 2") != std::string::npos);
  CHECK(worker_pid("elastic", 0) == first);
  // The same process goes on renumbered (its environment still says the rank it started as).
  CHECK(::kill(last, 0) == 0);
  CHECK(seen.find("rank 4 of 6 goes on as rank 2 of 4") != std::string::npos);
  // The host comes back: the job grows again at the next step boundary.
  const int64_t at = newest_step(seen) + 15;
  REQUIRE(wait_until([at](const std::string& out) { return newest_step(out) >= at; }));
  nodes[1] = c.trnrun(2, "elastic", opts(1), program);
  REQUIRE(wait_until([](const std::string& out) { return out.find("recovery 2:") != std::string::npos; }));
  CHECK(seen.find("data parallel 2 -> 3") != std::string::npos);
  CHECK(worker_pid("elastic", 0) == first);
  auto results = wait_all(nodes, 300s);
  for (auto& r : results) {
    INFO(r.describe());
    CHECK(r.ok());
  }
  check_losses(one_process(steps, batch, seq), step_losses(jsonl));
}

TEST_CASE("a rail cut mid-job: the job recovers in place onto the other rail and trains as one process does",
          "[rails]") {
  // 2 worker hosts of one rank each, 2 rails per host; the tiny model's messages, all below the
  // striping threshold, spread over both by tag.
  const int steps = 100, batch = 8;
  Cluster c(2, {"--heartbeat-timeout", "4"}, 2);
  const std::string jsonl = c.dir.path() + "/job.jsonl";
  const std::map<std::string, std::string> env = {{"TRN_FABRIC_RAILS", "eth0,eth1"}};
  const auto opts = [](int k) {
    return std::vector<std::string>{"--nnodes", "2", "--nproc-per-node", "1", "--node-rank", std::to_string(k),
                                    "--recovery", "in-place", "--max-restarts", "2"};
  };
  const auto program = plus(train_args(steps, batch), {"--snapshot-every", "1", "--metrics-jsonl", jsonl});
  std::vector<std::unique_ptr<Process>> nodes;
  for (int k = 1; k <= 2; ++k) nodes.push_back(c.trnrun(k, "rails", opts(k - 1), program, env));
  std::string seen;
  auto wait_until = [&](const std::function<bool(const std::string&)>& pred) {
    return wait_for_output(nodes, &seen, pred);
  };
  REQUIRE(wait_until([](const std::string& out) { return newest_step(out) >= 20; }));
  CHECK_THAT(seen, Catch::Contains("2 rails eth0+eth1") && Catch::Contains("spread over eth0+eth1 by tag"));
  const pid_t first = worker_pid("rails", 0);
  REQUIRE(first > 0);
  // Every packet on host 1's rail 1 is lost, both ways, from now on.
  c.bed.netem(1, "loss 100%", 1);
  const bool recovered = wait_until([](const std::string& out) { return out.find("recovery 1:") != std::string::npos; });
  INFO(seen);
  REQUIRE(recovered);
  CHECK_THAT(seen, Catch::Contains("fabric rail 1 (eth1) is down"));
  CHECK_THAT(seen, Catch::Contains("rail(s) eth1 do not reach every host: this job runs on 1 rail(s): eth0"));
  CHECK(worker_pid("rails", 0) == first);  // in place: the same process goes on
  auto results = wait_all(nodes, 300s);
  for (auto& r : results) {
    INFO(r.describe());
    CHECK(r.ok());
  }
  check_losses(one_process(steps, batch), step_losses(jsonl));
}

TEST_CASE("2 rails: training's data-parallel, ZeRO, tensor- and pipeline-parallel traffic spreads evenly over both, "
          "and trains as one process does",
          "[rails]") {
  // 2 worker hosts of one rank each, 2 rails per host, the default striping threshold: every
  // message of these layouts is below it, so only spreading by tag puts bytes on rail 1.
  const int steps = 20, batch = 8;
  Cluster c(2, {}, 2);
  const std::map<std::string, std::string> env = {{"TRN_FABRIC_RAILS", "eth0,eth1"}};
  const std::vector<std::pair<std::string, std::vector<std::string>>> layouts = {
      {"dp", {"--dp", "2"}},
      {"zero", {"--dp", "2", "--zero", "1"}},
      {"tp", {"--tp", "2"}},
      {"pp", {"--pp", "2", "--micro-batches", "4"}}};
  for (const auto& [job, layout] : layouts) {
    INFO(job);
    uint64_t before[2][2];
    for (int k = 1; k <= 2; ++k)
      for (int rail = 0; rail < 2; ++rail) before[k - 1][rail] = c.bed.tx_bytes(k, fmt::format("eth{}", rail));
    const std::string jsonl = c.dir.path() + "/" + job + ".jsonl";
    std::vector<std::unique_ptr<Process>> nodes;
    for (int k = 1; k <= 2; ++k)
      nodes.push_back(c.trnrun(k, job, {"--nnodes", "2", "--nproc-per-node", "1", "--node-rank", std::to_string(k - 1)},
                               plus(plus(train_args(steps, batch), layout), {"--metrics-jsonl", jsonl}), env));
    std::string all;
    for (auto& r : wait_all(nodes, 300s)) {
      INFO(r.describe());
      REQUIRE(r.ok());
      all += r.output;
    }
    CHECK_THAT(all, Catch::Contains("2 rails eth0+eth1") && Catch::Contains("spread over eth0+eth1 by tag"));
    for (int k = 1; k <= 2; ++k) {
      const double a = double(c.bed.tx_bytes(k, "eth0") - before[k - 1][0]);
      const double b = double(c.bed.tx_bytes(k, "eth1") - before[k - 1][1]);
      INFO("host " << k << ": eth0 " << a << " B, eth1 " << b << " B");
      CHECK(b > 5e5);  // pp, the least: 2.6 MB of activations or gradients each way
      CHECK(std::abs(a - b) <= 0.2 * std::max(a, b));
    }
    check_losses(one_process(steps, batch), step_losses(jsonl));
  }
}

namespace {

// A bed of 5 hosts: a 3-member etcd cluster on hosts 0..2, coordinator replicas on hosts 0 (the
// leader: it starts first) and 1, and one worker host each at 3 and 4.
struct ReplicatedCluster {
  Bed bed{5};
  TempDir dir;
  std::vector<std::unique_ptr<Process>> etcd;
  std::unique_ptr<Process> leader, standby;
  std::string addresses;  // both replicas, for --coordinator

  ReplicatedCluster() {
    std::string cluster, store = "etcd://";
    for (int k = 0; k < 3; ++k) {
      cluster += fmt::format("{}e{}=http://{}:2380", k ? "," : "", k, bed.addr(k));
      store += fmt::format("{}{}:2379", k ? "," : "", bed.addr(k));
    }
    for (int k = 0; k < 3; ++k) {
      const std::string client = fmt::format("http://{}:2379", bed.addr(k)), peer = fmt::format("http://{}:2380", bed.addr(k));
      etcd.push_back(std::make_unique<Process>(ProcSpec{
          bed.in(k, {"/usr/bin/etcd", "--name", fmt::format("e{}", k), "--data-dir", fmt::format("{}/e{}", dir.path(), k),
                     "--listen-client-urls", client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
                     "--initial-advertise-peer-urls", peer, "--initial-cluster", cluster, "--initial-cluster-state",
                     "new", "--initial-cluster-token", bed.name(), "--heartbeat-interval", "50", "--election-timeout",
                     "500", "--logger", "zap", "--log-outputs", fmt::format("{}/e{}.log", dir.path(), k)}),
          {}}));
    }
    auto replica = [&](int k) {
      return std::make_unique<Process>(ProcSpec{
          bed.in(k, {bin("trn-coordinator"), "--listen", bed.addr(k) + ":7000", "--store", store, "--leader-ttl", "2",
                     "--heartbeat-timeout", "20"}),
          {}});
    };
    leader = replica(0);
    wait_output(*leader, "elected leader", 60s);
    standby = replica(1);
    wait_output(*standby, "standby until elected", 30s);
    addresses = bed.addr(0) + ":7000," + bed.addr(1) + ":7000";
  }
  static void wait_output(Process& p, const std::string& text, std::chrono::seconds within) {
    const auto until = Clock::now() + within;
    while (p.output_so_far().find(text) == std::string::npos && Clock::now() < until && p.running())
      std::this_thread::sleep_for(20ms);
    INFO(p.output_so_far());
    REQUIRE(p.output_so_far().find(text) != std::string::npos);
  }
  std::unique_ptr<Process> trnrun(int k, const std::string& job, const std::vector<std::string>& program,
                                  std::map<std::string, std::string> env = {}) {
    auto argv = plus({bin("trnrun"), "--coordinator", addresses, "--job-id", job, "--nnodes", "2", "--nproc-per-node",
                      "1", "--node-rank", std::to_string(k - 3), "--"},
                     program);
    return std::make_unique<Process>(ProcSpec{bed.in(k, argv), std::move(env)});
  }
};

}  // namespace

TEST_CASE("kill -9 of the leading coordinator: its standby takes over and dp 2 trains on without a restart") {
  const int steps = 120, batch = 12, seq = 128;
  ReplicatedCluster c;
  const std::string ck = c.dir.path() + "/ckpt", jsonl = c.dir.path() + "/job.jsonl";
  ::mkdir(ck.c_str(), 0755);
  const auto program = plus(train_args(steps, batch, seq),
                            {"--metrics-jsonl", jsonl, "--checkpoint-dir", ck, "--checkpoint-every", "10"});
  std::vector<std::unique_ptr<Process>> nodes;
  for (int k = 3; k <= 4; ++k) nodes.push_back(c.trnrun(k, "ha", program));
  REQUIRE(wait_for(ck + "/step-00000010/manifest.json", 120s));
  const pid_t r0 = worker_pid("ha", 0), r1 = worker_pid("ha", 1);
  REQUIRE(r0 > 0);
  REQUIRE(r1 > 0);

  c.leader->signal_group(SIGKILL);
  const auto killed = Clock::now();
  ReplicatedCluster::wait_output(*c.standby, "elected leader", 30s);
  const double takeover_s = std::chrono::duration<double>(Clock::now() - killed).count();
  WARN("the standby led " << takeover_s << " s after the leader was killed (lease 2 s, heartbeats every 1 s)");
  CHECK_THAT(c.standby->output_so_far(), Catch::Contains("restored 1 jobs"));
  // A checkpoint committed through the new leader, by the same two processes.
  REQUIRE(wait_for(ck + "/step-00000060/manifest.json", 120s));
  CHECK(worker_pid("ha", 0) == r0);
  CHECK(worker_pid("ha", 1) == r1);

  auto results = wait_all(nodes, 300s);
  std::string all;
  for (auto& r : results) {
    INFO(r.describe());
    CHECK(r.ok());
    all += r.output;
  }
  // One generation to the end; the checkpoints committed before the takeover are in the new
  // leader's registry with those after.
  INFO(all);
  CHECK(all.find("generation 1") == std::string::npos);
  // The reference after the job: a takeover keeps its workers' heartbeats on time, so nothing else
  // runs beside them.
  check_losses(one_process(steps, batch, seq), step_losses(jsonl));
  auto st = run_all({ProcSpec{c.bed.in(1, {bin("trnctl"), "status", "ha", "--json", "--coordinator", c.addresses}), {}}},
                    30s)
                .at(0);
  INFO(st.describe());
  CHECK_THAT(st.output, Catch::Contains("\"generation\": 0") && Catch::Contains("\"restarts\": 0") &&
                            Catch::Contains("\"state\": \"completed\"") &&
                            Catch::Contains(fmt::format("\"last_committed_step\": {}", steps)));
  auto ckpts = run_all({ProcSpec{c.bed.in(1, {bin("trnctl"), "checkpoints", "ha", "--coordinator", c.addresses}), {}}},
                       30s)
                   .at(0);
  INFO(ckpts.describe());
  CHECK_THAT(ckpts.output, Catch::Contains("step-00000010") && Catch::Contains(fmt::format("step-{:08}", steps)));
}

TEST_CASE("two of three etcd members lost: the coordinators stop accepting writes and the job fails saying so") {
  ReplicatedCluster c;
  const std::string ck = c.dir.path() + "/ckpt";
  ::mkdir(ck.c_str(), 0755);
  // Long enough to be running when etcd goes; TRN_TIMEOUT bounds how long the agents wait for a
  // coordinator that answers (10 s: more than the 6 s, 3 lease TTLs, the leader takes to stop
  // accepting writes, so the agents meet its refusal, which names the lost quorum).
  const auto program = plus(train_args(100000, 12, 128), {"--checkpoint-dir", ck, "--checkpoint-every", "10"});
  std::vector<std::unique_ptr<Process>> nodes;
  for (int k = 3; k <= 4; ++k) nodes.push_back(c.trnrun(k, "quorum", program, {{"TRN_TIMEOUT", "10"}}));
  REQUIRE(wait_for(ck + "/step-00000010/manifest.json", 120s));
  c.etcd[2]->signal_group(SIGKILL);  // one member: nothing changes
  std::this_thread::sleep_for(5s);
  CHECK_THAT(c.leader->output_so_far(), !Catch::Contains("stopped accepting writes"));
  c.etcd[1]->signal_group(SIGKILL);  // two: no quorum
  ReplicatedCluster::wait_output(*c.leader, "stopped accepting writes", 30s);
  auto results = wait_all(nodes, 120s);
  for (auto& r : results) {
    INFO(r.describe());
    CHECK_FALSE(r.timed_out);
    CHECK(r.exit_code != 0);
    CHECK_THAT(r.output, Catch::Contains("quorum"));  // "lost quorum", or "may have lost quorum"
  }
}
