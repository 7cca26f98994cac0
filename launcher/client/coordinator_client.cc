#include "launcher/client/coordinator_client.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <random>
#include <thread>

#include "collectives/core/log.h"
#include "collectives/core/settings.h"
#include "launcher/client/address.h"
#include "launcher/client/grpc_log.h"
#include "launcher/client/rpc.h"
#include "launcher/client/tls_files.h"
#include "launcher/client/tls_probe.h"

namespace trn::control {

using log::Subsys;

static double secs(Duration d) { return std::chrono::duration<double>(d).count(); }

std::string read_token_file(const std::string& path) {
  std::string t = read_regular_file(path, "token file");
  while (!t.empty() && std::isspace(static_cast<unsigned char>(t.back()))) t.pop_back();
  size_t i = 0;
  while (i < t.size() && std::isspace(static_cast<unsigned char>(t[i]))) ++i;
  t = t.substr(i);
  if (t.empty()) throw usage_error("token file {} is empty", path);
  return t;
}

ClientOptions options_from_environment() {
  ClientOptions o;
  o.address = settings::get("TRN_COORDINATOR");
  if (o.address.empty())
    throw usage_error("TRN_COORDINATOR is not set; set it to the coordinator's HOST:PORT (trnrun sets it)");
  std::string tf = settings::get("TRN_TOKEN_FILE");
  if (!tf.empty()) o.token = read_token_file(tf);
  o.tls_ca_file = settings::get("TRN_TLS_CA");
  o.tls_cert_file = settings::get("TRN_TLS_CERT");
  o.tls_key_file = settings::get("TRN_TLS_KEY");
  check_client_options(o, "TRN_COORDINATOR", {"TRN_TLS_CA", "TRN_TLS_CERT", "TRN_TLS_KEY"});
  return o;
}

std::vector<std::string> split_addresses(const std::string& list, const std::string& what) {
  std::vector<std::string> out;
  for (const auto& a : parse_address_list(list, what)) out.push_back(a.str());
  return out;
}

void check_client_options(const ClientOptions& o, const std::string& address_name, const TlsNames& tls_names) {
  parse_address_list(o.address, address_name);
  load_tls_files({o.tls_ca_file, o.tls_cert_file, o.tls_key_file}, tls_names);
}

CoordinatorClient::Impl::Impl(ClientOptions o) : options(std::move(o)) {
  route_grpc_logs();
  if (options.address.empty()) throw usage_error("no coordinator address given (HOST:PORT)");
  addresses = split_addresses(options.address);
  std::shared_ptr<grpc::ChannelCredentials> creds;
  const bool tls = !options.tls_ca_file.empty() || !options.tls_cert_file.empty();
  if (tls) {
    // Checked here too, for callers that did not check_client_options(): gRPC gets only text
    // that parses, and a key that matches its certificate.
    const TlsPem pem = load_tls_files({options.tls_ca_file, options.tls_cert_file, options.tls_key_file},
                                      {"TLS CA file", "TLS client certificate", "TLS client key"});
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = pem.ca;
    ssl.pem_cert_chain = pem.cert;
    ssl.pem_private_key = pem.key;
    creds = grpc::SslCredentials(ssl);
  } else {
    creds = grpc::InsecureChannelCredentials();
  }
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  // gRPC also takes this as the time a connection attempt may take. A TLS handshake is several
  // round trips with key exchange on both sides; on loaded hosts it can outlast 100 ms every
  // time, and the channel would never connect. A plaintext HTTP/2 handshake (the SETTINGS
  // exchange) with a coordinator that is starting on a loaded host outlasted 100 ms too: the
  // attempts' bounds then grew with the backoff and trnrun's first join took 5 s longer. 1 s is
  // far above a handshake on any host that answers, and is what an address that swallows the
  // connection (a cut-off replica) costs before the client moves to the next.
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, tls ? 5000 : 1000);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetMaxReceiveMessageSize(64 << 20);
  use_datagrams = settings::get("TRN_HEARTBEAT_DATAGRAMS") != "off";
  for (const auto& a : addresses) {
    channels.push_back(grpc::CreateCustomChannel(a, creds, args));
    stubs.push_back(v1::Coordinator::NewStub(channels.back()));
  }
}

