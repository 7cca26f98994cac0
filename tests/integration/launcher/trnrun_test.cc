// trnrun end to end: the real program, its embedded trn-coordinator, and real worker processes.
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "launcher/agent/binding.h"
#include "tests/integration/launcher/launcher_children.h"

using namespace trn::test;
using namespace trn::test::launch;
using namespace std::chrono_literals;

namespace {

ProcResult run_trnrun(const std::vector<std::string>& argv, std::chrono::seconds timeout = 60s,
                      std::map<std::string, std::string> env = {}) {
  auto results = run_all({ProcSpec{argv, std::move(env)}}, timeout);
  return results.at(0);
}

// Waits until output holds `count` matches of pattern (or the deadline passes).
bool wait_for_output(Process& p, const std::string& pattern, size_t count, std::chrono::seconds timeout) {
  std::regex re(pattern);
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    const std::string& out = p.output_so_far();
    if (static_cast<size_t>(std::distance(std::sregex_iterator(out.begin(), out.end(), re), std::sregex_iterator())) >=
        count)
      return true;
    if (!p.running()) return false;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

void check_env(const ProcResult& r, int nproc) {
  INFO(r.describe());
  REQUIRE(r.ok());
  auto reports = env_reports(r.output);
  REQUIRE(reports.size() == static_cast<size_t>(nproc));
  std::string job = reports.at(0).at("job_id");
  CHECK(job.rfind("trn-", 0) == 0);
  for (int rank = 0; rank < nproc; ++rank) {
    auto& env = reports.at(rank);
    CHECK(env.at("rank") == std::to_string(rank));
    CHECK(env.at("local_rank") == std::to_string(rank));
    CHECK(env.at("world_size") == std::to_string(nproc));
    CHECK(env.at("local_world_size") == std::to_string(nproc));
    CHECK(env.at("node_rank") == "0");
    CHECK(env.at("generation") == "0");
    CHECK(env.at("job_id") == job);
    CHECK(std::regex_match(env.at("coordinator"), std::regex(R"(127\.0\.0\.1:\d+)")));
    CHECK(env.at("token_file") == "-");
  }
}

}  // namespace

TEST_CASE("trnrun gives 2 and 3 workers their ranks and the job's environment") {
  check_env(run_trnrun(trnrun_argv({"--nproc-per-node", "2"}, "env_report")), 2);
  check_env(run_trnrun(trnrun_argv({"--nproc-per-node=3"}, "env_report")), 3);
}

TEST_CASE("trnrun prefixes every worker line with its rank and never splits a line") {
  const int kLines = 300;
  auto r = run_trnrun(trnrun_argv({"--nproc-per-node", "3"}, "chatter", {std::to_string(kLines)}));
  INFO(r.describe());
  REQUIRE(r.ok());
  std::map<int, int> lines;
  std::istringstream in(r.output);
  std::string line;
  std::regex worker_line(R"(^\[rank (\d)\] (chatter (\d) line \d+ end|unterminated)$)");
  while (std::getline(in, line)) {
    if (line.find("chatter") == std::string::npos && line.find("unterminated") == std::string::npos) continue;
    std::smatch m;
    INFO(line);
    REQUIRE(std::regex_match(line, m, worker_line));
    if (m[3].matched) CHECK(m[1].str() == m[3].str());
    ++lines[std::stoi(m[1].str())];
  }
  for (int rank = 0; rank < 3; ++rank) CHECK(lines[rank] == kLines + 1);
}

TEST_CASE("trnrun writes one log file per rank and generation with --log-dir, and the console with --tee") {
  TempDir dir;
  auto quiet = run_trnrun(trnrun_argv({"--nproc-per-node", "2", "--log-dir", dir.path()}, "env_report"));
  INFO(quiet.describe());
  REQUIRE(quiet.ok());
  CHECK(env_reports(quiet.output).empty());
  for (int rank = 0; rank < 2; ++rank) {
    std::ifstream log(dir.path() + "/rank" + std::to_string(rank) + ".gen0.log");
    std::string line;
    REQUIRE(std::getline(log, line));
    CHECK(line.rfind("rank=" + std::to_string(rank) + " ", 0) == 0);
  }
  auto tee = run_trnrun(trnrun_argv({"--nproc-per-node", "2", "--log-dir", dir.path(), "--tee"}, "env_report"));
  REQUIRE(tee.ok());
  CHECK(env_reports(tee.output).size() == 2);
  // The embedded coordinator's output is there too; nothing is left half-written.
  CHECK(std::filesystem::exists(dir.path() + "/coordinator.log"));
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    INFO(entry.path());
    CHECK(entry.path().extension() != ".partial");
  }
}

