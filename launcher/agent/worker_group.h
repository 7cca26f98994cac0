// The workers of one node in one generation: real processes, each the leader of its own process
// group (so a signal or SIGKILL reaches everything it started), with their output going through
// the OutputPump. Workers die with trnrun (PR_SET_PDEATHSIG), so none outlives it.
#pragma once

#include <sys/types.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "collectives/core/deadline.h"
#include "launcher/agent/output_pump.h"

namespace trn::launch {

struct WorkerSpec {
  int rank = 0;
  int local_rank = 0;
  std::vector<std::string> argv;           // argv[0]: path of the executable
  std::map<std::string, std::string> env;  // added to (overriding) trnrun's environment
  OutputSink sink;
};

struct WorkerExit {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = 0;
  int exit_code = 0;  // when it exited
  int signal = 0;     // when a signal ended it
  bool failed() const { return signal != 0 || exit_code != 0; }
  // The exit status a shell would report: the code, or 128 + signal.
  int status() const { return signal ? 128 + signal : exit_code; }
  // "exited with code 3" or "was killed by signal 9 (SIGKILL)".
  std::string describe() const;
};

class WorkerGroup {
 public:
  WorkerGroup(const std::vector<WorkerSpec>& specs, OutputPump& pump);
  ~WorkerGroup();  // SIGKILLs and reaps whatever is left
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  // Workers that exited since the last call, in rank order (never blocks).
  std::vector<WorkerExit> reap();
  size_t running() const;
  std::vector<pid_t> pids() const;
  // Sends sig to the process group of every worker still running.
  void signal_all(int sig);
  // Sends sig (unless 0) to every running worker, waits up to grace for them to exit (less when
  // kill_now() turns true), then SIGKILLs the process groups of all workers and reaps them.
  // Returns the exits seen meanwhile.
  std::vector<WorkerExit> stop(int sig, Duration grace, const std::function<bool()>& kill_now = {});

 private:
  struct Worker {
    int rank;
    int local_rank;
    pid_t pid;
    bool exited = false;
  };
  std::vector<Worker> workers_;
};

// Name of a signal ("SIGTERM"), or "signal N".
std::string signal_name(int sig);

}  // namespace trn::launch