void CoordinatorClient::Impl::fail_over(size_t tried, const grpc::Status& s) const {
  if (stubs.size() < 2) return;
  size_t next = tried + 1;
  // A standby says where the leader is: "... the leader is HOST:PORT".
  const std::string& m = s.error_message();
  if (size_t at = m.find("the leader is "); at != std::string::npos) {
    std::string leader = m.substr(at + 14);
    leader = leader.substr(0, leader.find_first_of(" ;,)"));
    for (size_t i = 0; i < addresses.size(); ++i)
      if (addresses[i] == leader && i != tried % addresses.size()) next = i;  // not the one that refused
  }
  if (current.compare_exchange_strong(tried, next % stubs.size()))
    log::debug(Subsys::kCoord, "coordinator {} unavailable ({}); trying {}", addresses[tried % addresses.size()],
               s.error_message(), address());
}

void CoordinatorClient::Impl::check_tls(size_t tried, const grpc::Status& s, const std::string& what,
                                        Deadline deadline) const {
  // gRPC words every failed handshake, TLS or not, as "... handshaker shutdown" or "Handshake
  // failed"; a coordinator that is down answers "Connection refused" instead. Under TLS 1.3 the
  // client's side of the handshake ends before the server checks the client's certificate: a
  // server that refuses it closes the connection, "Socket closed", as one that shuts down does.
  const std::string& m = s.error_message();
  if (s.error_code() != grpc::StatusCode::UNAVAILABLE ||
      (m.find("andshake") == std::string::npos && m.find("Socket closed") == std::string::npos))
    return;
  const std::string& address = addresses[tried % addresses.size()];
  std::lock_guard lock(tls_mu);
  if (Clock::now() - tls_probed >= std::chrono::seconds(1) || tls_probed_address != address) {
    const Duration wait =
        std::clamp<Duration>(deadline.remaining(), std::chrono::milliseconds(100), std::chrono::seconds(2));
    tls_reason = diagnose_tls(address, options, wait);
    tls_probed = Clock::now();
    tls_probed_address = address;
  }
  if (!tls_reason.empty()) throw usage_error("{}: coordinator {}: {}", what, address, tls_reason);
}

void CoordinatorClient::Impl::wait_before_retry(Clock::time_point until) const {
  // gRPC makes progress on a connection only while some thread polls the channel. After a
  // failed connection the channel stays in TRANSIENT_FAILURE until one succeeds, so each call
  // fails at once without polling; its reconnection attempts, made in the background, then
  // completed unseen while their 1 s bound ran out, and a coordinator that was back (a replica
  // restarted on its port) stayed "unreachable" until gRPC's 5 s backup poll. Watching the state
  // here is that poll: an attempt completes, and the next try goes as soon as it is connected.
  // A connected channel (a standby refusing, a server shutting down) gets the plain backoff.
  const auto& channel = channels[current.load() % channels.size()];
  grpc_connectivity_state state = channel->GetState(/*try_to_connect=*/true);
  if (state == GRPC_CHANNEL_READY || state == GRPC_CHANNEL_SHUTDOWN) {
    std::this_thread::sleep_until(until);
    return;
  }
  const auto to_system = [](Clock::time_point t) {
    return std::chrono::system_clock::now() +
           std::chrono::duration_cast<std::chrono::system_clock::duration>(t - Clock::now());
  };
  const auto start = Clock::now();
  while (state != GRPC_CHANNEL_READY && state != GRPC_CHANNEL_SHUTDOWN && Clock::now() < until) {
    if (!channel->WaitForStateChange(state, to_system(until))) return;  // the time ran out
    state = channel->GetState(/*try_to_connect=*/true);
  }
  // Connected early: still wait a quarter of the backoff, so a server that accepts connections
  // and drops each call (the channel reconnecting at once every time) is not retried in a loop.
  const auto floor = start + (until - start) / 4;
  if (Clock::now() < floor) std::this_thread::sleep_until(floor);
}

