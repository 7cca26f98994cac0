// The connection behind CoordinatorClient: a gRPC channel per coordinator address, the bearer
// token, and call(), which retries UNAVAILABLE (coordinator starting, restarting, unreachable, or a
// standby replica) with backoff until the call's deadline, moving to the next address after each
// such failure (or to the leader a standby names), and turns any other failure into a trn::Error
// of the right kind. Used by the client library and by trnctl / trn-coordbench for the calls the
// contract does not wrap.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "collectives/core/deadline.h"
#include "collectives/core/error.h"
#include "launcher/client/coordinator_client.h"
#include "launcher/client/datagram_heartbeats.h"
#include "trn/coordinator/v1/coordinator.grpc.pb.h"

namespace trn::control {

namespace v1 = ::trn::coordinator::v1;

struct CoordinatorClient::Impl {
  explicit Impl(ClientOptions options);

  ClientOptions options;
  // The last shard report failed to reach the coordinator (see CoordinatorClient::report_shard).
  std::atomic<bool> shards_unreachable{false};
  static constexpr auto kShortTry = std::chrono::seconds(2);
  std::vector<std::string> addresses;  // options.address, split at commas
  std::vector<std::shared_ptr<grpc::Channel>> channels;       // one per address
  std::vector<std::unique_ptr<v1::Coordinator::Stub>> stubs;  // one per address, on channels[i]
  mutable std::atomic<size_t> current{0};  // the address calls go to
  // Node heartbeats as datagrams, set up by join() (TRN_HEARTBEAT_DATAGRAMS=off: never).
  bool use_datagrams = true;
  DatagramHeartbeats datagrams;
  // The last diagnosis of a TLS handshake (tls_probe.h): when (steady clock), of which address,
  // and its reason ("" none). A probe runs once a second at most, so a coordinator that is
  // restarting costs few; within that second its reason stands for the address.
  mutable std::mutex tls_mu;
  mutable Clock::time_point tls_probed{};
  mutable std::string tls_probed_address, tls_reason;

  v1::Coordinator::Stub* stub() const { return stubs[current.load() % stubs.size()].get(); }
  const std::string& address() const { return addresses[current.load() % addresses.size()]; }
  // After a transient failure of a call to `tried`: the next address, or the one a standby's
  // message names as its leader. Other threads that moved on already are not moved again.
  void fail_over(size_t tried, const grpc::Status& s) const;

  // After an UNAVAILABLE answer from addresses[tried] that a refused TLS handshake may explain:
  // throws a usage error naming why, when it is one that no retry can fix.
  void check_tls(size_t tried, const grpc::Status& s, const std::string& what, Deadline deadline) const;

  // Waits out a retry's backoff, until `until`, while driving the connection of the channel the
  // next try goes to; returns early once it is connected.
  void wait_before_retry(Clock::time_point until) const;

  // Prepares a context: token, deadline.
  void prepare(grpc::ClientContext& ctx, Clock::time_point deadline) const;

  // Calls stub->*method until it succeeds, fails for good, or deadline passes. `what` names the
  // call in errors ("join of job j"). Throws trn::Error.
  template <typename Req, typename Resp>
  void call(grpc::Status (v1::Coordinator::Stub::*method)(grpc::ClientContext*, const Req&, Resp*),
            const Req& req, Resp* resp, Deadline deadline, const std::string& what) const {
    call_with_retry(what, deadline, [&](grpc::ClientContext& ctx) {
      return (stub()->*method)(&ctx, req, resp);
    });
  }
  // Grace added to the gRPC deadline of a call that waits server-side for `wait`, so the
  // server's own (more precise) timeout message arrives first.
  static constexpr auto kWaitGrace = std::chrono::seconds(5);

  void call_with_retry(const std::string& what, Deadline deadline,
                       const std::function<grpc::Status(grpc::ClientContext&)>& attempt,
                       Duration grace = Duration::zero()) const;
};

// What a gRPC status says, never empty: its message, or else (gRPC and servers may send none) its
// code's name, "CANCELLED (no message)".
std::string status_text(const grpc::Status& s);

// A gRPC failure as a trn::Error: INVALID_ARGUMENT, UNAUTHENTICATED, NOT_FOUND, FAILED_PRECONDITION
// and RESOURCE_EXHAUSTED are the caller's (usage); DEADLINE_EXCEEDED a timeout; ABORTED an abort
// (the generation moved on); the rest remote.
Error to_error(const grpc::Status& s, const std::string& what, const std::string& address);

// Reads a bearer token file (trimmed); a usage error when unreadable or empty.
std::string read_token_file(const std::string& path);

}  // namespace trn::control
