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

namespace {

// A file of `bytes` with the run bit, at dir/name.
std::string executable_file(const std::string& dir, const std::string& name, const std::string& bytes) {
  const std::string path = dir + "/" + name;
  std::ofstream(path, std::ios::binary) << bytes;
  std::filesystem::permissions(path, std::filesystem::perms::owner_all);
  return path;
}

// The usage error starting spec's program gives, or "" when it started.
std::string start_error(const WorkerSpec& spec, OutputPump& pump) {
  try {
    WorkerGroup group({spec}, pump);
  } catch (const trn::Error& e) {
    CHECK(e.kind() == trn::ErrorKind::kUsage);
    return e.what();
  }
  return "";
}

// The 64-byte header of an x86-64-layout ELF executable for machine 0xF00D, which no CPU has (so
// no binfmt_misc emulator on the host can claim it, as one could an aarch64 binary).
std::string foreign_elf() {
  std::string h(64, '\0');
  h.replace(0, 4, "\x7f" "ELF");
  h[4] = 2;  // 64-bit
  h[5] = 1;  // little-endian
  h[6] = 1;  // ELF version
  h[16] = 2;  // ET_EXEC
  h[18] = '\x0d';
  h[19] = '\xf0';  // e_machine 0xF00D
  h[20] = 1;  // e_version
  h[52] = 64;  // e_ehsize
  return h;
}

}  // namespace

TEST_CASE("worker group: a program that cannot be executed is a usage error naming it and why") {
  trn::test::TempDir dir;
  OutputPump pump;
  struct Case {
    std::string path, errno_name;
  };
  const std::vector<Case> cases = {
      {executable_file(dir.path(), "notes.txt", "just some text\n"), "ENOEXEC"},
      {executable_file(dir.path(), "foreign", foreign_elf()), "ENOEXEC"},
      {executable_file(dir.path(), "script", "#!/no/such/interpreter\necho hi\n"), "ENOENT"},
  };
  for (const auto& c : cases) {
    WorkerSpec spec = sleeper(0, 0);
    spec.argv = {c.path};
    const std::string why = start_error(spec, pump);
    INFO(c.path << ": " << why);
    CHECK_THAT(why, Catch::StartsWith("program " + c.path + " cannot be executed: "));
    CHECK_THAT(why, Catch::Contains("(" + c.errno_name + ")"));
    CHECK(why.find('\n') == std::string::npos);
  }

  // A group whose second worker cannot start stops the first one before saying so.
  WorkerSpec bad = sleeper(1, 1);
  bad.argv = {cases[0].path};
  CHECK_THROWS_AS(WorkerGroup({sleeper(0, 0), bad}, pump), trn::Error);

  // A program that runs and exits 127 itself is an ordinary failed worker.
  WorkerSpec exits_127 = sleeper(0, 0);
  exits_127.argv = {"/bin/sh", "-c", "exit 127"};
  WorkerGroup group({exits_127}, pump);
  std::vector<WorkerExit> exits;
  auto until = std::chrono::steady_clock::now() + 10s;
  while (exits.empty() && std::chrono::steady_clock::now() < until) {
    exits = group.reap();
    std::this_thread::sleep_for(10ms);
  }
  REQUIRE(exits.size() == 1);
  CHECK(exits[0].exit_code == 127);
}
