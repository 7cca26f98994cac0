// The node agent's state machine, as a pure function so every transition is unit-tested:
//
//   joining --joined--> running --all workers exited 0--> finished
//      |  \--worker usage error (the program cannot be executed)--> failed
//      ^                   |  \--worker failed / generation moved on--> restarting --> joining
//      |                   |       (while restarts remain; each restart uses one)
//      +-------------------+  \--worker failed / moved on, no restarts left; interrupted--> failed
//                          |   \--worker usage error (exit 2)--> failed
//                          |
//                          +--worker failed / generation moved on, --recovery in-place--> recovering
//                                 (while restarts remain; each recovery uses one)
//   recovering --joined (survivors resumed, dead ranks started anew)--> running
//   recovering --worker usage error (a worker exited 2 meanwhile); interrupted--> failed
//
// Every restart counts against --max-restarts, whether this node's worker failed or another
// node's did (the generation moved on), and whether the group restarts or recovers in place:
// all agents of a job then agree on how many remain. A worker that exits 2 made a usage error
// (bad flags, a missing file): running it again would fail the same way, so it uses no restart
// and ends the job; so does a program that cannot be executed at all (not a binary for this
// machine, no permission), found when the workers are started.
#pragma once

namespace trn::launch {

// What a failure does to the workers that survive it (trnrun --recovery).
enum class Recovery {
  kRestart,  // stop them all, re-join, start the whole group in the new generation
  kInPlace,  // keep them running (they rebuild in-process), re-join, start only the dead ranks
};

enum class AgentState { kJoining, kRunning, kRestarting, kRecovering, kFinished, kFailed };
enum class AgentEvent {
  kJoined,           // rendezvous done, workers started (or, recovering, resumed and replaced)
  kAllSucceeded,     // every local worker exited 0
  kWorkerFailed,     // a local worker exited non-zero or was killed
  kWorkerUsageError, // a local worker exited 2, or could not be executed (a usage error: not a fault to recover from)
  kGenerationMoved,  // the coordinator says the job went on without us (another node failed)
  kInterrupted,      // SIGINT / SIGTERM / SIGHUP
  kRestarted,        // local workers stopped, ready to re-join
};

const char* to_string(Recovery recovery);
const char* to_string(AgentState state);
const char* to_string(AgentEvent event);

// The state after event; restarts_used counts restarts already made. An event that makes no
// sense in a state is a trn bug (internal error).
AgentState next_state(AgentState state, AgentEvent event, int restarts_used, int max_restarts,
                      Recovery recovery = Recovery::kRestart);

}  // namespace trn::launch