void CoordinatorClient::Impl::prepare(grpc::ClientContext& ctx, Clock::time_point deadline) const {
  if (!options.token.empty()) ctx.AddMetadata("authorization", "Bearer " + options.token);
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::duration_cast<std::chrono::system_clock::duration>(deadline - Clock::now()));
}

std::string status_text(const grpc::Status& s) {
  if (!s.error_message().empty()) return s.error_message();
  static constexpr const char* kNames[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
                                           "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                                           "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
                                           "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
  const int code = int(s.error_code());
  const std::string name = code >= 0 && code < int(std::size(kNames)) ? kNames[code] : fmt::format("code {}", code);
  return name + " (no message)";
}

Error to_error(const grpc::Status& s, const std::string& what, const std::string& address) {
  std::string m = fmt::format("{}: {}", what, status_text(s));
  switch (s.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::UNAUTHENTICATED:
    case grpc::StatusCode::PERMISSION_DENIED:
    case grpc::StatusCode::UNIMPLEMENTED:
      return Error(ErrorKind::kUsage, m);
    case grpc::StatusCode::DEADLINE_EXCEEDED: return Error(ErrorKind::kTimeout, m);
    case grpc::StatusCode::ABORTED: return Error(ErrorKind::kAborted, m);
    case grpc::StatusCode::UNAVAILABLE:
      return Error(ErrorKind::kRemote, fmt::format("{} (coordinator {} unreachable; is trn-coordinator "
                                                   "running there?)",
                                                   m, address));
    default: return Error(ErrorKind::kRemote, fmt::format("{} (coordinator {})", m, address));
  }
}

void CoordinatorClient::Impl::call_with_retry(const std::string& what, Deadline deadline,
                                              const std::function<grpc::Status(grpc::ClientContext&)>& attempt,
                                              Duration grace) const {
  auto start = Clock::now();
  Duration backoff = std::chrono::milliseconds(50);
  thread_local std::minstd_rand rng(std::random_device{}());
  std::string unavailable;  // the last UNAVAILABLE answer: why the coordinator did not serve
  for (int tries = 1;; ++tries) {
    grpc::ClientContext ctx;
    prepare(ctx, deadline.when() + grace);
    const size_t tried = current.load();
    grpc::Status s = attempt(ctx);
    if (s.ok()) return;
    // We never cancel our own calls: CANCELLED comes from a coordinator shutting down.
    bool transient = s.error_code() == grpc::StatusCode::UNAVAILABLE || s.error_code() == grpc::StatusCode::CANCELLED;
    if (!transient) {
      // Out of time after the coordinator refused: its refusal says more than the deadline.
      if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && !unavailable.empty() && deadline.expired())
        throw remote_error("{}: coordinator {} unreachable or not serving for {:.1f} s ({} tries; last: {})", what,
                           options.address, secs(Clock::now() - start), tries - 1, unavailable);
      if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && s.error_message() == "Deadline Exceeded")
        throw timeout_error("{}: no answer from coordinator {} within {:.1f} s (unreachable, or too busy?)",
                            what, options.address, secs(Clock::now() - start));
      throw to_error(s, what, options.address);
    }
    check_tls(tried, s, what, deadline);
    unavailable = status_text(s);
    fail_over(tried, s);
    if (deadline.expired())
      throw remote_error("{}: coordinator {} unreachable for {:.1f} s ({} tries; last: {}); is "
                         "trn-coordinator running there?",
                         what, options.address, secs(Clock::now() - start), tries, status_text(s));
    if (tries == 1 || tries % 20 == 0)
      log::debug(Subsys::kCoord, "{}: coordinator {} unavailable ({}), retrying", what, options.address,
                 s.error_message());
    auto jitter = std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 50)(rng));
    wait_before_retry(Clock::now() + std::min<Duration>(backoff + jitter, deadline.remaining()));
    // With replicas, a standby becomes the leader within its lease: look again sooner.
    backoff = std::min<Duration>(backoff * 2, stubs.size() > 1 ? std::chrono::milliseconds(250)
                                                               : std::chrono::milliseconds(1000));
  }
}

