// What the node agent needs from the control plane: rendezvous, liveness, failure reports and the
// end of the job. The real one talks to trn-coordinator (coordinator_control_plane.cc); unit
// tests of the agent's decisions use an in-process fake. Implementations are thread-safe: the
// agent heartbeats from a background thread.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "launcher/client/coordinator_client.h"

namespace trn::launch {

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
};

// A ControlPlane backed by a CoordinatorClient.
std::unique_ptr<ControlPlane> coordinator_control_plane(const control::ClientOptions& options);

}  // namespace trn::launch