TEST_CASE(
    "trnrun --token-file: trnrun authenticates to its embedded coordinator; workers get their job's token") {
  TempDir dir;
  std::string token = dir.path() + "/token";
  std::ofstream(token) << "s3cret-token\n";
  auto r = run_trnrun(trnrun_argv({"--nproc-per-node", "2", "--token-file", token}, "token_worker",
                                  {token, "some-other-job"}));
  INFO(r.describe());
  REQUIRE(r.ok());
  for (int rank = 0; rank < 2; ++rank)
    CHECK(r.output.find(fmt::format("[rank {}] rank={} tls_ca=- tls_cert=- token=job store=here barrier=ok "
                                    "other_job=denied",
                                    rank, rank)) != std::string::npos);
  auto env = run_trnrun(trnrun_argv({"--token-file", token}, "env_report"));
  REQUIRE(env.ok());
  const std::string file = env_reports(env.output).at(0).at("token_file");
  CHECK(file != token);
  CHECK(std::filesystem::path(file).filename() == "job-token");
  CHECK_FALSE(std::filesystem::exists(file));  // removed with trnrun's private folder
}

TEST_CASE("trnrun with --max-restarts 0: a failing worker ends the job with its exit code, naming the rank") {
  auto r = run_trnrun(trnrun_argv({"--nproc-per-node", "2", "--grace-period", "5"}, "fail_rank", {"1", "3", "99"}));
  INFO(r.describe());
  CHECK(r.exit_code == 3);
  CHECK(std::regex_search(r.output, std::regex(R"(trnrun: rank 1 \(local rank 1, pid \d+\) exited with code 3 in generation 0; no restarts left \(--max-restarts 0\))")));
  // Rank 0 was stopped, not left behind.
  for (pid_t pid : numbers_after(r.output, "pid")) CHECK(gone(pid));
}

TEST_CASE("trnrun restarts the worker group in a new generation while restarts remain") {
  auto r = run_trnrun(trnrun_argv({"--nproc-per-node", "2", "--max-restarts", "3"}, "fail_rank", {"1", "5", "2"}));
  INFO(r.describe());
  CHECK(r.exit_code == 0);
  // Rank 1 ran (and failed) in generations 0 and 1; both ranks ran in generation 2. (Rank 0 may be
  // stopped before it prints anything in a generation that rank 1 ends at once.)
  for (int generation = 0; generation <= 2; ++generation)
    CHECK(r.output.find(fmt::format("[rank 1] rank=1 generation={} ", generation)) != std::string::npos);
  CHECK(r.output.find("[rank 0] rank=0 generation=2 ") != std::string::npos);
  CHECK(r.output.find("generation=3") == std::string::npos);
  CHECK(std::regex_search(r.output, std::regex("restart 2 of 3")));
}

TEST_CASE("trnrun reports a worker killed by a signal") {
  auto k = run_trnrun({bin("trnrun"), "--", "/bin/sh", "-c", "kill -KILL $$"});
  INFO(k.describe());
  CHECK(k.exit_code == 128 + SIGKILL);
  CHECK(k.output.find("trnrun: rank 0 (local rank 0, pid") != std::string::npos);
  CHECK(k.output.find("was killed by signal 9 (SIGKILL)") != std::string::npos);
}

