// What the node agent needs from the control plane: rendezvous, liveness, failure reports and the
// end of the job. The real one talks to trn-coordinator (coordinator_control_plane.cc); unit
// tests of the agent's decisions use an in-process fake. Implementations are thread-safe: the
// agent heartbeats from a background thread.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "launcher/client/coordinator_client.h"

namespace trn::launch {

// What the coordinator says of a job before this node joins it.
struct JobBrief {
  std::string state;  // forming, running, completed, failed, stopped
  int64_t generation = 0;
  int nodes = 0;  // members of the running generation
  int min_nodes = 0, max_nodes = 0;
  // A member node has not been heard from for a third of the heartbeat timeout (or not since the
  // coordinator restarted): a new node may wait to replace it.
  bool member_silent = false;
};

class ControlPlane {
 public:
  virtual ~ControlPlane() = default;
  virtual control::JoinResult join(const control::JoinRequest& request) = 0;
  // ranks: the local workers' heartbeats heard since the last call; host: this node's.
  virtual control::HeartbeatReply node_heartbeat(const std::string& job_id, int64_t generation, int node_rank,
                                                 const std::vector<control::ForwardedHeartbeat>& ranks,
                                                 const std::string& host) = 0;
  // give_up: this node will not re-join (no restarts left, or a usage error); the job fails.
  virtual void report_failure(const std::string& job_id, int64_t generation, int rank,
                              const std::string& reason, bool give_up) = 0;
  virtual void finish(const std::string& job_id, int64_t generation, int node_rank) = 0;
  // The user stopped the job on this node (a signal to trnrun): stopped, not failed.
  virtual void report_stop(const std::string& job_id, int64_t generation, int rank, const std::string& reason) = 0;
  // The job as the coordinator holds it, or nullopt when it has none (or cannot say).
  virtual std::optional<JobBrief> peek_job(const std::string& /*job_id*/) { return std::nullopt; }
};

// A ControlPlane backed by a CoordinatorClient.
std::unique_ptr<ControlPlane> coordinator_control_plane(const control::ClientOptions& options);

}  // namespace trn::launch