CoordinatorClient::CoordinatorClient(ClientOptions options) : impl_(std::make_shared<Impl>(std::move(options))) {}
CoordinatorClient::~CoordinatorClient() = default;

static int64_t to_ms(Duration d) { return std::chrono::duration_cast<std::chrono::milliseconds>(d).count(); }

JoinResult CoordinatorClient::join(const JoinRequest& r) {
  v1::JoinRequest req;
  req.set_job_id(r.job_id);
  req.set_node_id(r.node_id);
  req.set_host(r.host);
  req.set_nproc_per_node(r.nproc_per_node);
  req.set_min_nodes(r.min_nodes);
  req.set_max_nodes(r.max_nodes);
  req.set_settle_ms(to_ms(r.settle));
  req.set_omit_members(!r.include_nodes);
  v1::JoinResponse resp;
  impl_->call_with_retry(
      fmt::format("join of job '{}'", r.job_id), r.deadline,
      [&](grpc::ClientContext& ctx) {
        req.set_timeout_ms(to_ms(r.deadline.remaining()));
        return impl_->stub()->Join(&ctx, req, &resp);
      },
      Impl::kWaitGrace);
  JoinResult out;
  out.generation = resp.generation();
  out.node_rank = resp.node_rank();
  out.nnodes = resp.nnodes();
  out.world_size = resp.world_size();
  out.rank_offset = resp.rank_offset();
  out.run_id = resp.run_id();
  out.job_token = resp.job_token();
  // With TLS but no job token a datagram could not be authenticated: gRPC only.
  const bool tls = !impl_->options.tls_ca_file.empty() || !impl_->options.tls_cert_file.empty();
  if (impl_->use_datagrams && !(tls && resp.job_token().empty()))
    impl_->datagrams.configure(r.job_id, resp.job_token(), impl_->address(), resp.heartbeat_udp_port(),
                               resp.heartbeat_epoch());
  for (const auto& m : resp.members())
    out.nodes.push_back({m.node_rank(), m.node_id(), m.host(), m.nproc(), m.rank_offset()});
  return out;
}

static v1::HeartbeatRequest heartbeat_request(const std::string& job_id, int64_t generation) {
  v1::HeartbeatRequest req;
  req.set_job_id(job_id);
  req.set_generation(generation);
  return req;
}

static void set_coordinates(const std::optional<GridCoordinates>& c, v1::Coordinates* out) {
  out->set_dp_rank(c->dp_rank);
  out->set_tp_rank(c->tp_rank);
  out->set_pp_rank(c->pp_rank);
}

static HeartbeatReply to_reply(const v1::HeartbeatResponse& r) {
  return {r.abort(), r.generation(), r.reason(), r.stopped()};
}

void recovery_to_proto(const RecoveryReport& r, v1::RecoveryStatus* out) {
  out->set_recoveries(r.recoveries);
  out->set_detect_to_generation_s(r.detect_to_generation_s);
  out->set_detect_to_restored_s(r.detect_to_restored_s);
  out->set_detect_to_first_step_s(r.detect_to_first_step_s);
  out->set_restored_step(r.restored_step);
  out->set_steps_lost(r.steps_lost);
  out->set_steps_lost_total(r.steps_lost_total);
  out->set_replaced(r.replaced);
  if (std::isfinite(r.goodput) && r.goodput >= 0 && r.goodput <= 1) out->set_goodput(r.goodput);
}

RecoveryReport recovery_from_proto(const v1::RecoveryStatus& r) {
  RecoveryReport out;
  out.recoveries = r.recoveries();
  out.detect_to_generation_s = r.detect_to_generation_s();
  out.detect_to_restored_s = r.detect_to_restored_s();
  out.detect_to_first_step_s = r.detect_to_first_step_s();
  out.restored_step = r.restored_step();
  out.steps_lost = r.steps_lost();
  out.steps_lost_total = r.steps_lost_total();
  out.replaced = r.replaced();
  const double g = r.goodput();
  out.goodput = r.has_goodput() && std::isfinite(g) && g >= 0 && g <= 1 ? g : -1;  // as recovery_to_proto sends it
  return out;
}