TEST_CASE("Ctrl-C on trnrun stops every worker, its children and the coordinator, and leaves nothing behind") {
  for (bool stubborn : {false, true}) {
    DYNAMIC_SECTION((stubborn ? "workers that ignore SIGINT are killed after the grace period" : "workers stop")) {
      Process p(ProcSpec{trnrun_argv({"--nproc-per-node", "2", "--grace-period", "1"}, "sleeper",
                                     {stubborn ? "stubborn" : "polite"}),
                         {{"TRN_LOG_LEVEL", "debug"}}});
      REQUIRE(wait_for_output(p, R"(ready pid=\d+ grandchild=\d+)", 2, 30s));
      p.signal(SIGINT);
      auto r = p.wait(std::chrono::steady_clock::now() + 30s);
      INFO(r.describe());
      CHECK_FALSE(r.timed_out);
      CHECK(r.exit_code == 128 + SIGINT);
      CHECK(r.output.find("trnrun: interrupted by SIGINT; stopped 2 workers") != std::string::npos);
      auto pids = numbers_after(r.output, "pid");
      auto grandchildren = numbers_after(r.output, "grandchild");
      pids.insert(pids.end(), grandchildren.begin(), grandchildren.end());
      REQUIRE(pids.size() == 4);  // 2 workers, 2 grandchildren
      std::smatch m;
      REQUIRE(std::regex_search(r.output, m, std::regex(R"(embedded coordinator \(pid (\d+)\))")));
      pids.push_back(static_cast<pid_t>(std::stol(m[1].str())));
      for (pid_t pid : pids) {
        INFO("pid " << pid);
        CHECK(gone(pid));
      }
    }
  }
}

