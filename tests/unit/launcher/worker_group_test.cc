// WorkerGroup with real child processes: a rank whose worker died is started anew into the
// running group (trnrun --recovery in-place), the others untouched.
#include <catch2/catch.hpp>
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "collectives/core/error.h"
#include "launcher/agent/plan.h"
#include "launcher/agent/worker_group.h"
#include "tests/support/process.h"

using namespace trn::launch;
using namespace std::chrono_literals;

namespace {

WorkerSpec sleeper(int rank, int local_rank) {
  WorkerSpec s;
  s.rank = rank;
  s.local_rank = local_rank;
  s.argv = {"/bin/sleep", "30"};
  s.sink.console = false;
  return s;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool alive(pid_t pid) { return ::kill(pid, 0) == 0; }

}  // namespace

TEST_CASE("worker group: a killed rank is started anew in the running group while the others keep their processes") {
  trn::test::TempDir dir;
  OutputPump pump;
  WorkerGroup group({sleeper(6, 0), sleeper(7, 1), sleeper(8, 2)}, pump);
  auto before = group.workers();
  REQUIRE(before.size() == 3);
  for (const auto& w : before) CHECK(w.running);

  // kill() reports the exit itself; reap() does not report it again.
  auto killed = group.kill(1);
  REQUIRE(killed);
  CHECK(killed->rank == 7);
  CHECK(killed->signal == SIGKILL);
  CHECK_FALSE(group.kill(1));
  CHECK(group.reap().empty());
  CHECK(group.running() == 2);
  CHECK_FALSE(alive(before[1].pid));

  // The new worker of local rank 1 gets the new generation's identity and log file.
  WorkerSpec next;
  next.rank = 7;
  next.local_rank = 1;
  next.argv = {"/bin/sh", "-c", "echo rank $TRN_RANK generation $TRN_GENERATION; exec sleep 30"};
  next.env = {{"TRN_RANK", "7"}, {"TRN_GENERATION", "1"}};
  next.sink.console = false;
  next.sink.log_path = log_path(dir.path(), 7, 1);
  group.replace(next);
  auto after = group.workers();
  REQUIRE(after.size() == 3);
  CHECK(group.running() == 3);
  CHECK(after[0].pid == before[0].pid);
  CHECK(after[2].pid == before[2].pid);
  CHECK(after[1].pid != before[1].pid);
  CHECK(after[1].rank == 7);
  CHECK(after[1].running);
  CHECK(after[1].started >= before[1].started);
  CHECK(alive(after[0].pid));
  CHECK(alive(after[1].pid));

  // A running worker cannot be replaced, nor a local rank the group does not hold.
  CHECK_THROWS_AS(group.replace(sleeper(6, 0)), trn::Error);
  CHECK_THROWS_AS(group.replace(sleeper(9, 3)), trn::Error);

  // The replacement is supervised like the others: its output reaches its log, stop() reaches
  // it, and its log is finished.
  const std::string partial = log_path(dir.path(), 7, 1) + ".partial";
  auto until = std::chrono::steady_clock::now() + 10s;
  while (slurp(partial).empty() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(10ms);
  auto exits = group.stop(SIGTERM, 5s);
  CHECK(exits.size() == 3);
  CHECK(group.running() == 0);
  CHECK(pump.drain(trn::Deadline::after(5s)));
  CHECK(slurp(log_path(dir.path(), 7, 1)) == "rank 7 generation 1\n");
}

TEST_CASE("worker group: a stopped (SIGSTOP) worker is killed and reaped at once, and its rank replaced") {
  OutputPump pump;
  WorkerGroup group({sleeper(0, 0), sleeper(1, 1)}, pump);
  pid_t stopped = group.workers()[1].pid;
  REQUIRE(::kill(stopped, SIGSTOP) == 0);
  auto killed = group.kill(1);
  REQUIRE(killed);
  CHECK(killed->signal == SIGKILL);
  CHECK(killed->pid == stopped);
  group.replace(sleeper(1, 1));
  CHECK(group.running() == 2);
  CHECK(group.workers()[1].pid != stopped);

  // A replacement that exits is reaped as its rank.
  group.kill(1);
  WorkerSpec quick = sleeper(1, 1);
  quick.argv = {"/bin/sh", "-c", "exit 5"};
  group.replace(quick);
  std::vector<WorkerExit> exits;
  auto until = std::chrono::steady_clock::now() + 10s;
  while (exits.empty() && std::chrono::steady_clock::now() < until) {
    exits = group.reap();
    std::this_thread::sleep_for(10ms);
  }
  REQUIRE(exits.size() == 1);
  CHECK(exits[0].rank == 1);
  CHECK(exits[0].exit_code == 5);
  CHECK(group.running() == 1);
}
