#include "launcher/server/service.h"

#include <fmt/format.h>

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <string_view>

#include "collectives/core/tsan.h"
#include "launcher/client/heartbeat_datagram.h"
#include "launcher/server/tokens.h"

namespace trn::control {

grpc::Status to_grpc(const Status& s) {
  grpc::StatusCode c = grpc::StatusCode::OK;
  switch (s.code) {
    case Code::kOk: return grpc::Status::OK;
    case Code::kInvalidArgument: c = grpc::StatusCode::INVALID_ARGUMENT; break;
    case Code::kNotFound: c = grpc::StatusCode::NOT_FOUND; break;
    case Code::kDeadlineExceeded: c = grpc::StatusCode::DEADLINE_EXCEEDED; break;
    case Code::kAborted: c = grpc::StatusCode::ABORTED; break;
    case Code::kFailedPrecondition: c = grpc::StatusCode::FAILED_PRECONDITION; break;
    case Code::kResourceExhausted: c = grpc::StatusCode::RESOURCE_EXHAUSTED; break;
    case Code::kUnavailable: c = grpc::StatusCode::UNAVAILABLE; break;
  }
  return grpc::Status(c, s.message);
}

bool constant_time_equal(const std::string& a, const std::string& b) {
  size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

static const char* code_name(grpc::StatusCode c) {
  switch (c) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    default: return "OTHER";
  }
}

static const grpc::Status kNoToken(grpc::StatusCode::UNAUTHENTICATED,
                                   "no bearer token: this coordinator requires one; pass its token file "
                                   "(--token-file, or TRN_TOKEN_FILE for workers)");
static const grpc::Status kWrongToken(
    grpc::StatusCode::UNAUTHENTICATED,
    "wrong bearer token: it is not this coordinator's admin or read-only token, "
    "nor the token of a job it holds; check the token file (--token-file or "
    "TRN_TOKEN_FILE)");

std::optional<grpc::Status> CoordinatorService::standby() const {
  if (refusal_)
    if (std::string why = refusal_(); !why.empty()) return grpc::Status(grpc::StatusCode::UNAVAILABLE, why);
  return std::nullopt;
}

std::optional<grpc::Status> CoordinatorService::refuse(grpc::CallbackServerContext* ctx,
                                                       const Call& call) const {
  if (token_.empty()) return standby();
  const auto& md = ctx->client_metadata();
  auto it = md.find("authorization");
  if (it == md.end() || it->second.empty()) return kNoToken;
  const std::string header(it->second.data(), it->second.size());
  constexpr std::string_view kBearer = "Bearer ";
  if (header.rfind(kBearer, 0) != 0) return kWrongToken;
  const std::string got = header.substr(kBearer.size());
  if (constant_time_equal(got, token_)) return standby();
  if (!read_token_.empty() && constant_time_equal(got, read_token_)) {
    if (!call.read)
      return grpc::Status(
          grpc::StatusCode::PERMISSION_DENIED,
          fmt::format("a read-only token may call GetStatus and WatchEvents only (trnctl status, "
                      "watch, checkpoints); {} needs the admin token or its job's token",
                      call.method));
    return standby();
  }
  // Only a serving replica knows the jobs: a standby sends the caller on to the leader first.
  if (auto no = standby()) return no;
  auto job = registry_.job_of_token(got);
  if (!job) return kWrongToken;
  if (call.job_id.empty())
    return grpc::Status(
        grpc::StatusCode::PERMISSION_DENIED,
        fmt::format("the token of job '{}' may act on that job only; {} of every job needs the "
                    "admin or a read-only token",
                    *job, call.method));
  if (call.job_id != *job)
    return grpc::Status(
        grpc::StatusCode::PERMISSION_DENIED,
        fmt::format("the token of job '{}' may act on that job only (its store, barriers, "
                    "heartbeats, failure and checkpoint reports, status and events), not {} of "
                    "job '{}'",
                    *job, call.method, call.job_id));
  return std::nullopt;
}

template <typename F>
grpc::ServerUnaryReactor* CoordinatorService::unary(grpc::CallbackServerContext* ctx, const Call& call,
                                                    F&& body) {
  auto start = Clock::now();
  auto* r = ctx->DefaultReactor();
  auto no = refuse(ctx, call);
  grpc::Status st = no ? *no : to_grpc(body());
  // A replica deposed while the call ran (or by the write the call made failing) answers
  // UNAVAILABLE: the answer may rest on state its successor never saw, so the client retries
  // there.
  if (!no)
    if (auto deposed = standby()) st = *deposed;
  metrics_.observe(call.method, code_name(st.error_code()),
                   std::chrono::duration<double>(Clock::now() - start).count());
  r->Finish(st);
  return r;
}

std::pair<grpc::ServerUnaryReactor*, std::function<void(const grpc::Status&)>> CoordinatorService::deferred(
    grpc::CallbackServerContext* ctx, const char* method) {
  auto start = Clock::now();
  auto* r = ctx->DefaultReactor();
  std::string m = method;
  return {r, [r, m, start, this](grpc::Status st) {
            // As in unary(): an answer from a replica deposed meanwhile is not trusted.
            if (st.error_code() != grpc::StatusCode::UNAUTHENTICATED &&
                st.error_code() != grpc::StatusCode::PERMISSION_DENIED)
              if (auto deposed = standby()) st = *deposed;
            metrics_.observe(m, code_name(st.error_code()),
                             std::chrono::duration<double>(Clock::now() - start).count());
            r->Finish(st);
          }};
}

// A wait may not outlast the call that waits.
static int64_t capped_wait_ms(grpc::CallbackServerContext* ctx, int64_t ms) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(ctx->deadline() -
                                                                    std::chrono::system_clock::now())
                  .count();
  return std::max<int64_t>(0, std::min(ms, left));
}

