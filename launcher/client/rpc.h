// The connection behind CoordinatorClient: one gRPC channel, the bearer token, and call(), which
// retries UNAVAILABLE (coordinator starting, restarting, unreachable) with backoff until the
// call's deadline and turns any other failure into a trn::Error of the right kind. Used by the
// client library and by trnctl / trn-coordbench for the calls the contract does not wrap.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <string>

#include "collectives/core/deadline.h"
#include "collectives/core/error.h"
#include "launcher/client/coordinator_client.h"
#include "trn/coordinator/v1/coordinator.grpc.pb.h"

namespace trn::control {

namespace v1 = ::trn::coordinator::v1;

struct CoordinatorClient::Impl {
  explicit Impl(ClientOptions options);

  ClientOptions options;
  // The last shard report failed to reach the coordinator (see CoordinatorClient::report_shard).
  std::atomic<bool> shards_unreachable{false};
  static constexpr auto kShortTry = std::chrono::seconds(2);
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Coordinator::Stub> stub;

  // Prepares a context: token, deadline.
  void prepare(grpc::ClientContext& ctx, Clock::time_point deadline) const;

  // Calls stub->*method until it succeeds, fails for good, or deadline passes. `what` names the
  // call in errors ("join of job j"). Throws trn::Error.
  template <typename Req, typename Resp>
  void call(grpc::Status (v1::Coordinator::Stub::*method)(grpc::ClientContext*, const Req&, Resp*),
            const Req& req, Resp* resp, Deadline deadline, const std::string& what) const {
    call_with_retry(what, deadline, [&](grpc::ClientContext& ctx) {
      return (stub.get()->*method)(&ctx, req, resp);
    });
  }
  // Grace added to the gRPC deadline of a call that waits server-side for `wait`, so the
  // server's own (more precise) timeout message arrives first.
  static constexpr auto kWaitGrace = std::chrono::seconds(5);

  void call_with_retry(const std::string& what, Deadline deadline,
                       const std::function<grpc::Status(grpc::ClientContext&)>& attempt,
                       Duration grace = Duration::zero()) const;
};

// A gRPC failure as a trn::Error: INVALID_ARGUMENT, UNAUTHENTICATED, NOT_FOUND, FAILED_PRECONDITION
// and RESOURCE_EXHAUSTED are the caller's (usage); DEADLINE_EXCEEDED a timeout; ABORTED an abort
// (the generation moved on); the rest remote.
Error to_error(const grpc::Status& s, const std::string& what, const std::string& address);

// Reads a bearer token file (trimmed); a usage error when unreadable or empty.
std::string read_token_file(const std::string& path);

}  // namespace trn::control
