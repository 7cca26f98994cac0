#include "launcher/agent/agent_state.h"

#include "collectives/core/error.h"

namespace trn::launch {

const char* to_string(Recovery recovery) {
  switch (recovery) {
    case Recovery::kRestart: return "restart";
    case Recovery::kInPlace: return "in-place";
  }
  return "?";
}

const char* to_string(AgentState state) {
  switch (state) {
    case AgentState::kJoining: return "joining";
    case AgentState::kRunning: return "running";
    case AgentState::kRestarting: return "restarting";
    case AgentState::kRecovering: return "recovering";
    case AgentState::kFinished: return "finished";
    case AgentState::kFailed: return "failed";
  }
  return "?";
}

const char* to_string(AgentEvent event) {
  switch (event) {
    case AgentEvent::kJoined: return "joined";
    case AgentEvent::kAllSucceeded: return "all succeeded";
    case AgentEvent::kWorkerFailed: return "worker failed";
    case AgentEvent::kWorkerUsageError: return "worker usage error";
    case AgentEvent::kGenerationMoved: return "generation moved";
    case AgentEvent::kInterrupted: return "interrupted";
    case AgentEvent::kRestarted: return "restarted";
  }
  return "?";
}

AgentState next_state(AgentState state, AgentEvent event, int restarts_used, int max_restarts, Recovery recovery) {
  if (event == AgentEvent::kInterrupted && state != AgentState::kFinished) return AgentState::kFailed;
  switch (state) {
    case AgentState::kJoining:
      if (event == AgentEvent::kJoined) return AgentState::kRunning;
      if (event == AgentEvent::kWorkerUsageError) return AgentState::kFailed;  // the program cannot be executed
      break;
    case AgentState::kRunning:
      if (event == AgentEvent::kAllSucceeded) return AgentState::kFinished;
      if (event == AgentEvent::kWorkerUsageError) return AgentState::kFailed;
      if (event == AgentEvent::kWorkerFailed || event == AgentEvent::kGenerationMoved) {
        if (restarts_used >= max_restarts) return AgentState::kFailed;
        return recovery == Recovery::kInPlace ? AgentState::kRecovering : AgentState::kRestarting;
      }
      break;
    case AgentState::kRestarting:
      if (event == AgentEvent::kRestarted) return AgentState::kJoining;
      break;
    case AgentState::kRecovering:
      if (event == AgentEvent::kJoined) return AgentState::kRunning;
      if (event == AgentEvent::kWorkerUsageError) return AgentState::kFailed;
      break;
    case AgentState::kFinished:
    case AgentState::kFailed:
      break;
  }
  throw internal_error("agent: event '{}' in state '{}'", to_string(event), to_string(state));
}

}  // namespace trn::launch