void moe_to_proto(const MoeReport& r, v1::MoeStatus* out) {
  out->set_aux_loss(r.aux_loss);
  const size_t layers = std::min(kMaxMoeLayers, std::min(r.max_mean.size(), r.dead.size()));
  for (size_t l = 0; l < layers; ++l) {
    out->add_max_mean(r.max_mean[l]);
    out->add_dead_experts(r.dead[l]);
  }
  out->set_dropped(r.dropped);
}

MoeReport moe_from_proto(const v1::MoeStatus& m) {
  MoeReport out;
  out.aux_loss = m.aux_loss();
  out.max_mean.assign(m.max_mean().begin(), m.max_mean().end());
  out.dead.assign(m.dead_experts().begin(), m.dead_experts().end());
  out.dropped = m.dropped();
  return out;
}

v1::HeartbeatRequest worker_heartbeat_request(const std::string& job_id, int64_t generation, const WorkerProgress& p) {
  auto req = heartbeat_request(job_id, generation);
  req.set_kind(v1::HeartbeatRequest::WORKER);
  req.set_rank(p.rank);
  req.set_host(p.host);
  req.set_pid(p.pid);
  req.set_step(p.step);
  req.set_loss(p.loss);
  req.set_tokens_per_s(p.tokens_per_s);
  if (p.coordinates) set_coordinates(p.coordinates, req.mutable_coordinates());
  if (p.val_loss) req.set_val_loss(*p.val_loss);
  if (p.recovery) recovery_to_proto(*p.recovery, req.mutable_recovery());
  if (p.moe) moe_to_proto(*p.moe, req.mutable_moe());
  return req;
}

HeartbeatReply CoordinatorClient::heartbeat(const std::string& job_id, int64_t generation,
                                            const WorkerProgress& p) {
  const auto req = worker_heartbeat_request(job_id, generation, p);
  v1::HeartbeatResponse resp;
  impl_->call(&v1::Coordinator::Stub::Heartbeat, req, &resp, Deadline::after(impl_->options.rpc_timeout),
              fmt::format("heartbeat of rank {} (job '{}')", p.rank, job_id));
  return to_reply(resp);
}

HeartbeatReply CoordinatorClient::node_heartbeat(const std::string& job_id, int64_t generation, int node_rank,
                                                 const std::vector<ForwardedHeartbeat>& ranks,
                                                 const std::string& host) {
  auto req = heartbeat_request(job_id, generation);
  req.set_kind(v1::HeartbeatRequest::NODE);
  req.set_rank(node_rank);
  req.set_host(host);
  for (const auto& f : ranks) {
    auto* e = req.add_ranks();
    e->set_rank(f.progress.rank);
    e->set_pid(f.progress.pid);
    e->set_step(f.progress.step);
    e->set_loss(f.progress.loss);
    e->set_tokens_per_s(f.progress.tokens_per_s);
    if (f.progress.coordinates) set_coordinates(f.progress.coordinates, e->mutable_coordinates());
    if (f.progress.val_loss) e->set_val_loss(*f.progress.val_loss);
    if (f.progress.recovery) recovery_to_proto(*f.progress.recovery, e->mutable_recovery());
    if (f.progress.moe) moe_to_proto(*f.progress.moe, e->mutable_moe());
    e->set_age_ms(std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(f.age).count()));
    e->set_beats(f.beats);
    if (f.silent) e->set_silent(true);
  }
  uint64_t sent = 0;
  if (auto answer = impl_->datagrams.exchange(
          req, std::min(impl_->options.heartbeat_datagram_wait, impl_->options.rpc_timeout), &sent))
    return to_reply(*answer);
  req.set_datagram_seq(sent);
  v1::HeartbeatResponse resp;
  impl_->call(&v1::Coordinator::Stub::Heartbeat, req, &resp, Deadline::after(impl_->options.rpc_timeout),
              fmt::format("heartbeat of node {} (job '{}')", node_rank, job_id));
  if (impl_->use_datagrams)
    impl_->datagrams.follow(job_id, impl_->address(), resp.heartbeat_udp_port(), resp.heartbeat_epoch());
  return to_reply(resp);
}

