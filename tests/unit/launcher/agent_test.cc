// The agent's decisions (restart, give up, finish, follow the generation) against an in-process
// fake control plane, with real worker processes (/bin/sh scripts).
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <regex>
#include <sstream>
#include <set>
#include <thread>

#include "collectives/core/settings.h"
#include "launcher/agent/agent.h"
#include "launcher/agent/plan.h"
#include "launcher/client/agent_channel.h"
#include "tests/support/process.h"
#include "trn/coordinator/v1/coordinator.pb.h"

using namespace trn::launch;
using namespace std::chrono_literals;

namespace {

// One node's view of a coordinator: generations move on when a failure is reported or when the
// test says so.
class FakeControlPlane : public ControlPlane {
 public:
  trn::control::JoinResult join(const trn::control::JoinRequest& r) override {
    std::lock_guard lock(mu_);
    ++joins;
    node_ids.push_back(r.node_id);
    trn::control::JoinResult j;
    j.generation = generation;
    j.nnodes = 1;
    j.world_size = r.nproc_per_node + (joins > 1 ? grow_on_rejoin : 0);
    j.job_token = job_token;
    return j;
  }
  trn::control::HeartbeatReply node_heartbeat(const std::string&, int64_t gen, int,
                                              const std::vector<trn::control::ForwardedHeartbeat>& ranks,
                                              const std::string&) override {
    std::lock_guard lock(mu_);
    ++heartbeats;
    for (const auto& h : ranks)
      if (!h.silent) heard.insert(h.progress.rank);
    return {gen < generation, generation, "test moved it"};
  }
  void report_failure(const std::string&, int64_t gen, int rank, const std::string& reason, bool) override {
    std::lock_guard lock(mu_);
    failures.push_back({rank, reason});
    if (gen == generation) ++generation;
  }
  void finish(const std::string&, int64_t gen, int) override {
    std::lock_guard lock(mu_);
    finished_generation = gen;
  }
  void report_stop(const std::string&, int64_t, int rank, const std::string& reason) override {
    std::lock_guard lock(mu_);
    stops.push_back({rank, reason});
  }
  void move_on() {
    std::lock_guard lock(mu_);
    ++generation;
  }

