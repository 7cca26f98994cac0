#include "launcher/agent/control_plane.h"

namespace trn::launch {
namespace {

class CoordinatorControlPlane : public ControlPlane {
 public:
  explicit CoordinatorControlPlane(const control::ClientOptions& options) : client_(options) {}
  control::JoinResult join(const control::JoinRequest& request) override { return client_.join(request); }
  control::HeartbeatReply node_heartbeat(const std::string& job_id, int64_t generation, int node_rank,
                                         const std::vector<control::ForwardedHeartbeat>& ranks,
                                         const std::string& host) override {
    return client_.node_heartbeat(job_id, generation, node_rank, ranks, host);
  }
  void report_failure(const std::string& job_id, int64_t generation, int rank, const std::string& reason,
                      bool give_up) override {
    client_.report_failure(job_id, generation, rank, reason, give_up);
  }
  void finish(const std::string& job_id, int64_t generation, int node_rank) override {
    client_.finish(job_id, generation, node_rank);
  }

 private:
  control::CoordinatorClient client_;
};

}  // namespace

std::unique_ptr<ControlPlane> coordinator_control_plane(const control::ClientOptions& options) {
  return std::make_unique<CoordinatorControlPlane>(options);
}

}  // namespace trn::launch
