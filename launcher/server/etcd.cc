#include "launcher/server/etcd.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <map>

#include "collectives/core/deadline.h"
#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "etcdserverpb/rpc.grpc.pb.h"
#include "launcher/client/address.h"

namespace trn::control::etcd {

namespace pb = ::etcdserverpb;
using log::Subsys;
using std::chrono::milliseconds;

// ---- endpoints --------------------------------------------------------------------------------

std::vector<std::string> parse_endpoints(const std::string& url) {
  auto bad = [&](const std::string& why) {
    return usage_error("malformed etcd URL '{}': {}; expected etcd://HOST:PORT[,HOST:PORT...]", url, why);
  };
  const std::string scheme = "etcd://";
  if (url.compare(0, scheme.size(), scheme) != 0) throw bad("it does not start with etcd://");
  std::vector<std::string> out;
  std::string rest = url.substr(scheme.size());
  size_t pos = 0;
  while (true) {
    size_t comma = rest.find(',', pos);
    std::string ep = rest.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    if (ep.empty())
      throw bad(out.empty() && comma == std::string::npos ? "no endpoint" : "an empty endpoint");
    if (const std::string why = address_problem(ep, PortUse::kDial); !why.empty())
      throw bad(fmt::format("'{}': {} (HOST: a name, an IPv4 address or [IPv6]; a port in 1-65535)", ep, why));
    out.push_back(ep);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

// ---- connection and the failover loop ---------------------------------------------------------

struct Conn {
  Options options;
  std::vector<std::string> endpoints;
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<pb::KV::Stub>> kv;
  std::vector<std::unique_ptr<pb::Lease::Stub>> lease;
  std::vector<std::unique_ptr<pb::Maintenance::Stub>> maintenance;
  std::atomic<size_t> current{0};  // the endpoint that answered last

  Conn(std::vector<std::string> eps, Options o) : options(o), endpoints(std::move(eps)) {
    if (endpoints.empty())
      throw usage_error("no etcd endpoint given; expected etcd://HOST:PORT[,HOST:PORT...]");
    if (options.page_size < 1)
      throw usage_error("etcd page size must be at least 1, not {}", options.page_size);
    if (options.tls_ca.empty() && !(options.tls_cert.empty() && options.tls_key.empty()))
      throw usage_error("a client certificate for etcd needs the CA that signed etcd's (--etcd-tls-ca)");
    if (options.tls_cert.empty() != options.tls_key.empty())
      throw usage_error("etcd's client certificate and its key go together (--etcd-tls-cert and --etcd-tls-key)");
    std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
    if (!options.tls_ca.empty())
      creds = grpc::SslCredentials(grpc::SslCredentialsOptions{options.tls_ca, options.tls_key, options.tls_cert});
    for (const auto& ep : endpoints) {
      grpc::ChannelArguments args;
      args.SetMaxReceiveMessageSize(options.max_receive_bytes);
      // Reconnect to a member that is back within a second. gRPC's "min reconnect backoff"
      // is in fact the timeout of one connection attempt: 2 s keeps an attempt made while no
      // call polls alive until the next call does (see await_connection).
      args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
      args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
      args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 2000);
      args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
      args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
      // Each endpoint is one member: never let gRPC share a connection between two channels.
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      auto ch = grpc::CreateCustomChannel(ep, creds, args);
      channels.push_back(ch);
      kv.push_back(pb::KV::NewStub(ch));
      lease.push_back(pb::Lease::NewStub(ch));
      maintenance.push_back(pb::Maintenance::NewStub(ch));
    }
  }

  // Prepares a context for a call to etcd: deadline, and (for KV and lease calls) etcd's
  // "refuse me when you have no leader" metadata, so a member without quorum answers at once.
  static void prepare(grpc::ClientContext& ctx, Clock::time_point deadline, bool require_leader) {
    ctx.set_deadline(to_system(deadline));
    if (require_leader) ctx.AddMetadata("hasleader", "true");
  }

  // Lets a connection to endpoint i that is under way complete before a call is made on it.
  // gRPC's synchronous API notices a connection attempt finish only while a thread of this
  // process polls, and a call on a channel in TRANSIENT_FAILURE fails at once without polling:
  // a member that came back could go unnoticed for seconds. Waiting for the connection polls.
  // True when connected; waits at most kConnectWait, so a dead member costs little.
  bool await_connection(size_t i, Clock::time_point deadline) {
    if (channels[i]->GetState(true) == GRPC_CHANNEL_READY) return true;
    return channels[i]->WaitForConnected(to_system(std::min(deadline, Clock::now() + kConnectWait)));
  }
  static constexpr auto kConnectWait = milliseconds(250);

  static std::chrono::system_clock::time_point to_system(Clock::time_point t) {
    return std::chrono::system_clock::now() +
           std::chrono::duration_cast<std::chrono::system_clock::duration>(t - Clock::now());
  }

  // After a failed call on endpoint i, later calls start at the next one.
  void advance_from(size_t i) {
    size_t expected = i;
    current.compare_exchange_strong(expected, (i + 1) % endpoints.size());
  }

  // Runs attempt(ctx, i) on endpoint i, starting at the current endpoint and moving on after
  // UNAVAILABLE, until one answers or the deadline passes. `what` names the operation in the
  // message ("put /k"); `write` adds that a timed-out write may have taken effect.
  Status call(const std::string& what, bool write,
              const std::function<grpc::Status(grpc::ClientContext&, size_t)>& attempt) {
    const size_t n = endpoints.size();
    const auto deadline = Clock::now() + options.timeout;
    std::map<size_t, std::string> failures;  // endpoint -> its last failure
    grpc::StatusCode last = grpc::StatusCode::OK;
    bool ambiguous = false;
    auto backoff = milliseconds(25);
    size_t i = current.load();
    for (size_t tries = 1;; ++tries) {
      if (!await_connection(i, deadline) && Clock::now() >= deadline) {
        // Out of time while connecting: a call now could only report the deadline.
        if (!failures.count(i)) failures[i] = "unreachable (not connected)";
        if (last == grpc::StatusCode::OK) last = grpc::StatusCode::UNAVAILABLE;
        break;
      }
      grpc::ClientContext ctx;
      prepare(ctx, deadline, true);
      grpc::Status s = attempt(ctx, i);
      if (s.ok()) {
        current.store(i);
        return Status::Ok();
      }
      last = s.error_code();
      failures[i] = describe(s, options.timeout);
      ambiguous |= !surely_not_applied(s);
      log::debug(Subsys::kCoord, "{}: etcd {}: {}", what, endpoints[i], s.error_message());
      if (last != grpc::StatusCode::UNAVAILABLE || Clock::now() >= deadline) break;
      advance_from(i);
      i = (i + 1) % n;
      if (tries % n == 0) {  // every endpoint failed once: wait a little (an election takes ~1 s)
        std::this_thread::sleep_until(std::min(deadline, Clock::now() + backoff));
        backoff = std::min(backoff * 2, milliseconds(400));
        if (Clock::now() >= deadline) break;
      }
    }
    std::string msg = what + " failed: ";
    for (auto& [ep, why] : failures)
      msg += fmt::format("{}etcd {}: {}", ep == failures.begin()->first ? "" : "; ", endpoints[ep], why);
    if (write && ambiguous) msg += " (the write may or may not have taken effect)";
    return Status::Make(code_of(last), msg);
  }

  // True when a failed write certainly did not take effect: it never reached a member, a
  // member without a leader refused it, or etcd rejected it. A timeout, a connection lost
  // after sending, or etcd's own "request timed out" or "leader changed" leave it open.
  static bool surely_not_applied(const grpc::Status& s) {
    const std::string& m = s.error_message();
    switch (s.error_code()) {
      case grpc::StatusCode::DEADLINE_EXCEEDED:
      case grpc::StatusCode::CANCELLED:
        return false;
      case grpc::StatusCode::UNAVAILABLE:
        return m.rfind("failed to connect", 0) == 0 || m.rfind("etcdserver: no leader", 0) == 0;
      default:
        return true;
    }
  }

  // One failure, in words a user can act on; `budget` is the time the call was given.
  static std::string describe(const grpc::Status& s, Duration budget) {
    const std::string& m = s.error_message();
    auto starts = [&](const char* p) { return m.rfind(p, 0) == 0; };
    switch (s.error_code()) {
      case grpc::StatusCode::DEADLINE_EXCEEDED:
        return fmt::format(
            "no answer within {:.1f} s (the etcd cluster may have lost quorum, or is overloaded)",
            std::chrono::duration<double>(budget).count());
      case grpc::StatusCode::UNAVAILABLE:
        if (starts("etcdserver: no leader")) return "no leader (the etcd cluster lost quorum)";
        if (starts("etcdserver: request timed out"))
          return fmt::format("request timed out inside etcd (the etcd cluster may have lost quorum): {}", m);
        if (starts("etcdserver: leader changed")) return "the etcd leader changed during the request";
        if (starts("etcdserver: ")) return m.substr(12);
        return fmt::format("unreachable ({})", m);
      case grpc::StatusCode::NOT_FOUND:
        if (starts("etcdserver: requested lease not found"))
          return "lease not found (it expired or was revoked)";
        return m;
      default:
        return starts("etcdserver: ") ? m.substr(12) : m;
    }
  }

  static Code code_of(grpc::StatusCode c) {
    switch (c) {
      case grpc::StatusCode::DEADLINE_EXCEEDED:
        return Code::kDeadlineExceeded;
      case grpc::StatusCode::UNAVAILABLE:
      case grpc::StatusCode::CANCELLED:
        return Code::kUnavailable;
      case grpc::StatusCode::NOT_FOUND:
        return Code::kNotFound;
      case grpc::StatusCode::INVALID_ARGUMENT:
      case grpc::StatusCode::OUT_OF_RANGE:
        return Code::kInvalidArgument;
      case grpc::StatusCode::RESOURCE_EXHAUSTED:
        return Code::kResourceExhausted;
      default:
        return Code::kFailedPrecondition;
    }
  }
};

// ---- KV ---------------------------------------------------------------------------------------

// The range [key, end) of the keys that start with prefix: end is prefix with its last byte
// below 0xff incremented (trailing 0xff bytes dropped), or "\0" (no end) when there is no such
// byte. etcd wants a non-empty key, so the empty prefix is the range ["\0", no end).
static std::string prefix_key(const std::string& prefix) {
  return prefix.empty() ? std::string(1, '\0') : prefix;
}
static std::string prefix_end(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    if (static_cast<unsigned char>(end.back()) < 0xff) {
      end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');
}

static KeyValue from_pb(const mvccpb::KeyValue& kv) {
  return {kv.key(), kv.value(), kv.create_revision(), kv.mod_revision(), kv.lease()};
}

EtcdClient::EtcdClient(std::vector<std::string> endpoints, Options options)
    : conn_(std::make_shared<Conn>(std::move(endpoints), options)) {}
EtcdClient::~EtcdClient() = default;

const std::vector<std::string>& EtcdClient::endpoints() const { return conn_->endpoints; }
const Options& EtcdClient::options() const { return conn_->options; }

Status EtcdClient::put(const std::string& key, const std::string& value, int64_t lease) {
  pb::PutRequest req;
  req.set_key(key);
  req.set_value(value);
  req.set_lease(lease);
  pb::PutResponse resp;
  return conn_->call("put " + key, true,
                     [&](grpc::ClientContext& ctx, size_t i) { return conn_->kv[i]->Put(&ctx, req, &resp); });
}

Result<std::optional<KeyValue>> EtcdClient::get(const std::string& key) {
  pb::RangeRequest req;
  req.set_key(key);
  pb::RangeResponse resp;
  Result<std::optional<KeyValue>> r;
  r.status = conn_->call("get " + key, false, [&](grpc::ClientContext& ctx, size_t i) {
    return conn_->kv[i]->Range(&ctx, req, &resp);
  });
  if (r.ok() && resp.kvs_size() > 0) r.value = from_pb(resp.kvs(0));
  return r;
}

Result<std::vector<KeyValue>> EtcdClient::range_prefix(const std::string& prefix) {
  pb::RangeRequest req;
  req.set_key(prefix_key(prefix));
  req.set_range_end(prefix_end(prefix));
  req.set_limit(conn_->options.page_size);
  Result<std::vector<KeyValue>> r;
  for (;;) {
    pb::RangeResponse resp;
    r.status = conn_->call("range " + prefix + "*", false, [&](grpc::ClientContext& ctx, size_t i) {
      return conn_->kv[i]->Range(&ctx, req, &resp);
    });
    if (!r.ok()) {
      r.value.clear();
      return r;
    }
    for (const auto& kv : resp.kvs()) r.value.push_back(from_pb(kv));
    if (!resp.more() || resp.kvs_size() == 0) return r;
    // The next page: keys after the last one, at the first page's revision.
    if (req.revision() == 0) req.set_revision(resp.header().revision());
    req.set_key(resp.kvs(resp.kvs_size() - 1).key() + '\0');
  }
}

static Result<int64_t> delete_range(Conn& conn, const std::string& what, pb::DeleteRangeRequest req) {
  pb::DeleteRangeResponse resp;
  Result<int64_t> r;
  r.status = conn.call(what, true, [&](grpc::ClientContext& ctx, size_t i) {
    return conn.kv[i]->DeleteRange(&ctx, req, &resp);
  });
  if (r.ok()) r.value = resp.deleted();
  return r;
}

Result<int64_t> EtcdClient::delete_key(const std::string& key) {
  pb::DeleteRangeRequest req;
  req.set_key(key);
  return delete_range(*conn_, "delete " + key, req);
}

Result<int64_t> EtcdClient::delete_prefix(const std::string& prefix) {
  pb::DeleteRangeRequest req;
  req.set_key(prefix_key(prefix));
  req.set_range_end(prefix_end(prefix));
  return delete_range(*conn_, "delete " + prefix + "*", req);
}

// A compare on key's create_revision (0: the key does not exist).
static pb::Compare create_revision_is(const std::string& key, int64_t revision) {
  pb::Compare c;
  c.set_key(key);
  c.set_target(pb::Compare::CREATE);
  c.set_result(pb::Compare::EQUAL);
  c.set_create_revision(revision);
  return c;
}

Result<bool> EtcdClient::txn_put_if(const std::string& guard_key, int64_t guard_create_revision,
                                    const std::vector<Write>& writes) {
  pb::TxnRequest req;
  *req.add_compare() = create_revision_is(guard_key, guard_create_revision);
  for (const auto& w : writes) {
    pb::RequestOp* op = req.add_success();
    if (w.erase) {
      op->mutable_request_delete_range()->set_key(w.key);
    } else {
      pb::PutRequest* p = op->mutable_request_put();
      p->set_key(w.key);
      p->set_value(w.value);
      p->set_lease(w.lease);
    }
  }
  pb::TxnResponse resp;
  Result<bool> r;
  r.status = conn_->call(
      fmt::format("transaction of {} writes fenced by {}@{}", writes.size(), guard_key,
                  guard_create_revision),
      true, [&](grpc::ClientContext& ctx, size_t i) { return conn_->kv[i]->Txn(&ctx, req, &resp); });
  if (r.ok()) r.value = resp.succeeded();
  return r;
}

Result<Created> EtcdClient::create_if_absent(const std::string& key, const std::string& value,
                                             int64_t lease) {
  pb::TxnRequest req;
  *req.add_compare() = create_revision_is(key, 0);
  pb::PutRequest* p = req.add_success()->mutable_request_put();
  p->set_key(key);
  p->set_value(value);
  p->set_lease(lease);
  req.add_failure()->mutable_request_range()->set_key(key);
  pb::TxnResponse resp;
  Result<Created> r;
  r.status = conn_->call("create " + key, true, [&](grpc::ClientContext& ctx, size_t i) {
    return conn_->kv[i]->Txn(&ctx, req, &resp);
  });
  if (!r.ok()) return r;
  if (resp.succeeded()) {
    int64_t rev = resp.header().revision();
    r.value = {true, {key, value, rev, rev, lease}};
    return r;
  }
  // The compare failed, so the key existed at the revision the failure branch read it.
  if (resp.responses_size() != 1 || resp.responses(0).response_range().kvs_size() != 1) {
    r.status =
        Status::Make(Code::kFailedPrecondition,
                     fmt::format("create {} failed: etcd answered a failed compare without the key", key));
    return r;
  }
  r.value.current = from_pb(resp.responses(0).response_range().kvs(0));
  r.value.created = lease != 0 && r.value.current.lease == lease && r.value.current.value == value;
  return r;
}

// ---- leases -----------------------------------------------------------------------------------

Result<Lease> EtcdClient::grant(int64_t ttl_s) {
  pb::LeaseGrantRequest req;
  req.set_ttl(ttl_s);
  pb::LeaseGrantResponse resp;
  Result<Lease> r;
  r.status = conn_->call(
      fmt::format("grant of a {} s lease", ttl_s), true,
      [&](grpc::ClientContext& ctx, size_t i) { return conn_->lease[i]->LeaseGrant(&ctx, req, &resp); });
  if (r.ok() && !resp.error().empty())
    r.status = Status::Make(Code::kFailedPrecondition,
                            fmt::format("grant of a {} s lease failed: etcd: {}", ttl_s, resp.error()));
  if (r.ok()) r.value = {resp.id(), resp.ttl()};
  return r;
}

Status EtcdClient::revoke(int64_t lease_id) {
  pb::LeaseRevokeRequest req;
  req.set_id(lease_id);
  pb::LeaseRevokeResponse resp;
  return conn_->call(
      fmt::format("revoke of lease {:x}", lease_id), true,
      [&](grpc::ClientContext& ctx, size_t i) { return conn_->lease[i]->LeaseRevoke(&ctx, req, &resp); });
}

Result<MemberStatus> EtcdClient::member_status(size_t i) {
  TRN_CHECK(i < conn_->endpoints.size());
  auto deadline = Clock::now() + conn_->options.timeout;
  conn_->await_connection(i, deadline);
  grpc::ClientContext ctx;
  Conn::prepare(ctx, deadline, false);
  pb::StatusResponse resp;
  grpc::Status s = conn_->maintenance[i]->Status(&ctx, pb::StatusRequest(), &resp);
  Result<MemberStatus> r;
  if (!s.ok()) {
    r.status = Status::Make(Conn::code_of(s.error_code()),
                            fmt::format("status failed: etcd {}: {}", conn_->endpoints[i],
                                        Conn::describe(s, conn_->options.timeout)));
    return r;
  }
  r.value = {resp.header().member_id(), resp.leader(), resp.raftterm(), resp.version()};
  return r;
}

// ---- LeaseKeeper ------------------------------------------------------------------------------

LeaseKeeper::LeaseKeeper(const EtcdClient& client, Lease lease, LostFn on_lost, DoubtFn on_doubt)
    : conn_(client.conn_), lease_(lease), on_lost_(std::move(on_lost)), on_doubt_(std::move(on_doubt)) {
  if (lease_.ttl_s < 1)
    throw usage_error("lease {:x} has TTL {} s; a kept lease needs at least 1 s", lease_.id, lease_.ttl_s);
  thread_ = std::thread([this] { run(); });
}

LeaseKeeper::~LeaseKeeper() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    if (inflight_) inflight_->TryCancel();
  }
  cv_.notify_all();
  thread_.join();
}

bool LeaseKeeper::lost() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lost_;
}

