#include <catch2/catch.hpp>

#include "collectives/core/error.h"
#include "launcher/agent/agent_state.h"

using namespace trn::launch;
using S = AgentState;
using E = AgentEvent;

TEST_CASE("agent state machine: success, restarts while they remain, then failure") {
  CHECK(next_state(S::kJoining, E::kJoined, 0, 0) == S::kRunning);
  CHECK(next_state(S::kRunning, E::kAllSucceeded, 0, 0) == S::kFinished);
  CHECK(next_state(S::kRunning, E::kWorkerFailed, 0, 0) == S::kFailed);
  CHECK(next_state(S::kRunning, E::kWorkerFailed, 0, 2) == S::kRestarting);
  CHECK(next_state(S::kRunning, E::kWorkerFailed, 1, 2) == S::kRestarting);
  CHECK(next_state(S::kRunning, E::kWorkerFailed, 2, 2) == S::kFailed);
  CHECK(next_state(S::kRunning, E::kGenerationMoved, 0, 1) == S::kRestarting);
  CHECK(next_state(S::kRunning, E::kGenerationMoved, 1, 1) == S::kFailed);
  CHECK(next_state(S::kRestarting, E::kRestarted, 1, 1) == S::kJoining);
}

TEST_CASE("agent state machine: an interrupt fails the job from any live state; nonsense is a bug") {
  for (S s : {S::kJoining, S::kRunning, S::kRestarting}) CHECK(next_state(s, E::kInterrupted, 0, 5) == S::kFailed);
  CHECK_THROWS_AS(next_state(S::kJoining, E::kAllSucceeded, 0, 0), trn::Error);
  CHECK_THROWS_AS(next_state(S::kFinished, E::kJoined, 0, 0), trn::Error);
  CHECK_THROWS_AS(next_state(S::kFailed, E::kRestarted, 0, 0), trn::Error);
  CHECK(std::string(to_string(S::kRestarting)) == "restarting");
}

TEST_CASE("agent state machine: a worker's usage error fails the job with restarts left") {
  CHECK(next_state(S::kRunning, E::kWorkerUsageError, 0, 5) == S::kFailed);
  // A program that cannot be executed is found as the workers start: the job fails from joining.
  CHECK(next_state(S::kJoining, E::kWorkerUsageError, 0, 5) == S::kFailed);
}

TEST_CASE("agent state machine: in place, a failure or a moved generation recovers while restarts remain") {
  const auto in_place = Recovery::kInPlace;
  CHECK(next_state(S::kRunning, E::kWorkerFailed, 0, 2, in_place) == S::kRecovering);
  CHECK(next_state(S::kRunning, E::kGenerationMoved, 1, 2, in_place) == S::kRecovering);
  CHECK(next_state(S::kRunning, E::kWorkerFailed, 2, 2, in_place) == S::kFailed);
  CHECK(next_state(S::kRunning, E::kGenerationMoved, 0, 0, in_place) == S::kFailed);
  CHECK(next_state(S::kRunning, E::kWorkerUsageError, 0, 5, in_place) == S::kFailed);
  // Re-joined: the survivors resumed and the dead ranks started again, without passing joining.
  CHECK(next_state(S::kRecovering, E::kJoined, 1, 2, in_place) == S::kRunning);
  // A worker that exits 2 while the node re-joins ends the job; so does a signal.
  CHECK(next_state(S::kRecovering, E::kWorkerUsageError, 1, 2, in_place) == S::kFailed);
  CHECK(next_state(S::kRecovering, E::kInterrupted, 1, 2, in_place) == S::kFailed);
  CHECK_THROWS_AS(next_state(S::kRecovering, E::kRestarted, 1, 2, in_place), trn::Error);
  CHECK_THROWS_AS(next_state(S::kRecovering, E::kWorkerFailed, 1, 2, in_place), trn::Error);
  // The default stays restart.
  CHECK(next_state(S::kRunning, E::kWorkerFailed, 0, 2) == S::kRestarting);
  CHECK(std::string(to_string(S::kRecovering)) == "recovering");
  CHECK(std::string(to_string(in_place)) == "in-place");
}