  std::mutex mu_;
  int64_t generation = 0;
  int joins = 0;
  int grow_on_rejoin = 0;  // world size added by every join after the first (another node came)
  std::string job_token;   // what join replies carry
  std::vector<std::string> node_ids;
  int heartbeats = 0;
  std::set<int> heard;  // ranks whose own heartbeats a node heartbeat carried
  int64_t finished_generation = -1;
  std::vector<std::pair<int, std::string>> failures;
  std::vector<std::pair<int, std::string>> stops;
};

LaunchOptions options_for(const std::string& script, const std::string& log_dir, int nproc, int max_restarts) {
  LaunchOptions o;
  o.nproc_per_node = nproc;
  o.max_restarts = max_restarts;
  o.job_id = "unit";
  o.log_dir = log_dir;
  o.grace_period = 5s;
  o.command = {"/bin/sh", "-c", script};
  return o;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TEST_CASE("agent: all workers exit 0 -> finished, coordinator told, logs complete") {
  trn::test::TempDir dir;
  FakeControlPlane fake;
  SignalWatcher signals;
  Agent agent(options_for("echo hello from $TRN_RANK of $TRN_WORLD_SIZE", dir.path(), 2, 0), fake, "c:1", signals);
  auto r = agent.run();
  CHECK(r.exit_code == 0);
  CHECK(r.message.empty());
  CHECK(agent.state() == AgentState::kFinished);
  CHECK(fake.finished_generation == 0);
  CHECK(fake.failures.empty());
  CHECK(slurp(log_path(dir.path(), 0, 0)) == "hello from 0 of 2\n");
  CHECK(slurp(log_path(dir.path(), 1, 0)) == "hello from 1 of 2\n");
}

TEST_CASE("agent: workers get the job's token in a file only the user can read, removed with the agent") {
  trn::test::TempDir dir;
  std::ofstream(dir.path() + "/admin") << "admin\n";
  FakeControlPlane fake;
  fake.job_token = "0123abcd";
  SignalWatcher signals;
  auto o = options_for(
      "echo token=$(cat $TRN_TOKEN_FILE) file=$TRN_TOKEN_FILE mode=$(stat -c %a $TRN_TOKEN_FILE) "
      "dir=$(stat -c %a $(dirname $TRN_TOKEN_FILE))",
      dir.path(), 1, 0);
  o.token_file = dir.path() + "/admin";
  std::string file;
  {
    Agent agent(o, fake, "c:1", signals);
    REQUIRE(agent.run().exit_code == 0);
    std::smatch m;
    const std::string out = slurp(log_path(dir.path(), 0, 0));
    INFO(out);
    REQUIRE(std::regex_search(out, m, std::regex(R"(token=0123abcd file=(\S+) mode=600 dir=700)")));
    file = m[1].str();
    CHECK(std::filesystem::path(file).filename() == kJobTokenFile);
  }
  CHECK_FALSE(std::filesystem::exists(std::filesystem::path(file).parent_path()));

  // A coordinator that hands out no job token: the workers get --token-file.
  fake.job_token.clear();
  Agent agent(options_for("echo file=$TRN_TOKEN_FILE", dir.path(), 1, 0), fake, "c:1", signals);
  REQUIRE(agent.run().exit_code == 0);
  CHECK(slurp(log_path(dir.path(), 0, 0)) == "file=\n");
}

TEST_CASE("agent: a failed worker restarts the group in a new generation while restarts remain") {
  trn::test::TempDir dir;
  FakeControlPlane fake;
  SignalWatcher signals;
  // Rank 1 fails in generations 0 and 1; everyone succeeds in generation 2.
  std::string script =
      "echo gen $TRN_GENERATION; if [ $TRN_RANK = 1 ] && [ $TRN_GENERATION -lt 2 ]; then exit 3; fi; "
      "if [ $TRN_RANK = 0 ] && [ $TRN_GENERATION -lt 2 ]; then exec sleep 30; fi";
  SECTION("two restarts allowed: finishes in generation 2") {
    Agent agent(options_for(script, dir.path(), 2, 2), fake, "c:1", signals);
    auto r = agent.run();
    CHECK(r.exit_code == 0);
    CHECK(agent.restarts_used() == 2);
    CHECK(agent.generation() == 2);
    CHECK(fake.joins == 3);
    REQUIRE(fake.failures.size() == 2);
    CHECK(fake.failures[0].first == 1);
    CHECK_THAT(fake.failures[0].second, Catch::Contains("exited with code 3"));
    CHECK(fake.finished_generation == 2);
    // Rank 0 ran in generation 1 too (stopped there, perhaps before it printed).
    CHECK(std::filesystem::exists(log_path(dir.path(), 0, 1)));
    CHECK(slurp(log_path(dir.path(), 1, 2)) == "gen 2\n");
  }
  SECTION("one restart allowed: fails with rank 1's exit code and names it") {
    Agent agent(options_for(script, dir.path(), 2, 1), fake, "c:1", signals);
    auto r = agent.run();
    CHECK(r.exit_code == 3);
    CHECK(agent.state() == AgentState::kFailed);
    CHECK_THAT(r.message, Catch::Contains("rank 1 (local rank 1, pid"));
    CHECK_THAT(r.message, Catch::Contains("exited with code 3 in generation 1; no restarts left (--max-restarts 1)"));
    CHECK(fake.finished_generation == -1);
  }
}

TEST_CASE("agent: when another node moves the generation on, the local group restarts with it") {
  trn::test::TempDir dir;
  FakeControlPlane fake;
  SignalWatcher signals;
  std::string script = "if [ $TRN_GENERATION = 0 ]; then exec sleep 30; fi; echo done $TRN_GENERATION";
  std::thread mover([&] {
    std::this_thread::sleep_for(300ms);
    fake.move_on();
  });
  SECTION("restart allowed") {
    Agent agent(options_for(script, dir.path(), 1, 1), fake, "c:1", signals);
    auto r = agent.run();
    mover.join();
    CHECK(r.exit_code == 0);
    CHECK(agent.generation() == 1);
    CHECK(fake.failures.empty());
    CHECK(slurp(log_path(dir.path(), 0, 1)) == "done 1\n");
  }
  SECTION("no restarts: fails naming the reason") {
    Agent agent(options_for(script, dir.path(), 1, 0), fake, "c:1", signals);
    auto r = agent.run();
    mover.join();
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.message, Catch::Contains("test moved it"));
  }
}

// A worker of `trnrun --recovery in-place` as far as the agent can tell: it heartbeats to
// TRN_AGENT_SOCKET every 0.1 s in its generation, prints each abort, and on the agent's resume
// goes on in the generation it names, same process. args[0]: what rank 1 does 0.3 s into
// generation 0 ("exit3", "sigkill", "sigstop" or "none"; or "rank3_dies_on_resume": rank 3 kills
// itself (SIGKILL) on hearing the resume, and rank 1 does nothing); args[1]: the generation in which every
// worker exits 0 after 5 heartbeats there. Gives up (exit 9) after 30 s.
TRN_TEST_CHILD(in_place_worker) {
  const std::string action = args.at(0);
  const int64_t finish_generation = std::stoll(args.at(1));
  auto env = [](const char* name) {
    const char* v = std::getenv(name);
    return std::string(v ? v : "");
  };
  const int rank = std::stoi(env("TRN_RANK"));
  int64_t generation = std::stoll(env("TRN_GENERATION"));
  const std::string job = env("TRN_JOB_ID");
  auto say = [](const std::string& line) {
    fmt::print("{}\n", line);
    std::fflush(stdout);
  };
  say(fmt::format("start rank {} gen {} pid {} recovery {}", rank, generation, getpid(), env("TRN_RECOVERY")));
  trn::control::AgentChannel channel(env("TRN_AGENT_SOCKET"));
  const auto t0 = std::chrono::steady_clock::now();
  int beats = 0;  // in the current generation
  while (std::chrono::steady_clock::now() - t0 < 30s) {
    trn::control::WorkerProgress p;
    p.rank = rank;
    p.host = "h";
    p.pid = getpid();
    p.step = beats;
    channel.send(job, generation, p);
    if (generation >= finish_generation && ++beats >= 5) {
      say(fmt::format("done rank {} gen {} pid {}", rank, generation, getpid()));
      return 0;
    }
    if (rank == 1 && generation == 0 && std::chrono::steady_clock::now() - t0 > 300ms) {
      if (action == "exit3") return 3;
      if (action == "sigkill") ::raise(SIGKILL);
      if (action == "sigstop") ::raise(SIGSTOP);
    }
    pollfd pfd{channel.fd(), POLLIN, 0};
    if (::poll(&pfd, 1, 100) <= 0) continue;
    char buf[4096];
    ssize_t n;
    while ((n = ::recv(channel.fd(), buf, sizeof buf, MSG_DONTWAIT)) > 0) {
      trn::coordinator::v1::HeartbeatResponse r;
      if (!r.ParseFromArray(buf, static_cast<int>(n))) continue;
      if (r.abort()) {
        say(fmt::format("abort gen {}: {}", generation, r.reason()));
      } else if (r.generation() > generation) {
        if (action == "rank3_dies_on_resume" && rank == 3) ::raise(SIGKILL);  // before heartbeating there
        generation = r.generation();
        beats = 0;
        say(fmt::format("{} gen {} pid {} as rank {} of {}", r.reason(), generation, getpid(), r.rank(),
                        r.world_size()));
      }
    }
  }
  say("timed out");
  return 9;
}

namespace {

// TRN_HEARTBEAT_INTERVAL for the agent (and the workers it starts) while it lives.
class HeartbeatInterval {
 public:
  explicit HeartbeatInterval(const char* seconds) {
    if (const char* v = std::getenv("TRN_HEARTBEAT_INTERVAL")) old_ = v;
    ::setenv("TRN_HEARTBEAT_INTERVAL", seconds, 1);
    trn::settings::reload_for_testing();
  }
  ~HeartbeatInterval() {
    if (old_) ::setenv("TRN_HEARTBEAT_INTERVAL", old_->c_str(), 1);
    else ::unsetenv("TRN_HEARTBEAT_INTERVAL");
    trn::settings::reload_for_testing();
  }