std::string LeaseKeeper::lost_reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reason_;
}

bool LeaseKeeper::in_doubt() const {
  std::lock_guard<std::mutex> lock(mu_);
  return doubt_;
}

Result<int64_t> LeaseKeeper::refresh(size_t i, Clock::time_point deadline) {
  const Duration budget = deadline - Clock::now();
  conn_->await_connection(i, deadline);
  grpc::ClientContext ctx;
  Conn::prepare(ctx, deadline, true);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return {Status::Make(Code::kUnavailable, "stopping"), 0};
    inflight_ = &ctx;
  }
  // One short stream per refresh, so that each refresh has its own deadline: a blocking Read
  // on a long-lived synchronous stream could not be bounded any other way.
  pb::LeaseKeepAliveRequest req;
  req.set_id(lease_.id);
  pb::LeaseKeepAliveResponse resp;
  auto stream = conn_->lease[i]->LeaseKeepAlive(&ctx);
  bool got = stream->Write(req) && stream->Read(&resp);
  stream->WritesDone();
  grpc::Status s = stream->Finish();
  {
    std::lock_guard<std::mutex> lock(mu_);
    inflight_ = nullptr;
  }
  if (got) return {Status::Ok(), resp.ttl()};
  if (s.ok())
    s = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the keep-alive stream ended without an answer");
  return {Status::Make(Conn::code_of(s.error_code()),
                       fmt::format("etcd {}: {}", conn_->endpoints[i], Conn::describe(s, budget))),
          0};
}

