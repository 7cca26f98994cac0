// Starting real processes from tests: each gets a hard deadline, its stdout and stderr are
// collected, and stragglers (with their whole process group) are killed, so no test hangs CI.
//
// A test executable can run one of its own functions as a child process:
//
//   TRN_TEST_CHILD(echo_rank) { return std::atoi(getenv("RANK")); }   // in a test .cc
//   auto results = trn::test::run_all({trn::test::child("echo_rank", {}, {{"RANK", "3"}})}, 30s);
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace trn::test {

struct ProcSpec {
  std::vector<std::string> argv;            // argv[0] is the program (path or name on PATH)
  std::map<std::string, std::string> env;   // added to (overriding) the parent's environment
};

struct ProcResult {
  int exit_code = -1;   // exit status, or -1 when killed by a signal
  int signal = 0;       // the signal that ended it, or 0
  bool timed_out = false;
  std::string output;   // stdout and stderr, interleaved
  bool ok() const { return exit_code == 0 && !timed_out; }
  std::string describe() const;  // "exit 0", "killed by signal 9", "timed out" + output
};

// A running child process in its own process group.
class Process {
 public:
  explicit Process(const ProcSpec& spec);
  ~Process();  // kills the group if still running
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  void signal(int sig);            // to the child only
  void signal_group(int sig);      // to its whole process group
  bool running();
  // Waits for exit until the deadline; then kills the group with SIGKILL and marks timed_out.
  ProcResult wait(std::chrono::steady_clock::time_point deadline);
  // Output gathered so far (drains the pipe without blocking).
  const std::string& output_so_far();

 private:
  void drain(int timeout_ms);
  pid_t pid_ = -1;
  int fd_ = -1;
  bool reaped_ = false;
  ProcResult result_;
};

// Runs all specs concurrently; waits for every one until timeout, kills the rest.
std::vector<ProcResult> run_all(const std::vector<ProcSpec>& specs, std::chrono::seconds timeout);

// The path of the running test executable.
std::string self_exe();
// A spec that runs this executable's TRN_TEST_CHILD(name) with args and extra env.
ProcSpec child(const std::string& name, std::vector<std::string> args = {},
               std::map<std::string, std::string> env = {});
// Path of a trn binary in the build's bin folder (next to the test executable).
std::string bin(const std::string& name);
// A fresh empty temporary directory, removed by the TempDir destructor.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
 private:
  std::string path_;
};

using ChildFn = std::function<int(const std::vector<std::string>& args)>;
bool register_child(const std::string& name, ChildFn fn);
// Called from main: when argv is "<exe> --trn-child NAME args...", runs the child and returns
// true with its exit code.
bool maybe_run_child(int argc, char** argv, int* exit_code);

}  // namespace trn::test

#define TRN_TEST_CHILD(name)                                                                  \
  static int trn_child_##name(const std::vector<std::string>& args);                         \
  static const bool trn_child_registered_##name = ::trn::test::register_child(#name, trn_child_##name); \
  static int trn_child_##name([[maybe_unused]] const std::vector<std::string>& args)