grpc::ServerUnaryReactor* CoordinatorService::Join(grpc::CallbackServerContext* ctx,
                                                   const v1::JoinRequest* req, v1::JoinResponse* resp) {
  auto [r, finish] = deferred(ctx, "Join");
  if (auto no = refuse(ctx, {"Join", req->job_id()})) return finish(*no), r;
  v1::JoinRequest q = *req;
  if (q.timeout_ms() >= 0) q.set_timeout_ms(capped_wait_ms(ctx, q.timeout_ms()));
  registry_.join(q, [finish = finish, resp, this](const Status& s, v1::JoinResponse out) {
    if (s.ok()) {
      *resp = std::move(out);
      resp->set_heartbeat_udp_port(udp_port_.load(std::memory_order_relaxed));
      resp->set_heartbeat_epoch(datagram_epoch());
    }
    finish(to_grpc(s));
  });
  return r;
}

grpc::ServerUnaryReactor* CoordinatorService::Get(grpc::CallbackServerContext* ctx, const v1::GetRequest* req,
                                                  v1::GetResponse* resp) {
  auto [r, finish] = deferred(ctx, "Get");
  if (auto no = refuse(ctx, {"Get", req->job_id()})) return finish(*no), r;
  v1::GetRequest q = *req;
  if (q.timeout_ms() >= 0) q.set_timeout_ms(capped_wait_ms(ctx, q.timeout_ms()));
  registry_.get(q, [finish = finish, resp](const Status& s, std::string v) {
    if (s.ok()) resp->set_value(std::move(v));
    finish(to_grpc(s));
  });
  return r;
}

grpc::ServerUnaryReactor* CoordinatorService::Barrier(grpc::CallbackServerContext* ctx,
                                                      const v1::BarrierRequest* req, v1::BarrierResponse*) {
  auto [r, finish] = deferred(ctx, "Barrier");
  if (auto no = refuse(ctx, {"Barrier", req->job_id()})) return finish(*no), r;
  v1::BarrierRequest q = *req;
  if (q.timeout_ms() >= 0) q.set_timeout_ms(capped_wait_ms(ctx, q.timeout_ms()));
  registry_.barrier(q, [finish = finish](const Status& s, bool) { finish(to_grpc(s)); });
  return r;
}

grpc::ServerUnaryReactor* CoordinatorService::Set(grpc::CallbackServerContext* ctx, const v1::SetRequest* req,
                                                  v1::SetResponse*) {
  return unary(ctx, {"Set", req->job_id()}, [&] { return registry_.set(*req); });
}

