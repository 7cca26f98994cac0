#include "launcher/agent/control_plane.h"

#include <algorithm>

#include "launcher/client/rpc.h"

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
  void report_stop(const std::string& job_id, int64_t generation, int rank, const std::string& reason) override {
    client_.report_stop(job_id, generation, rank, reason);
  }
  std::optional<JobBrief> peek_job(const std::string& job_id) override {
    control::v1::GetStatusRequest req;
    req.set_job_id(job_id);
    control::v1::GetStatusResponse resp;
    try {
      auto& impl = client_.impl();
      impl.call(&control::v1::Coordinator::Stub::GetStatus, req, &resp,
                Deadline::after(std::min<Duration>(impl.options.rpc_timeout, std::chrono::seconds(5))),
                fmt::format("status of job '{}'", job_id));
    } catch (const Error&) {
      return std::nullopt;  // unknown there (NOT_FOUND), or unreachable: the join says what matters
    }
    if (resp.jobs_size() != 1) return std::nullopt;
    const auto& j = resp.jobs(0);
    JobBrief brief{j.state(), j.generation(), j.nodes_size(), j.min_nodes(), j.max_nodes()};
    const int64_t silent_ms = std::max<int64_t>(resp.heartbeat_timeout_ms() / 3, 1000);
    for (const auto& n : j.nodes())
      if (!n.finished() && (n.heartbeat_unknown() || n.heartbeat_age_ms() > silent_ms)) brief.member_silent = true;
    return brief;
  }

 private:
  control::CoordinatorClient client_;
};

}  // namespace

std::unique_ptr<ControlPlane> coordinator_control_plane(const control::ClientOptions& options) {
  return std::make_unique<CoordinatorControlPlane>(options);
}

}  // namespace trn::launch