TEST_CASE("kill -9 of trnrun takes its workers and the embedded coordinator with it") {
  Process p(ProcSpec{trnrun_argv({"--nproc-per-node", "2"}, "sleeper", {"polite"}), {}});
  REQUIRE(wait_for_output(p, R"(ready pid=\d+ grandchild=\d+)", 2, 30s));
  p.signal(SIGKILL);
  auto r = p.wait(std::chrono::steady_clock::now() + 30s);
  INFO(r.describe());
  CHECK(r.signal == SIGKILL);
  auto pids = numbers_after(r.output, "pid");
  REQUIRE(pids.size() == 2);
  std::smatch m;
  REQUIRE(std::regex_search(r.output, m, std::regex(R"(embedded coordinator \(pid (\d+)\))")));
  pids.push_back(static_cast<pid_t>(std::stol(m[1].str())));
  // They die asynchronously (parent-death signal): allow them a moment.
  auto deadline = std::chrono::steady_clock::now() + 10s;
  for (pid_t pid : pids) {
    while (!gone(pid) && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(10ms);
    INFO("pid " << pid);
    CHECK(gone(pid));
  }
  // The workers' own children are outside trnrun's reach once it is SIGKILLed; clean them up.
  for (pid_t pid : numbers_after(r.output, "grandchild")) ::kill(pid, SIGKILL);
}

TEST_CASE("trnrun --dry-run prints the plan and starts nothing") {
  TempDir dir;
  std::string marker = dir.path() + "/ran";
  auto r = run_trnrun(trnrun_argv({"--dry-run", "--nproc-per-node", "2", "--max-restarts", "1"}, "touch", {marker}));
  INFO(r.describe());
  CHECK(r.ok());
  CHECK(r.output.find("nothing started") != std::string::npos);
  CHECK(r.output.find("ranks 0..1 of world size 2") != std::string::npos);
  CHECK(r.output.find("rank 1: TRN_COORDINATOR=127.0.0.1:PORT") != std::string::npos);
  CHECK(r.output.find("--trn-child touch") != std::string::npos);
  CHECK(r.output.find("started embedded coordinator") == std::string::npos);
  CHECK_FALSE(std::filesystem::exists(marker));
}

TEST_CASE("trnrun rejects bad input with one line and exit 2") {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  std::vector<Case> cases = {
      {{"--nproc-per-node", "0", "true"}, "trnrun: error: --nproc-per-node 0: must be at least 1"},
      {{"--nproc-per-node", "2"}, "trnrun: error: no program to run"},
      {{"--bogus", "true"}, "trnrun: error: unknown option --bogus"},
      {{"no-such-program-trn"}, "trnrun: error: program no-such-program-trn not found on PATH"},
      {{"--nnodes", "2", "true"}, "trnrun: error: 2 nodes need --coordinator HOST:PORT"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv = {bin("trnrun")};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    auto r = run_trnrun(argv, 30s);
    INFO(r.describe());
    CHECK(r.exit_code == 2);
    CHECK(r.output.rfind(c.message, 0) == 0);
    CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
  }
}

TEST_CASE("a worker's usage error (exit 2) is not restarted: trnrun exits 2 at once, saying why") {
  auto r = run_trnrun(trnrun_argv({"--nproc-per-node", "2", "--max-restarts", "3", "--grace-period", "5"}, "fail_rank",
                                  {"1", "2", "99"}));
  INFO(r.describe());
  CHECK(r.exit_code == 2);
  CHECK(std::regex_search(r.output, std::regex(R"(trnrun: rank 1 \(local rank 1, pid \d+\) exited with code 2 in generation 0: a usage error, so the workers are not restarted)")));
  CHECK(r.output.find("generation=1") == std::string::npos);  // no restart happened
  CHECK(r.output.find("restarting") == std::string::npos);
}

TEST_CASE("a program that cannot be executed is a usage error: exit 2 at once, no restart, one line saying why") {
  TempDir dir;
  struct Case {
    std::string name, bytes, why;
  };
  for (const auto& c : std::vector<Case>{{"notes.txt", "just some text\n", "Exec format error (ENOEXEC)"},
                                         {"script", "#!/no/such/interpreter\n", "No such file or directory (ENOENT)"}}) {
    const std::string program = dir.path() + "/" + c.name;
    std::ofstream(program) << c.bytes;
    std::filesystem::permissions(program, std::filesystem::perms::owner_all);
    auto r = run_trnrun({bin("trnrun"), "--nproc-per-node", "2", "--max-restarts", "3", "--", program}, 60s);
    INFO(r.describe());
    CHECK(r.exit_code == 2);
    const std::string line = fmt::format("trnrun: program {} cannot be executed: {}", program, c.why);
    CHECK(r.output.find(line) != std::string::npos);
    CHECK(r.output.find("cannot be executed") == r.output.rfind("cannot be executed"));  // said once
    CHECK(r.output.find("restarting") == std::string::npos);
    CHECK(r.output.find("generation 1") == std::string::npos);
  }
}

TEST_CASE("what a SIGKILLed trnrun left in TMPDIR is removed by the next trnrun") {
  TempDir tmp;
  std::map<std::string, std::string> env = {{"TMPDIR", tmp.path()}};
  Process p(ProcSpec{trnrun_argv({"--nproc-per-node", "1"}, "sleeper", {"polite"}), env});
  REQUIRE(wait_for_output(p, R"(ready pid=\d+ grandchild=\d+)", 1, 30s));
  auto left = [&] {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(tmp.path()))
      if (e.path().filename().string().rfind("trnrun-", 0) == 0) names.push_back(e.path().filename().string());
    return names;
  };
  REQUIRE(left().size() == 1);
  CHECK(left()[0].rfind(fmt::format("trnrun-{}-", p.pid()), 0) == 0);  // named after its owner
  p.signal(SIGKILL);
  auto killed = p.wait(std::chrono::steady_clock::now() + 30s);
  for (pid_t pid : numbers_after(killed.output, "grandchild")) ::kill(pid, SIGKILL);
  CHECK(left().size() == 1);  // a SIGKILLed process cleans up nothing itself
  // A folder of a trnrun that still runs is left alone.
  std::string live = tmp.path() + fmt::format("/trnrun-{}-abcdef", getpid());
  std::filesystem::create_directory(live);
  auto next = run_trnrun({bin("trnrun"), "--", "/bin/true"}, 60s, env);
  INFO(next.describe());
  CHECK(next.ok());
  auto now = left();
  REQUIRE(now.size() == 1);
  CHECK(now[0] == fmt::format("trnrun-{}-abcdef", getpid()));
}

TEST_CASE("trnrun's bad paths are one line and exit 2") {
  TempDir dir;
  std::ofstream(dir.path() + "/file") << "x";
  std::filesystem::create_directory(dir.path() + "/folder");
  for (const auto& [args, needle] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--token-file", dir.path() + "/folder", "true"}, "--token-file"},
           {{"--token-file", dir.path() + "/missing", "true"}, "--token-file"},
           {{"--log-dir", dir.path() + "/file", "true"}, "--log-dir"},
           {{"--log-dir", dir.path() + "/file/sub", "true"}, "--log-dir"},
       }) {
    std::vector<std::string> argv = {bin("trnrun")};
    argv.insert(argv.end(), args.begin(), args.end());
    auto r = run_trnrun(argv, 30s);
    INFO(r.describe());
    CHECK(r.exit_code == 2);
    CHECK(r.output.rfind("trnrun: error: " + needle, 0) == 0);
    CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
  }
}

