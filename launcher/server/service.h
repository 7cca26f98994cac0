// The gRPC face of the Registry (callback API): checks the bearer token and what it may do, caps
// waits by the call's deadline, maps Status to gRPC codes and records metrics. No state lives
// here, and no thread is held while a call waits.
//
// Who may call what (with an admin token; without one, anyone may call anything):
//   the admin token       every call
//   the read-only token   GetStatus and WatchEvents (of any job, or of all)
//   a job's token         calls that name that job (Registry::job_of_token), GetStatus and
//                         WatchEvents of that job included; not those of every job
// No token, or one that is none of these: UNAUTHENTICATED. A known token on a call it does not
// cover: PERMISSION_DENIED, one line naming what the token may do. Tokens never reach a log.
#pragma once

#include <atomic>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "launcher/server/metrics.h"
#include "launcher/server/registry.h"
#include "trn/coordinator/v1/coordinator.grpc.pb.h"

namespace trn::control {

class CoordinatorService final : public v1::Coordinator::CallbackService {
 public:
  // token: the admin token (empty: no authentication); read_token: the read-only one (empty:
  // none). refusal: when set, called on every call; a non-empty answer refuses the call with
  // UNAVAILABLE and that message (a standby replica, or one that stopped accepting writes), so
  // clients move on to another replica.
  CoordinatorService(Registry& registry, RpcMetrics& metrics, std::string token, std::string read_token = {},
                     std::function<std::string()> refusal = {})
      : registry_(registry),
        metrics_(metrics),
        token_(std::move(token)),
        read_token_(std::move(read_token)),
        refusal_(std::move(refusal)) {
    new_datagram_epoch();
  }

  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* ctx, const v1::JoinRequest* req,
                                 v1::JoinResponse* resp) override;
  grpc::ServerUnaryReactor* Set(grpc::CallbackServerContext* ctx, const v1::SetRequest* req,
                                v1::SetResponse* resp) override;
  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* ctx, const v1::GetRequest* req,
                                v1::GetResponse* resp) override;
  grpc::ServerUnaryReactor* Add(grpc::CallbackServerContext* ctx, const v1::AddRequest* req,
                                v1::AddResponse* resp) override;
  grpc::ServerUnaryReactor* Delete(grpc::CallbackServerContext* ctx, const v1::DeleteRequest* req,
                                   v1::DeleteResponse* resp) override;
  grpc::ServerUnaryReactor* Barrier(grpc::CallbackServerContext* ctx, const v1::BarrierRequest* req,
                                    v1::BarrierResponse* resp) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx, const v1::HeartbeatRequest* req,
                                      v1::HeartbeatResponse* resp) override;
  grpc::ServerUnaryReactor* ReportFailure(grpc::CallbackServerContext* ctx,
                                          const v1::ReportFailureRequest* req,
                                          v1::ReportFailureResponse* resp) override;
  grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* ctx, const v1::FinishRequest* req,
                                   v1::FinishResponse* resp) override;
  grpc::ServerUnaryReactor* ReportShard(grpc::CallbackServerContext* ctx, const v1::ReportShardRequest* req,
                                        v1::ReportShardResponse* resp) override;
  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* ctx, const v1::GetStatusRequest* req,
                                      v1::GetStatusResponse* resp) override;
  grpc::ServerWriteReactor<v1::Event>* WatchEvents(grpc::CallbackServerContext* ctx,
                                                   const v1::WatchEventsRequest* req) override;

  // A node heartbeat that came as a datagram (launcher/client/heartbeat_datagram.h): the answer
  // datagram, or nullopt to drop it. Dropped: one longer than kMaxDatagram, a malformed datagram, one without a valid MAC when
  // this coordinator requires tokens (the key is its job's token), one this replica cannot serve
  // (a standby), a replay, and one the registry refuses. The sender then retries over gRPC,
  // which says why. Called from the DatagramServer's threads; metrics as "HeartbeatDatagram".
  std::optional<std::string> heartbeat_datagram(std::string_view bytes);
  // The port datagrams go to (0: none), told to joiners and in heartbeat replies.
  void set_heartbeat_udp_port(int port) { udp_port_ = port; }
  // A new datagram epoch (heartbeat_datagram.h): datagrams of the old one are refused from now
  // on. Called when a replica is elected, since the registry it restores holds no sequence numbers.
  void new_datagram_epoch();
  uint64_t datagram_epoch() const { return epoch_.load(std::memory_order_relaxed); }

 private:
  // A call as the token check sees it.
  struct Call {
    const char* method;
    const std::string& job_id;  // the job it names; empty: every job (GetStatus, WatchEvents)
    bool read = false;          // GetStatus, WatchEvents: open to the read-only token
  };
  // UNAUTHENTICATED, PERMISSION_DENIED, or UNAVAILABLE from refusal_; nothing: serve the call.
  std::optional<grpc::Status> refuse(grpc::CallbackServerContext* ctx, const Call& call) const;
  std::optional<grpc::Status> standby() const;
  // Runs a unary call on one job whose answer is ready at once.
  template <typename F>
  grpc::ServerUnaryReactor* unary(grpc::CallbackServerContext* ctx, const Call& call, F&& body);
  // A reactor plus a completion that finishes it and records metrics.
  std::pair<grpc::ServerUnaryReactor*, std::function<void(const grpc::Status&)>> deferred(
      grpc::CallbackServerContext* ctx, const char* method);

  Registry& registry_;
  RpcMetrics& metrics_;
  std::string token_;
  std::string read_token_;
  std::function<std::string()> refusal_;
  std::atomic<int> udp_port_{0};
  std::atomic<uint64_t> epoch_{0};
};

// Registry status -> gRPC status.
grpc::Status to_grpc(const Status& s);
// Equal strings, in time that does not depend on where they differ.
bool constant_time_equal(const std::string& a, const std::string& b);

}  // namespace trn::control
