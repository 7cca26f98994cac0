// trnrun's per-node agent: rendezvous through the control plane, start this node's workers,
// supervise them, and restart the group in a new generation when one fails (TorchElastic
// semantics) or, with --recovery in-place, keep the survivors running, re-join and start only
// the dead ranks anew (recover_in_place); see agent_state.h for the state machine. The workers
// hand their heartbeats to the agent (heartbeat_relay.h), which sends one node heartbeat per
// interval carrying all of them. Process handling lives in WorkerGroup and OutputPump; this
// class only makes decisions and drives them.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "launcher/agent/agent_state.h"
#include "launcher/agent/control_plane.h"
#include "launcher/agent/options.h"
#include "launcher/agent/output_pump.h"
#include "launcher/agent/signals.h"

namespace trn::launch {

struct AgentResult {
  int exit_code = 0;
  std::string message;  // one line for the user when the job did not succeed
};

class HeartbeatRelay;
class WorkerGroup;
struct WorkerExit;
struct WorkerSpec;

// The failed exits of one batch of reaped workers as one cause, every one named, the first
// first: "rank 1 (local rank 1, pid 42) was killed by signal 9 (SIGKILL) and rank 2 (local rank
// 2, pid 43) exited with code 3".
std::string describe_failures(const std::vector<WorkerExit>& failed);

// Under --recovery in-place, a running worker counts as hung, and is SIGKILLed and started anew
// rather than kept, when nothing has come from it for longer than this (3 heartbeat intervals,
// at least 2 s; measured from its start when it never heartbeated), since a worker whose
// heartbeat thread is silent could never hear the agent's resume.
Duration hung_worker_silence(Duration heartbeat_interval);

class Agent {
 public:
  // coordinator: the address workers get as TRN_COORDINATOR. run_dir: a private folder (0700) of
  // this trnrun that outlives the agent (the embedded coordinator's), for the heartbeat socket and
  // the job token's file; empty: the agent makes its own, and removes it.
  Agent(LaunchOptions options, ControlPlane& control, std::string coordinator, SignalWatcher& signals,
        const std::string& run_dir = "");
  ~Agent();

  // Runs the job on this node to the end.
  AgentResult run();

  // check() returns why the coordinator is gone for good (trnrun's embedded one exited), or ""
  // while it runs; the agent asks every monitor interval and ends the job at once when it is.
  void watch_coordinator(std::function<std::string()> check) { coordinator_gone_ = std::move(check); }

  AgentState state() const { return state_; }
  int64_t generation() const { return generation_; }
  int restarts_used() const { return restarts_used_; }
  // True when run() returned while a control-plane call was still in flight (interrupted during
  // rendezvous): the caller should end the process without destroying the control plane.
  bool abandoned_call() const { return abandoned_call_; }

 private:
  class Heartbeat;
  // recovery: what the state machine is told a failure does (default: --recovery, unless the
  // workers cannot be reached).
  void transition(AgentEvent event, std::optional<Recovery> recovery = std::nullopt);
  // Returns false when interrupted before the rendezvous finished.
  bool join();
  // Writes the job token of the last join to run_dir_ (mode 0600) when it changed; the workers'
  // TRN_TOKEN_FILE: that file, or "" when the coordinator handed out none.
  std::string job_token_file();
  AgentResult supervise();
  // In-place recovery after cause ended this generation (state recovering): kills hung workers,
  // re-joins, tells the survivors to resume in the new generation and starts the dead ranks anew
  // (or, when this node's place in the job changed, restarts them all). Returns the job's result
  // when it ends meanwhile (interrupted, coordinator lost, a usage error); nullopt when the
  // workers run again (state running).
  std::optional<AgentResult> recover_in_place(std::unique_ptr<WorkerGroup>& group,
                                              std::unique_ptr<Heartbeat>& heartbeat, const std::string& cause);
  // The program could not be started (why: WorkerGroup's usage error): as for a worker that
  // exits 2, the coordinator is told the job failed, nothing is restarted, and trnrun exits 2.
  AgentResult cannot_start(const std::string& why);
  // While an in-place recovery is not settled: a kept worker that died before it heartbeated in
  // the new generation never took part in it, so it is started anew in it with no further
  // restart (named in its own line), and its exit is taken out of exits. The recovery's account
  // ("N workers keep running, M restarted") is logged once every kept worker has heartbeated in
  // the generation or died, when the settling time passes, or (force) when something else ends
  // the generation; so its counts are what happened, however the deaths were reaped.
  void settle_recovery(WorkerGroup& group, std::vector<WorkerExit>& exits, bool force = false);
  // Stops node heartbeats, then the workers (sig first, SIGKILL after the grace period), and
  // drains their output.
  void stop_workers(WorkerGroup& group, std::unique_ptr<Heartbeat>& heartbeat, int sig);
  // After a worker's usage error: lets the other workers reach their own (see agent.cc).
  void await_usage_errors(WorkerGroup& group);
  void name_processes(const WorkerGroup& group);
  bool in_place() const;
  AgentResult interrupted(size_t workers);
  AgentResult coordinator_lost(const std::string& why, size_t workers);
  std::string gone() const { return coordinator_gone_ ? coordinator_gone_() : ""; }

  LaunchOptions options_;
  ControlPlane& control_;
  std::string coordinator_;
  SignalWatcher& signals_;
  OutputPump pump_;
  std::string node_id_;
  std::string host_;
  std::string own_dir_;        // the private folder the agent made (no run_dir given); removed with it
  std::string run_dir_;        // run_dir, or own_dir_
  std::string written_token_;  // the job token in run_dir_'s file
  AgentState state_ = AgentState::kJoining;
  control::JoinResult joined_;
  int64_t generation_ = -1;
  int restarts_used_ = 0;
  bool abandoned_call_ = false;
  // Where the workers hand their heartbeats (null when it could not be made: they heartbeat
  // the coordinator directly). Lives as long as the agent, across generations.
  std::unique_ptr<HeartbeatRelay> relay_;
  std::atomic<bool> generation_moved_{false};
  std::atomic<bool> stopped_by_user_{false};  // with generation_moved_: the job was stopped elsewhere
  // With generation_moved_ (in place only): the coordinator was unreachable for TRN_TIMEOUT and
  // the workers were told to abort; they are restarted, not resumed.
  std::atomic<bool> unreachable_{false};
  std::function<std::string()> coordinator_gone_;
  std::string lost_;  // why the coordinator was lost during the rendezvous
  // TRN_RUN_ID when the coordinator hands out none: drawn once, kept by every generation.
  std::string fallback_run_id_;
  std::string moved_reason_;  // guarded by moved_mu_
  // An in-place recovery whose account is not logged yet (settle_recovery).
  struct RecoveryAccount {
    std::string cause;
    int restart = 0;
    std::set<int> kept;  // ranks kept running and told to resume, less those that died before resuming
    size_t replaced = 0;
    Clock::time_point detected, rejoined, replaced_at;
    Clock::time_point settle_by;  // the account is logged by then at the latest
    std::vector<WorkerSpec> specs;  // the generation's, by local rank: for late replacements
  };
  std::unique_ptr<RecoveryAccount> account_;
  std::mutex moved_mu_;
};

}  // namespace trn::launch