grpc::ServerUnaryReactor* CoordinatorService::Add(grpc::CallbackServerContext* ctx, const v1::AddRequest* req,
                                                  v1::AddResponse* resp) {
  return unary(ctx, {"Add", req->job_id()}, [&] {
    int64_t v = 0;
    Status s = registry_.add(*req, &v);
    resp->set_value(v);
    return s;
  });
}

grpc::ServerUnaryReactor* CoordinatorService::Delete(grpc::CallbackServerContext* ctx,
                                                     const v1::DeleteRequest* req, v1::DeleteResponse* resp) {
  return unary(ctx, {"Delete", req->job_id()}, [&] {
    bool d = false;
    Status s = registry_.del(*req, &d);
    resp->set_deleted(d);
    return s;
  });
}

grpc::ServerUnaryReactor* CoordinatorService::Heartbeat(grpc::CallbackServerContext* ctx,
                                                        const v1::HeartbeatRequest* req,
                                                        v1::HeartbeatResponse* resp) {
  return unary(ctx, {"Heartbeat", req->job_id()}, [&] {
    resp->set_heartbeat_udp_port(udp_port_.load(std::memory_order_relaxed));
    resp->set_heartbeat_epoch(datagram_epoch());
    return registry_.heartbeat(*req, resp);
  });
}

void CoordinatorService::new_datagram_epoch() {
  const uint64_t e = std::stoull(random_hex(8), nullptr, 16);
  epoch_.store(e == 0 ? 1 : e, std::memory_order_relaxed);
}

std::optional<std::string> CoordinatorService::heartbeat_datagram(std::string_view bytes) {
  const auto start = Clock::now();
  auto done = [&](const char* code) {
    metrics_.observe("HeartbeatDatagram", code, std::chrono::duration<double>(Clock::now() - start).count());
  };
  // Longer than any datagram of ours (DatagramServer hands one over truncated to one byte more).
  if (bytes.size() > kMaxDatagram) return done("OUT_OF_RANGE"), std::nullopt;
  auto d = parse_datagram(bytes, nullptr);
  v1::HeartbeatRequest req;
  if (!d || d->type != DatagramType::kRequest ||
      !req.ParseFromArray(d->payload.data(), static_cast<int>(d->payload.size())) ||
      req.kind() != v1::HeartbeatRequest::NODE)
    return done("INVALID_ARGUMENT"), std::nullopt;
  if (standby()) return done("UNAVAILABLE"), std::nullopt;
  std::string key;
  if (!token_.empty()) {
    auto t = registry_.job_token(req.job_id());
    if (!t || t->empty()) return done("UNAUTHENTICATED"), std::nullopt;
    key = std::move(*t);
  }
  if (!datagram_mac_ok(*d, key)) return done("UNAUTHENTICATED"), std::nullopt;
  // Another epoch: sent to a coordinator before this one was elected or restarted (or a replay of
  // such a datagram). The sender's gRPC fallback learns the epoch.
  if (d->epoch != datagram_epoch()) return done("FAILED_PRECONDITION"), std::nullopt;
  v1::HeartbeatResponse resp;
  Status s = registry_.heartbeat(req, &resp, d->seq);
  // As in unary(): an answer from a replica deposed meanwhile is not trusted.
  if (standby()) return done("UNAVAILABLE"), std::nullopt;
  if (!s.ok()) return done(code_name(to_grpc(s).error_code())), std::nullopt;
  resp.set_heartbeat_udp_port(udp_port_.load(std::memory_order_relaxed));
  resp.set_heartbeat_epoch(datagram_epoch());
  auto out = encode_datagram(DatagramType::kReply, d->seq, datagram_epoch(), resp.SerializeAsString(), key, d->mac);
  // Unauthenticated, a reply longer than its request would let a spoofed request reflect more
  // bytes at its victim than it cost: the sender gets it over gRPC instead.
  if (out && key.empty() && out->size() > bytes.size()) return done("RESOURCE_EXHAUSTED"), std::nullopt;
  done(out ? "OK" : "RESOURCE_EXHAUSTED");
  return out;
}

