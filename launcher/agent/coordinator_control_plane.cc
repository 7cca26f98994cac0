#include <algorithm>

#include "launcher/agent/control_plane.h"
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
    // The summary alone, with every node past 1 ms counted late: the most silent node comes
    // first among those needing attention, whatever the job's size.
    control::v1::GetStatusRequest req;
    req.set_job_id(job_id);
    req.set_max_ranks(-1);
    req.set_late_ms(1);
    req.set_max_attention(1);
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
    JobBrief brief{j.state(), j.generation(), j.nnodes(), j.min_nodes(), j.max_nodes()};
    const int64_t silent_ms = std::max<int64_t>(resp.heartbeat_timeout_ms() / 3, 1000);
    brief.member_silent =
        j.node_health().unknown() > 0 ||
        (j.attention_nodes_size() > 0 && j.attention_nodes(0).heartbeat_age_ms() > silent_ms);
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