void LeaseKeeper::run() {
  const auto ttl = std::chrono::seconds(lease_.ttl_s);
  const auto attempt = std::min<Duration>(ttl, conn_->options.timeout);
  // Until the first refresh, count the TTL from now (the lease was granted just before).
  auto expires = Clock::now() + ttl;
  auto next = Clock::now();
  // Each endpoint's last failure since the last refresh that succeeded: with a member down, the
  // newest failure alone may name only that member, not the quorum lost with the others.
  std::map<size_t, std::string> failures;
  auto seen = [&] {
    std::string out;
    for (const auto& [ep, why] : failures) out += (out.empty() ? "" : "; ") + why;
    return out.empty() ? std::string("none") : out;
  };
  auto set_doubt = [&](bool doubt, const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (doubt_ == doubt) return;
      doubt_ = doubt;
    }
    if (doubt) log::warn(Subsys::kCoord, "{}", why);
    else log::info(Subsys::kCoord, "lease {:x}: refreshed again; it never expired", lease_.id);
    if (on_doubt_) on_doubt_(doubt ? why : std::string());
  };
  std::string reason;
  for (;;) {
    const auto gives_up = expires + kDoubtTtls * ttl;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_until(lock, std::min(next, doubt_ ? gives_up : expires), [&] { return stop_; });
      if (stop_) return;
    }
    auto sent = Clock::now();
    if (sent >= gives_up) {
      reason = fmt::format("lease {:x}: no successful refresh for {} s, {} times its TTL: the etcd cluster may have "
                           "lost quorum, or this replica is cut off from it (failures: {})",
                           lease_.id, lease_.ttl_s * (1 + kDoubtTtls), 1 + kDoubtTtls, seen());
      break;
    }
    if (sent >= expires)
      set_doubt(true, fmt::format("lease {:x}: no successful refresh for its TTL of {} s; it may have expired in "
                                  "etcd, so it is held in doubt until etcd answers (failures: {})",
                                  lease_.id, lease_.ttl_s, seen()));
    // Before the TTL runs out, an attempt ends at it: the doubt must begin on time.
    size_t i = conn_->current.load();
    Result<int64_t> r = refresh(i, std::min(sent >= expires ? gives_up : expires, sent + attempt));
    if (r.ok() && r.value > 0) {
      expires = sent + std::chrono::seconds(r.value);
      next = sent + milliseconds(std::chrono::seconds(r.value)) / 3;
      failures.clear();
      set_doubt(false, {});
      continue;
    }
    if (r.ok()) {
      reason = fmt::format("lease {:x} expired or was revoked (etcd {} answered TTL {})", lease_.id,
                           conn_->endpoints[i], r.value);
      break;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
    }
    failures[i] = r.status.message;
    log::debug(Subsys::kCoord, "lease {:x}: refresh failed: {}", lease_.id, r.status.message);
    conn_->advance_from(i);
    next = Clock::now() + milliseconds(100);
  }
  log::warn(Subsys::kCoord, "{}", reason);
  {
    std::lock_guard<std::mutex> lock(mu_);
    lost_ = true;
    doubt_ = false;
    reason_ = reason;
  }
  if (on_lost_) on_lost_(reason);
}

}  // namespace trn::control::etcd