namespace {

std::set<int> parse_cpus(const std::string& list) {
  std::set<int> cpus;
  std::istringstream in(list);
  std::string c;
  while (std::getline(in, c, ',')) cpus.insert(std::stoi(c));
  return cpus;
}

// Each rank's CPUs as the cpus_report child found them.
std::vector<std::set<int>> worker_cpus(const ProcResult& r, int nproc) {
  INFO(r.describe());
  REQUIRE(r.ok());
  auto reports = env_reports(r.output);
  REQUIRE(reports.size() == static_cast<size_t>(nproc));
  std::vector<std::set<int>> out;
  for (int rank = 0; rank < nproc; ++rank) out.push_back(parse_cpus(reports.at(rank).at("cpus")));
  return out;
}

// Narrows this thread's CPUs (which the processes it starts inherit) for the object's lifetime.
struct PinnedTo {
  explicit PinnedTo(const std::vector<int>& cpus) : saved(trn::launch::allowed_cpus()) { set(cpus); }
  ~PinnedTo() { set(saved); }
  static void set(const std::vector<int>& cpus) {
    cpu_set_t s;
    CPU_ZERO(&s);
    for (int c : cpus) CPU_SET(c, &s);
    REQUIRE(sched_setaffinity(0, sizeof s, &s) == 0);
  }
  std::vector<int> saved;
};

}  // namespace

TEST_CASE("trnrun binds its workers to disjoint shares of its own cpus, unless --bind none") {
  const std::vector<int> mine = trn::launch::allowed_cpus();
  const std::set<int> parent(mine.begin(), mine.end());
  const int nproc = std::min<int>(static_cast<int>(mine.size()), 4);
  if (nproc < 2) {
    WARN("this process may run on one cpu only: no two workers to place apart");
    return;
  }
  const auto bound = worker_cpus(run_trnrun(trnrun_argv({"--nproc-per-node", std::to_string(nproc)}, "cpus_report")), nproc);
  std::set<int> seen;
  for (const auto& cpus : bound) {
    CHECK_FALSE(cpus.empty());
    CHECK(std::includes(parent.begin(), parent.end(), cpus.begin(), cpus.end()));  // a subset of trnrun's
    for (int c : cpus) CHECK(seen.insert(c).second);                               // and no other rank's
  }
  const auto unbound =
      worker_cpus(run_trnrun(trnrun_argv({"--nproc-per-node", "2", "--bind", "none"}, "cpus_report")), 2);
  for (const auto& cpus : unbound) CHECK(cpus == parent);
}

TEST_CASE("trnrun under a narrower mask divides that mask, never widens it, and --bind core refuses too few cpus") {
  const std::vector<int> mine = trn::launch::allowed_cpus();
  REQUIRE_FALSE(mine.empty());
  PinnedTo one({mine.back()});
  // Two workers, one cpu: not enough to place apart, so both keep trnrun's single cpu.
  for (const auto& cpus : worker_cpus(run_trnrun(trnrun_argv({"--nproc-per-node", "2"}, "cpus_report")), 2))
    CHECK(cpus == std::set<int>{mine.back()});
  auto refused = run_trnrun(trnrun_argv({"--nproc-per-node", "2", "--bind", "core"}, "cpus_report"));
  INFO(refused.describe());
  CHECK(refused.exit_code == 2);
  CHECK_THAT(refused.output, Catch::Contains("--bind core: 2 workers need at least as many CPUs"));
  CHECK(env_reports(refused.output).empty());
}
