// The workers of one node: real processes, each the leader of its own process group (so a signal
// or SIGKILL reaches everything it started), with their output going through the OutputPump.
// Workers die with trnrun (PR_SET_PDEATHSIG), so none outlives it. A group holds one worker per
// local rank; under --recovery in-place it lives across generations, and a rank whose worker
// exited is started anew with replace().
#pragma once

#include <sys/types.h>

#include <functional>
#include <map>
#include <optional>
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
  std::vector<int> cpus;                   // the CPUs it may run on (--bind); empty: trnrun's
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

// One worker of a group as it stands.
struct WorkerInfo {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = 0;
  Clock::time_point started{};  // when this process was started
  bool running = false;         // false once reaped
};

class WorkerGroup {
 public:
  // pump must outlive the group. A program that cannot be executed (the child's execve failed:
  // ENOEXEC, EACCES, ENOENT...) is a usage error naming it and why, thrown here and by replace()
  // once the workers already started are stopped (here) or left running (replace). The child
  // reports the failure's errno through a close-on-exec pipe, so a program that runs and exits
  // 127 itself is an ordinary failed worker.
  WorkerGroup(const std::vector<WorkerSpec>& specs, OutputPump& pump);
  ~WorkerGroup();  // SIGKILLs and reaps whatever is left
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  // An elastic job's new generation moved this node's ranks: worker of local rank l is now rank
  // first_rank + l (what reap() and workers() report from now on).
  void renumber(int first_rank);
  // Workers that exited since the last call, in rank order (never blocks).
  std::vector<WorkerExit> reap();
  size_t running() const;
  std::vector<pid_t> pids() const;
  // Every worker, in the order started (local rank order).
  std::vector<WorkerInfo> workers() const;
  // Starts spec as the new worker of its local rank, whose previous worker must have been reaped
  // (an internal error otherwise, as is a local rank the group does not hold). The rank and the
  // environment come from spec (the new generation's), its output goes to spec.sink.
  void replace(const WorkerSpec& spec);
  // SIGKILLs the process group of the running worker of local_rank and waits for it; its exit
  // (killed by SIGKILL) is returned here, not by a later reap(). Nullopt when it is not running.
  std::optional<WorkerExit> kill(int local_rank);
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
    Clock::time_point started;
    bool exited = false;
  };
  Worker spawn(const WorkerSpec& spec, int devnull);
  // Blocks until w exits (after SIGKILL) and returns how.
  WorkerExit wait_exit(Worker& w);
  OutputPump& pump_;
  std::vector<Worker> workers_;
};

// Name of a signal ("SIGTERM"), or "signal N".
std::string signal_name(int sig);

}  // namespace trn::launch