 private:
  std::optional<std::string> old_;
};

LaunchOptions in_place_options(const std::string& action, int finish_generation, const std::string& log_dir,
                               int nproc, int max_restarts) {
  LaunchOptions o = options_for("", log_dir, nproc, max_restarts);
  o.recovery = Recovery::kInPlace;
  o.command = trn::test::child("in_place_worker", {action, std::to_string(finish_generation)}).argv;
  return o;
}

// The pid a worker printed in its line starting with `what` ("start rank 0 gen 0"), or -1.
long pid_after(const std::string& log, const std::string& what) {
  std::smatch m;
  if (!std::regex_search(log, m, std::regex(what + R"( pid (\d+))"))) return -1;
  return std::stol(m[1].str());
}

}  // namespace

TEST_CASE("agent, in place: a killed worker is started anew in the next generation while the survivor keeps its process") {
  trn::test::TempDir dir;
  FakeControlPlane fake;
  SignalWatcher signals;
  HeartbeatInterval interval("0.2");
  const std::string action = GENERATE(as<std::string>{}, "exit3", "sigkill");
  CAPTURE(action);
  Agent agent(in_place_options(action, 1, dir.path(), 2, 3), fake, "c:1", signals);
  auto r = agent.run();
  CHECK(r.exit_code == 0);
  CHECK(r.message.empty());
  CHECK(agent.state() == AgentState::kFinished);
  CHECK(agent.generation() == 1);
  CHECK(agent.restarts_used() == 1);
  CHECK(fake.joins == 2);
  REQUIRE(fake.node_ids.size() == 2);
  CHECK(fake.node_ids[0] == fake.node_ids[1]);  // the same node re-joins, so it keeps its ranks
  REQUIRE(fake.failures.size() == 1);
  CHECK(fake.failures[0].first == 1);
  CHECK_THAT(fake.failures[0].second,
             Catch::Contains(action == "exit3" ? "exited with code 3" : "was killed by signal 9 (SIGKILL)"));
  CHECK(fake.finished_generation == 1);

  // Rank 0: one process from generation 0 to the end, told to abort and then to resume in 1.
  std::string rank0 = slurp(log_path(dir.path(), 0, 0));
  long pid0 = pid_after(rank0, "start rank 0 gen 0");
  REQUIRE(pid0 > 0);
  CHECK_THAT(rank0, Catch::Contains("recovery in-place"));
  CHECK_THAT(rank0, Catch::Contains("abort gen 0: generation 0 ended: rank 1 (local rank 1, pid"));
  CHECK(pid_after(rank0, "resume gen 1") == pid0);
  CHECK(pid_after(rank0, "done rank 0 gen 1") == pid0);
  CHECK_FALSE(std::filesystem::exists(log_path(dir.path(), 0, 1)));
  // Rank 1: a new process with generation 1's identity and log file.
  std::string rank1 = slurp(log_path(dir.path(), 1, 1));
  long pid1 = pid_after(rank1, "start rank 1 gen 1");
  REQUIRE(pid1 > 0);
  CHECK(pid1 != pid0);
  CHECK(pid1 != pid_after(slurp(log_path(dir.path(), 1, 0)), "start rank 1 gen 0"));
  CHECK_THAT(rank1, Catch::Contains("recovery in-place"));
  CHECK(pid_after(rank1, "done rank 1 gen 1") == pid1);
}

TEST_CASE("agent, in place: when another node's failure moves the generation on, every local worker keeps running") {
  trn::test::TempDir dir;
  FakeControlPlane fake;
  SignalWatcher signals;
  HeartbeatInterval interval("0.2");
  // The generation moves on once both workers have heartbeated (the relay knows where to send
  // their abort; a worker still starting up when it moves, under a loaded sanitizer build, would
  // only ever see the resume).
  std::thread mover([&] {
    const auto give_up = std::chrono::steady_clock::now() + 20s;
    for (;; std::this_thread::sleep_for(20ms)) {
      std::lock_guard lock(fake.mu_);
      if (fake.heard.size() == 2 || std::chrono::steady_clock::now() > give_up) break;
    }
    std::this_thread::sleep_for(200ms);
    fake.move_on();
  });
  Agent agent(in_place_options("none", 1, dir.path(), 2, 1), fake, "c:1", signals);
  auto r = agent.run();
  mover.join();
  CHECK(r.exit_code == 0);
  CHECK(agent.generation() == 1);
  CHECK(agent.restarts_used() == 1);
  CHECK(fake.failures.empty());
  CHECK(fake.finished_generation == 1);
  for (int rank : {0, 1}) {
    std::string log = slurp(log_path(dir.path(), rank, 0));
    long pid = pid_after(log, fmt::format("start rank {} gen 0", rank));
    REQUIRE(pid > 0);
    CHECK_THAT(log, Catch::Contains("abort gen 0: test moved it"));
    CHECK(pid_after(log, "resume gen 1") == pid);
    CHECK(pid_after(log, fmt::format("done rank {} gen 1", rank)) == pid);
    CHECK_FALSE(std::filesystem::exists(log_path(dir.path(), rank, 1)));
  }
}

TEST_CASE("agent, in place: a worker that stopped heartbeating is killed and started anew, the others kept") {
  trn::test::TempDir dir;
  FakeControlPlane fake;
  SignalWatcher signals;
  HeartbeatInterval interval("0.2");  // a worker silent for more than 2 s counts as hung
  // As the coordinator's heartbeat timeout would: rank 1 stops itself 0.3 s in, silent from then.
  std::thread mover([&] {
    std::this_thread::sleep_for(3500ms);
    fake.move_on();
  });
  Agent agent(in_place_options("sigstop", 1, dir.path(), 2, 1), fake, "c:1", signals);
  auto r = agent.run();
  mover.join();
  CHECK(r.exit_code == 0);
  CHECK(agent.generation() == 1);
  std::string rank0 = slurp(log_path(dir.path(), 0, 0));
  long pid0 = pid_after(rank0, "start rank 0 gen 0");
  REQUIRE(pid0 > 0);
  CHECK(pid_after(rank0, "done rank 0 gen 1") == pid0);
  long stopped = pid_after(slurp(log_path(dir.path(), 1, 0)), "start rank 1 gen 0");
  long pid1 = pid_after(slurp(log_path(dir.path(), 1, 1)), "done rank 1 gen 1");
  REQUIRE(pid1 > 0);
  CHECK(pid1 != stopped);
  CHECK(::kill(static_cast<pid_t>(stopped), 0) != 0);  // killed and reaped, not left stopped
}

TEST_CASE("agent, in place: when the world size changes on re-joining, survivors go on with their new place") {
  trn::test::TempDir dir;
  FakeControlPlane fake;
  fake.grow_on_rejoin = 1;  // another node came: the world is 3 in generation 1
  SignalWatcher signals;
  HeartbeatInterval interval("0.2");
  Agent agent(in_place_options("exit3", 1, dir.path(), 2, 1), fake, "c:1", signals);
  auto r = agent.run();
  CHECK(r.exit_code == 0);
  CHECK(agent.generation() == 1);
  // Rank 0 keeps its process and is told its place in the grown world; rank 1 starts anew.
  const std::string rank0 = slurp(log_path(dir.path(), 0, 0));
  long old0 = pid_after(rank0, "start rank 0 gen 0");
  REQUIRE(old0 > 0);
  CHECK(pid_after(rank0, "resume gen 1") == old0);
  CHECK_THAT(rank0, Catch::Contains("as rank 0 of 3"));
  CHECK(pid_after(rank0, "done rank 0 gen 1") == old0);
  CHECK(pid_after(slurp(log_path(dir.path(), 1, 1)), "done rank 1 gen 1") > 0);
}

TEST_CASE("agent, in place: with no restarts left a failure ends the job as in a restart") {
  trn::test::TempDir dir;
  FakeControlPlane fake;
  SignalWatcher signals;
  HeartbeatInterval interval("0.2");
  Agent agent(in_place_options("exit3", 1, dir.path(), 2, 0), fake, "c:1", signals);
  auto r = agent.run();
  CHECK(r.exit_code == 3);
  CHECK(agent.state() == AgentState::kFailed);
  CHECK_THAT(r.message, Catch::Contains("exited with code 3 in generation 0; no restarts left (--max-restarts 0)"));
  CHECK(fake.joins == 1);
}

// An agent of 4 in-place workers (rank 3 dies on hearing the resume) over a fake control plane,
// its log in dir args[0]; prints its result and how many failures reached the coordinator.
TRN_TEST_CHILD(four_worker_agent) {
  FakeControlPlane fake;
  SignalWatcher signals;
  HeartbeatInterval interval("0.2");
  Agent agent(in_place_options("rank3_dies_on_resume", 1, args.at(0), 4, 3), fake, "c:1", signals);
  auto r = agent.run();
  fmt::print("result exit={} generation={} restarts={} failures={}\n", r.exit_code, agent.generation(),
             agent.restarts_used(), fake.failures.size());
  return 0;
}

namespace {

// True once pid is a zombie (dead, not yet reaped by its parent).
bool zombie(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'Z';
}

}  // namespace

TEST_CASE("agent, in place: 3 of 4 workers dying together are each named, and the account says 1 kept, 3 restarted") {
  // Ranks 1 and 2 die while the agent is stopped, so it reaps them in one batch; rank 3 dies as
  // the recovery resumes it, after the agent counted it among the survivors.
  trn::test::TempDir dir;
  trn::test::Process agent(trn::test::child("four_worker_agent", {dir.path()}));
  std::map<int, long> pid;  // read from the logs being written (LOG.partial until the worker ends)
  const auto until = std::chrono::steady_clock::now() + 30s;
  while (pid.size() < 4 && std::chrono::steady_clock::now() < until && agent.running()) {
    for (int rank = 0; rank < 4; ++rank)
      if (long p = pid_after(slurp(log_path(dir.path(), rank, 0) + ".partial"), fmt::format("start rank {} gen 0", rank));
          p > 0)
        pid[rank] = p;
    std::this_thread::sleep_for(20ms);
  }
  REQUIRE(pid.size() == 4);
  REQUIRE(::kill(agent.pid(), SIGSTOP) == 0);
  for (int rank : {1, 2}) ::kill(static_cast<pid_t>(pid[rank]), SIGKILL);
  while ((!zombie(static_cast<pid_t>(pid[1])) || !zombie(static_cast<pid_t>(pid[2]))) &&
         std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(5ms);
  ::kill(agent.pid(), SIGCONT);
  auto r = agent.wait(std::chrono::steady_clock::now() + 60s);
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK_THAT(r.output, Catch::Contains("result exit=0 generation=1 restarts=1 failures=1"));
  auto killed = [&](int rank) {
    return fmt::format("rank {} (local rank {}, pid {}) was killed by signal 9 (SIGKILL)", rank, rank, pid[rank]);
  };
  // Both deaths of the batch name the failure; the third has its own line.
  CHECK_THAT(r.output, Catch::Contains(killed(1) + " and " + killed(2) + "; recovering in place"));
  CHECK_THAT(r.output, Catch::Contains(killed(3) + " before it resumed in generation 1"));
  CHECK_THAT(r.output, Catch::Contains("recovering in place in generation 1: 1 worker keeps running, 3 restarted "
                                       "(restart 1 of 3)"));
  CHECK(r.output.find("workers keep running") == std::string::npos);
  // Rank 0 kept its process; ranks 1 to 3 were started anew in generation 1 and finished there.
  CHECK(pid_after(slurp(log_path(dir.path(), 0, 0)), "done rank 0 gen 1") == pid[0]);
  for (int rank : {1, 2, 3})
    CHECK(pid_after(slurp(log_path(dir.path(), rank, 1)), fmt::format("done rank {} gen 1", rank)) > 0);
}