void CoordinatorClient::report_failure(const std::string& job_id, int64_t generation, int rank,
                                       const std::string& reason, bool give_up, std::optional<Duration> timeout) {
  v1::ReportFailureRequest req;
  req.set_job_id(job_id);
  req.set_generation(generation);
  req.set_rank(rank);
  req.set_reason(reason.size() > 4000 ? reason.substr(0, 4000) : reason);
  req.set_give_up(give_up);
  v1::ReportFailureResponse resp;
  impl_->call(&v1::Coordinator::Stub::ReportFailure, req, &resp,
              Deadline::after(timeout.value_or(impl_->options.rpc_timeout)),
              fmt::format("failure report of job '{}'", job_id));
}

void CoordinatorClient::report_stop(const std::string& job_id, int64_t generation, int rank,
                                    const std::string& reason) {
  v1::ReportFailureRequest req;
  req.set_job_id(job_id);
  req.set_generation(generation);
  req.set_rank(rank);
  req.set_reason(reason.size() > 4000 ? reason.substr(0, 4000) : reason);
  req.set_user_stop(true);
  v1::ReportFailureResponse resp;
  impl_->call(&v1::Coordinator::Stub::ReportFailure, req, &resp, Deadline::after(impl_->options.rpc_timeout),
              fmt::format("stop report of job '{}'", job_id));
}

void CoordinatorClient::finish(const std::string& job_id, int64_t generation, int node_rank) {
  v1::FinishRequest req;
  req.set_job_id(job_id);
  req.set_generation(generation);
  req.set_node_rank(node_rank);
  v1::FinishResponse resp;
  impl_->call(&v1::Coordinator::Stub::Finish, req, &resp, Deadline::after(impl_->options.rpc_timeout),
              fmt::format("finish of node {} (job '{}')", node_rank, job_id));
}

int64_t CoordinatorClient::report_shard(const std::string& job_id, int64_t generation, const ShardReport& s) {
  v1::ReportShardRequest req;
  req.set_job_id(job_id);
  req.set_generation(generation);
  req.set_step(s.step);
  auto* sh = req.mutable_shard();
  sh->set_rank(s.rank);
  sh->set_path(s.path);
  sh->set_bytes(s.bytes);
  sh->set_sha256(s.sha256);
  v1::ReportShardResponse resp;
  const bool short_try = impl_->shards_unreachable.load();
  Duration timeout = short_try ? std::min<Duration>(Impl::kShortTry, impl_->options.rpc_timeout) : impl_->options.rpc_timeout;
  try {
    impl_->call(&v1::Coordinator::Stub::ReportShard, req, &resp, Deadline::after(timeout),
                fmt::format("shard report of rank {} step {} (job '{}'){}", s.rank, s.step, job_id,
                            short_try ? " (one short try: the previous report found the coordinator unreachable)"
                                      : ""));
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kRemote || e.kind() == ErrorKind::kTimeout) impl_->shards_unreachable = true;
    throw;
  }
  impl_->shards_unreachable = false;
  return resp.last_committed_step();
}

void CoordinatorClient::barrier(const std::string& job_id, int64_t generation, const std::string& name, int rank,
                                int world_size, Deadline deadline) {
  v1::BarrierRequest req;
  req.set_job_id(job_id);
  req.set_generation(generation);
  req.set_name(name);
  req.set_rank(rank);
  req.set_world_size(world_size);
  v1::BarrierResponse resp;
  impl_->call_with_retry(
      fmt::format("barrier '{}' of rank {} (job '{}')", name, rank, job_id), deadline,
      [&](grpc::ClientContext& ctx) {
        req.set_timeout_ms(to_ms(deadline.remaining()));
        return impl_->stub()->Barrier(&ctx, req, &resp);
      },
      Impl::kWaitGrace);
}

}  // namespace trn::control