grpc::ServerUnaryReactor* CoordinatorService::ReportFailure(grpc::CallbackServerContext* ctx,
                                                            const v1::ReportFailureRequest* req,
                                                            v1::ReportFailureResponse* resp) {
  return unary(ctx, {"ReportFailure", req->job_id()}, [&] { return registry_.report_failure(*req, resp); });
}

grpc::ServerUnaryReactor* CoordinatorService::Finish(grpc::CallbackServerContext* ctx,
                                                     const v1::FinishRequest* req, v1::FinishResponse* resp) {
  return unary(ctx, {"Finish", req->job_id()}, [&] { return registry_.finish(*req, resp); });
}

grpc::ServerUnaryReactor* CoordinatorService::ReportShard(grpc::CallbackServerContext* ctx,
                                                          const v1::ReportShardRequest* req,
                                                          v1::ReportShardResponse* resp) {
  return unary(ctx, {"ReportShard", req->job_id()}, [&] { return registry_.report_shard(*req, resp); });
}

grpc::ServerUnaryReactor* CoordinatorService::GetStatus(grpc::CallbackServerContext* ctx,
                                                        const v1::GetStatusRequest* req,
                                                        v1::GetStatusResponse* resp) {
  return unary(ctx, {"GetStatus", req->job_id(), true}, [&] { return registry_.status(*req, resp); });
}

namespace {

// Streams events to one watcher. The registry calls push() under its lock; writes go out one
// at a time. A watcher that falls 10,000 events behind is dropped.
class EventWriter : public grpc::ServerWriteReactor<v1::Event> {
 public:
  struct Shared {
    std::mutex mu;
    EventWriter* self = nullptr;  // null once the call is done
  };

  EventWriter(Registry& registry, const v1::WatchEventsRequest& req, const std::optional<grpc::Status>& refused)
      : shared_(std::make_shared<Shared>()) {
    shared_->self = this;
    if (refused) {
      finished_ = true;
      Finish(*refused);
      tsan_publish(this);
      return;
    }
    auto shared = shared_;
    registry.subscribe(req.job_id(), req.replay(), [shared](const v1::Event& ev) {
      std::lock_guard lock(shared->mu);
      if (!shared->self) return false;
      shared->self->push(ev);
      return true;
    });
    tsan_publish(this);  // gRPC runs the callbacks below after this, on threads of its own
  }

  void OnWriteDone(bool ok) override {
    tsan_receive(this);
    std::lock_guard lock(shared_->mu);
    writing_ = false;
    if (!ok) return finish_locked(grpc::Status::CANCELLED);
    queue_.pop_front();
    next_locked();
  }
  void OnCancel() override {
    tsan_receive(this);
    std::lock_guard lock(shared_->mu);
    finish_locked(grpc::Status::CANCELLED);
  }
  void OnDone() override {
    tsan_receive(this);
    {
      std::lock_guard lock(shared_->mu);
      shared_->self = nullptr;
    }
    delete this;
  }

 private:
  void push(const v1::Event& ev) {  // shared_->mu held
    if (finished_) return;
    if (ev.seq() < 0)  // the registry closed: the watcher reconnects, to another replica if need be
      return finish_locked(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the coordinator stopped serving events"));
    queue_.push_back(ev);
    if (queue_.size() > 10000)
      return finish_locked(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "watcher fell too far behind"));
    next_locked();
  }
  void next_locked() {
    if (writing_ || finished_ || queue_.empty()) return;
    writing_ = true;
    StartWrite(&queue_.front());
  }
  void finish_locked(const grpc::Status& st) {
    if (finished_) return;
    finished_ = true;
    Finish(st);
  }

  std::shared_ptr<Shared> shared_;
  std::deque<v1::Event> queue_;
  bool writing_ = false;
  bool finished_ = false;
};

}  // namespace

grpc::ServerWriteReactor<v1::Event>* CoordinatorService::WatchEvents(grpc::CallbackServerContext* ctx,
                                                                     const v1::WatchEventsRequest* req) {
  auto no = refuse(ctx, {"WatchEvents", req->job_id(), true});
  metrics_.observe("WatchEvents", no ? code_name(no->error_code()) : "OK", 0);
  return new EventWriter(registry_, *req, no);
}

}  // namespace trn::control
