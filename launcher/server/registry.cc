// Registry: jobs, rendezvous, generations, heartbeats and events. Key-value store and barriers
// are in registry_kv.cc; checkpoints, status and snapshots in registry_state.cc.
#include "launcher/server/registry.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <shared_mutex>

#include "collectives/core/log.h"
#include "launcher/client/coordinator_client.h"
#include "launcher/client/status_report.h"
#include "launcher/server/job.h"
#include "launcher/server/tokens.h"
#include "launcher/server/validate.h"

namespace trn::control {

using log::Subsys;

const char* to_string(Code code) {
  switch (code) {
    case Code::kOk: return "OK";
    case Code::kInvalidArgument: return "INVALID_ARGUMENT";
    case Code::kNotFound: return "NOT_FOUND";
    case Code::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case Code::kAborted: return "ABORTED";
    case Code::kFailedPrecondition: return "FAILED_PRECONDITION";
    case Code::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case Code::kUnavailable: return "UNAVAILABLE";
  }
  return "?";
}

const char* to_string(JobState s) {
  switch (s) {
    case JobState::kForming: return "forming";
    case JobState::kRunning: return "running";
    case JobState::kCompleted: return "completed";
    case JobState::kFailed: return "failed";
    case JobState::kStopped: return "stopped";
  }
  return "?";
}

size_t Registry::Job::waiters() const {
  size_t n = 0;
  for (const auto& [_, j] : pending) n += j.waiters.size();
  for (const auto& [_, w] : get_waiters) n += w.size();
  for (const auto& [_, b] : barriers) n += b.arrived.size();
  return n;
}

// A fresh run id: 16 hex digits from the system's random source.
static std::string new_run_id() {
  std::random_device rd;
  uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return fmt::format("{:016x}", v);
}

static int64_t unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void Registry::Job::index_ranks() {
  world_size = 0;
  rank_node.clear();
  for (const auto& m : members) {
    world_size += m.nproc();
    rank_node.insert(rank_node.end(), static_cast<size_t>(m.nproc()), m.node_rank());
  }
  workers.clear();
  workers.resize(static_cast<size_t>(world_size));
}

Registry::Registry(RegistryOptions options) : options_(std::move(options)) {
  if (!options_.unix_ms) options_.unix_ms = [] { return unix_ms(); };
}
Registry::~Registry() = default;

void Registry::run(Fired& fired) {
  for (auto& f : fired) f();
  fired.clear();
}

Registry::Job* Registry::find_job(const std::string& id) {
  auto it = jobs_.find(id);
  return it == jobs_.end() ? nullptr : it->second.get();
}

Status Registry::check_generation(const std::string& job_id, int64_t generation, Job** out) {
  if (auto s = validate_job_id(job_id); !s.ok()) return s;
  Job* job = find_job(job_id);
  if (!job)
    return Status::Make(Code::kNotFound,
                        fmt::format("job '{}' is unknown to this coordinator; join it first", job_id));
  if (job->state == JobState::kStopped)
    return Status::Make(Code::kAborted, fmt::format("job '{}' was stopped by its user ({}); stop", job_id, job->failure));
  if (generation < job->generation)
    return Status::Make(Code::kAborted,
                        fmt::format("job '{}' moved on to generation {} (this call is from generation "
                                    "{}); stop and re-join",
                                    job_id, job->generation, generation));
  if (generation > job->generation)
    return Status::Make(Code::kInvalidArgument,
                        fmt::format("job '{}' has no generation {} yet (current: {})", job_id,
                                    generation, job->generation));
  *out = job;
  return Status::Ok();
}

void Registry::emit(Job& job, v1::Event::Kind kind, const std::string& detail, int64_t step) {
  v1::Event ev;
  ev.set_seq(next_seq_++);
  ev.set_unix_ms(unix_ms());
  ev.set_job_id(job.id);
  ev.set_kind(kind);
  ev.set_generation(job.generation);
  ev.set_detail(detail);
  ev.set_step(step);
  log::info(Subsys::kCoord, "job {} gen {}: {} {}", job.id, job.generation, v1::Event::Kind_Name(kind),
            detail);
  recent_events_.push_back(ev);
  if (recent_events_.size() > 1024) recent_events_.pop_front();
  for (auto it = subscribers_.begin(); it != subscribers_.end();) {
    bool keep = !(it->second.job_id.empty() || it->second.job_id == job.id) || it->second.fn(ev);
    it = keep ? std::next(it) : subscribers_.erase(it);
  }
}

void Registry::subscribe(const std::string& job_id, bool replay, std::function<bool(const v1::Event&)> fn) {
  std::lock_guard lock(mu_);
  if (replay)
    for (const auto& ev : recent_events_)
      if ((job_id.empty() || ev.job_id() == job_id) && !fn(ev)) return;
  subscribers_[next_subscriber_++] = Subscriber{job_id, std::move(fn)};
}

int64_t Registry::wall_ms() const { return options_.unix_ms(); }

void Registry::persist_job(Job& job) {
  kv_dirty_.erase(job.id);
  if (!options_.persist) return;
  v1::LogRecord rec;
  rec.set_next_event_seq(next_seq_);
  save_job(job, rec.mutable_job());
  options_.persist(rec);
}

void Registry::flush() {
  std::lock_guard lock(mu_);
  for (auto it = kv_dirty_.begin(); it != kv_dirty_.end();) {
    Job* job = find_job(*it++);
    if (job) persist_job(*job);
  }
  kv_dirty_.clear();
  last_kv_save_ = options_.now();
}

bool Registry::finished(const Job& job) const {
  if (job.state == JobState::kCompleted || job.state == JobState::kFailed || job.state == JobState::kStopped)
    return true;
  return job.state == JobState::kForming && job.pending.empty() && job.ended_unix_ms > 0;
}

void Registry::reindex(Job& job) {
  if (job.indexed_ended >= 0) finished_.erase({job.indexed_ended, job.id});
  job.indexed_ended = -1;
  if (!finished(job)) return;
  job.indexed_ended = job.ended_unix_ms;
  finished_.insert({job.indexed_ended, job.id});
}

void Registry::ensure_token(Job& job) {
  if (options_.job_token_key.empty()) return;
  if (job.token_nonce.empty()) job.token_nonce = random_hex(32);
  if (job.token.empty()) {
    job.token = derive_job_token(options_.job_token_key, job.id, job.token_nonce);
    job_tokens_[token_digest(job.token)] = job.id;
  }
}

std::optional<std::string> Registry::job_of_token(const std::string& token) {
  if (options_.job_token_key.empty() || token.empty()) return std::nullopt;
  const std::string digest = token_digest(token);
  std::shared_lock lock(mu_);
  auto it = job_tokens_.find(digest);
  if (it == job_tokens_.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> Registry::job_token(const std::string& job_id) {
  std::shared_lock lock(mu_);
  const Job* job = find_job(job_id);
  if (!job) return std::nullopt;
  return job->token;
}

void Registry::remove_job(const std::string& id, const char* why) {
  log::info(Subsys::kCoord, "job {}: removed ({})", id, why);
  if (Job* job = find_job(id)) {
    if (!job->token.empty()) job_tokens_.erase(token_digest(job->token));
    if (job->indexed_ended >= 0) finished_.erase({job->indexed_ended, id});
  }
  jobs_.erase(id);
  kv_dirty_.erase(id);
  if (!options_.persist) return;
  v1::LogRecord rec;
  rec.set_next_event_seq(next_seq_);
  rec.set_removed_job(id);
  options_.persist(rec);
}

// Removes finished jobs past the retention, then the oldest beyond max_finished_jobs, then (when
// a new job needs room) the oldest one left. finished_ is ordered oldest first, so this visits
// only the jobs it removes.
void Registry::expire_jobs(bool need_room) {
  int64_t now = wall_ms();
  int64_t keep_ms = std::chrono::duration_cast<std::chrono::milliseconds>(options_.job_retention).count();
  while (!finished_.empty()) {
    auto [ended, id] = *finished_.begin();
    bool old = now - ended > keep_ms;
    bool over = finished_.size() > options_.max_finished_jobs;
    bool room = need_room && jobs_.size() >= options_.limits.max_jobs;
    if (!old && !over && !room) break;
    remove_job(id, old    ? "finished longer than --job-retention ago"
                   : over ? "more finished jobs than --max-finished-jobs"
                          : "room for a new job");
    finished_.erase({ended, id});  // gone whatever the job said of it, so the loop moves on
  }
}

// ---- rendezvous ----

void Registry::join(const v1::JoinRequest& req, Done<v1::JoinResponse> done) {
  if (auto s = validate_join(req, options_.limits); !s.ok()) return done(s, {});
  Fired fired;
  {
    std::lock_guard lock(mu_);
    if (closed_) return done(Status::Make(Code::kUnavailable, "the coordinator is shutting down"), {});
    Job* job = find_job(req.job_id());
    if (!job) {
      if (jobs_.size() >= options_.limits.max_jobs) expire_jobs(/*need_room=*/true);
      if (jobs_.size() >= options_.limits.max_jobs)
        return done(Status::Make(Code::kResourceExhausted,
                                 fmt::format("the coordinator already holds {} jobs (its limit), none of them "
                                             "finished",
                                             jobs_.size())),
                    {});
      auto j = std::make_unique<Job>();
      j->id = req.job_id();
      job = j.get();
      jobs_[req.job_id()] = std::move(j);
      ensure_token(*job);
    }
    if (job->state == JobState::kCompleted)
      return done(Status::Make(Code::kFailedPrecondition,
                               fmt::format("job '{}' already completed; use a new job id", job->id)),
                  {});
    if (job->state == JobState::kFailed)
      return done(Status::Make(Code::kFailedPrecondition,
                               fmt::format("job '{}' failed ({}); use a new job id", job->id, job->failure)),
                  {});
    if (job->state == JobState::kStopped) {
      // The stopped run's own nodes stop with it; anyone else (a new trnrun) starts a new run.
      if (job->last_member_ids.count(req.node_id()))
        return done(Status::Make(Code::kFailedPrecondition,
                                 fmt::format("job '{}' was stopped by its user ({}); this node stops too",
                                             job->id, job->failure)),
                    {});
      job->state = JobState::kForming;
      job->generation++;
      job->failure.clear();
      persist_job(*job);  // a restart must not bring the stopped run back, nor its generation
    }
    if (job->state == JobState::kRunning) {
      bool member = false;
      for (const auto& m : job->members) member |= m.node_id() == req.node_id();
      // A fixed-size job whose members all heartbeat has no place for another node: refused
      // now, rather than left waiting until the join's timeout for a round only a failure would
      // start (almost always a second run given the same job id by mistake). When a member has
      // gone silent, the node may be its replacement (a node restarted before the heartbeat
      // timeout noticed the old one): it waits for the round that timeout starts. An elastic
      // job takes the node: it ends the generation when it has room, or keeps it as a spare.
      if (!member && job->min_nodes == job->max_nodes && static_cast<int>(job->members.size()) >= job->max_nodes &&
          !member_silent(*job, options_.now()))
        return done(Status::Make(Code::kFailedPrecondition,
                                 fmt::format("job '{}' is already running (generation {}, all {} of its {} "
                                             "node{}), so node '{}' cannot join it; give this run another job id, "
                                             "or start it once that job has ended",
                                             job->id, job->generation, job->members.size(), job->max_nodes,
                                             job->max_nodes == 1 ? "" : "s", req.node_id())),
                    {});
      for (const auto& m : job->members) {
        if (m.node_id() != req.node_id()) continue;
        v1::JoinResponse r;  // a repeated join of a member: same answer
        r.set_generation(job->generation);
        r.set_run_id(job->run_id);
        r.set_job_token(job->token);
        r.set_node_rank(m.node_rank());
        r.set_nnodes(static_cast<int>(job->members.size()));
        r.set_world_size(job->world_size);
        r.set_rank_offset(m.rank_offset());
        if (!req.omit_members())
          for (const auto& mm : job->members) *r.add_members() = mm;
        return done(Status::Ok(), r);
      }
    }
    if (!job->pending.empty() || job->state == JobState::kForming) {
      bool fresh = job->pending.empty() && job->state == JobState::kForming;
      if (!fresh && (req.min_nodes() != job->min_nodes || req.max_nodes() != job->max_nodes))
        return done(Status::Make(Code::kInvalidArgument,
                                 fmt::format("node '{}' asks for {}..{} nodes but job '{}' is "
                                             "rendezvousing with {}..{}; give every node the same "
                                             "node counts",
                                             req.node_id(), req.min_nodes(), req.max_nodes(), job->id,
                                             job->min_nodes, job->max_nodes)),
                    {});
    }
    if (job->pending.empty() && job->state == JobState::kForming) {
      job->min_nodes = req.min_nodes();
      job->max_nodes = req.max_nodes();
      job->settle_ms = req.settle_ms();
    }
    auto now = options_.now();
    auto& joiner = job->pending[req.node_id()];
    bool is_new = joiner.waiters.empty() && joiner.order == 0;
    joiner.req = req;
    if (is_new) joiner.order = ++job->join_order;
    joiner.waiters.push_back(
        {next_waiter_++, now + std::chrono::milliseconds(req.timeout_ms()), std::move(done)});
    job->last_join = now;
    if (is_new)
      emit(*job, v1::Event::JOINED,
           fmt::format("node {} ({}, {} procs): {} pending, min {} max {}", req.node_id(), req.host(),
                       req.nproc_per_node(), job->pending.size(), job->min_nodes, job->max_nodes));
    if (job->state == JobState::kRunning && is_new &&
        static_cast<int>(job->members.size()) < job->max_nodes)
      end_generation(*job, fmt::format("membership change: node {} joined", req.node_id()), fired);
    try_complete_round(*job, fired);
    reindex(*job);
  }
  run(fired);
}

bool Registry::member_silent(const Job& job, Clock::time_point now) const {
  const auto silent = std::max<Duration>(options_.heartbeat_timeout / 3, std::chrono::seconds(1));
  for (size_t i = 0; i < job.members.size(); ++i) {
    if (job.finished.count(static_cast<int>(i))) continue;
    if ((job.restored && job.node_unknown[i]) || now - job.node_seen[i] > silent) return true;
  }
  return false;
}

void Registry::try_complete_round(Job& job, Fired& fired) {
  if (job.state != JobState::kForming) return;
  int n = static_cast<int>(job.pending.size());
  if (n < job.min_nodes || n == 0) return;
  bool settled = options_.now() - job.last_join >= std::chrono::milliseconds(job.settle_ms);
  if (n < job.max_nodes && !settled) return;

  // Take up to max_nodes joiners in join order, then rank them by node id (returning nodes below).
  std::vector<std::map<std::string, Job::Joiner>::iterator> chosen;
  for (auto it = job.pending.begin(); it != job.pending.end(); ++it) chosen.push_back(it);
  std::sort(chosen.begin(), chosen.end(), [](auto a, auto b) { return a->second.order < b->second.order; });
  if (static_cast<int>(chosen.size()) > job.max_nodes) chosen.resize(job.max_nodes);
  std::sort(chosen.begin(), chosen.end(), [](auto a, auto b) { return a->first < b->first; });

  bool continues = false;
  for (const auto& it : chosen) continues |= job.last_member_ids.count(it->first) > 0;
  if (!continues || job.run_id.empty()) {
    job.run_id = new_run_id();
    job.recovery.reset();  // a new run counts its own recoveries
  }
  job.last_member_ids.clear();
  for (const auto& it : chosen) job.last_member_ids.insert(it->first);
  // Nodes of the last generation that ran keep their node rank (survivors recovering in place
  // keep their ranks); the others take the free ranks in node id order.
  {
    const size_t n = chosen.size();
    std::vector<std::map<std::string, Job::Joiner>::iterator> slots(n, job.pending.end());
    std::vector<std::map<std::string, Job::Joiner>::iterator> rest;
    for (const auto& it : chosen) {
      auto last = job.last_node_rank.find(it->first);
      if (last != job.last_node_rank.end() && size_t(last->second) < n && slots[size_t(last->second)] == job.pending.end())
        slots[size_t(last->second)] = it;
      else
        rest.push_back(it);
    }
    size_t next = 0;
    for (auto& slot : slots)
      if (slot == job.pending.end()) slot = rest[next++];
    chosen = std::move(slots);
  }
  job.last_node_rank.clear();
  for (size_t i = 0; i < chosen.size(); ++i) job.last_node_rank[chosen[i]->first] = static_cast<int>(i);

  job.members.clear();
  job.workers.clear();
  job.finished.clear();
  int offset = 0;
  for (size_t i = 0; i < chosen.size(); ++i) {
    const auto& req = chosen[i]->second.req;
    v1::Member m;
    m.set_node_rank(static_cast<int>(i));
    m.set_node_id(req.node_id());
    m.set_host(req.host());
    m.set_nproc(req.nproc_per_node());
    m.set_rank_offset(offset);
    offset += req.nproc_per_node();
    job.members.push_back(m);
  }
  job.index_ranks();
  auto now = options_.now();
  job.node_seen.assign(job.members.size(), now);
  job.node_datagram_seq.assign(job.members.size(), 0);
  job.restored = false;
  job.node_unknown.clear();
  job.ended_unix_ms = 0;
  job.state = JobState::kRunning;

  v1::JoinResponse base, with_members;
  base.set_generation(job.generation);
  base.set_nnodes(static_cast<int>(job.members.size()));
  base.set_world_size(job.world_size);
  base.set_run_id(job.run_id);
  ensure_token(job);  // a job restored from a trn that predates job tokens gets one here, saved below
  base.set_job_token(job.token);
  with_members = base;
  for (const auto& m : job.members) *with_members.add_members() = m;
  for (size_t i = 0; i < chosen.size(); ++i) {
    v1::JoinResponse r = chosen[i]->second.req.omit_members() ? base : with_members;
    r.set_node_rank(static_cast<int>(i));
    r.set_rank_offset(job.members[i].rank_offset());
    for (auto& w : chosen[i]->second.waiters)
      fired.push_back([d = std::move(w.done), r] { d(Status::Ok(), r); });
    job.pending.erase(chosen[i]);
  }
  emit(job, v1::Event::GENERATION_STARTED,
       fmt::format("{} nodes, world size {}", job.members.size(), job.world_size));
  persist_job(job);
}

void Registry::end_generation(Job& job, const std::string& cause, Fired& fired) {
  if (job.state == JobState::kCompleted || job.state == JobState::kFailed || job.state == JobState::kStopped) return;
  int64_t old = job.generation;
  emit(job, v1::Event::GENERATION_ENDED, cause);
  job.generation++;
  job.restarts++;
  v1::Restart r;
  r.set_generation(job.generation);
  r.set_cause(cause);
  r.set_unix_ms(wall_ms());
  job.history.push_back(r);
  if (job.history.size() > 100) job.history.pop_front();
  job.state = JobState::kForming;
  job.ended_unix_ms = r.unix_ms();
  clear_generation(job, Status::Make(Code::kAborted,
                                     fmt::format("job '{}' moved on from generation {} ({}); stop and re-join",
                                                 job.id, old, cause)),
                   fired);
  // Spare nodes that were waiting form the next round, which takes its sizes from them; the
  // settle time restarts so the members of the ended generation can re-join in time.
  job.last_join = options_.now();
  if (!job.pending.empty()) {
    const auto& first = job.pending.begin()->second.req;
    job.min_nodes = first.min_nodes();
    job.max_nodes = first.max_nodes();
    job.settle_ms = first.settle_ms();
  }
  persist_job(job);
}

// The user stopped the job: no restart is counted and the generation number stays; its calls
// fail (check_generation) and its nodes are told to stop (heartbeat).
void Registry::stop_job(Job& job, const std::string& cause, Fired& fired) {
  emit(job, v1::Event::FINISHED, "job stopped by its user: " + cause);
  job.state = JobState::kStopped;
  job.failure = cause;
  job.ended_unix_ms = wall_ms();
  Status stopped =
      Status::Make(Code::kAborted, fmt::format("job '{}' was stopped by its user ({}); stop", job.id, cause));
  clear_generation(job, stopped, fired);
  Status refused = Status::Make(Code::kFailedPrecondition,
                                fmt::format("job '{}' was stopped by its user ({})", job.id, cause));
  for (auto& [_, j] : job.pending)
    for (auto& w : j.waiters) fired.push_back([d = std::move(w.done), refused] { d(refused, {}); });
  job.pending.clear();
  persist_job(job);
}

void Registry::clear_generation(Job& job, const Status& aborted, Fired& fired) {
  job.members.clear();
  job.node_seen.clear();
  job.node_datagram_seq.clear();
  job.node_unknown.clear();
  job.restored = false;
  job.workers.clear();
  job.finished.clear();
  job.world_size = 0;
  job.rank_node.clear();
  job.collecting.clear();
  job.kv.clear();
  job.kv_bytes = 0;
  job.add_results.clear();
  job.add_order.clear();
  for (auto& [_, ws] : job.get_waiters)
    for (auto& w : ws) fired.push_back([d = std::move(w.done), aborted] { d(aborted, {}); });
  job.get_waiters.clear();
  for (auto& [_, b] : job.barriers)
    for (auto& [__, w] : b.arrived) fired.push_back([d = std::move(w.done), aborted] { d(aborted, false); });
  job.barriers.clear();
}

// ---- heartbeats, failures, finish ----

Status Registry::heartbeat(const v1::HeartbeatRequest& req, v1::HeartbeatResponse* reply, uint64_t datagram_seq) {
  if (auto s = validate_job_id(req.job_id()); !s.ok()) return s;
  if (req.host().size() > 256) return Status::Make(Code::kInvalidArgument, "host is longer than 256 characters");
  if (auto s = validate_text("host", req.host()); !s.ok()) return s;
  heartbeats_total_.fetch_add(1, std::memory_order_relaxed);
  const v1::RecoveryStatus* new_recovery = nullptr;
  {
    std::shared_lock lock(mu_);
    Job* job = find_job(req.job_id());
    if (!job) {
      reply->set_abort(true);
      reply->set_reason(fmt::format("job '{}' is unknown to this coordinator", req.job_id()));
      return Status::Ok();
    }
    reply->set_generation(job->generation);
    if (req.generation() > job->generation)
      return Status::Make(Code::kInvalidArgument,
                          fmt::format("job '{}' has no generation {} yet", job->id, req.generation()));
    if (job->state == JobState::kStopped) {
      reply->set_abort(true);
      reply->set_stopped(true);
      reply->set_reason("the job was stopped by its user: " + job->failure);
      return Status::Ok();
    }
    if (req.generation() < job->generation) {
      reply->set_abort(true);
      std::string cause = "generation moved on";
      for (const auto& h : job->history)
        if (h.generation() == req.generation() + 1) cause = h.cause();
      reply->set_reason(cause);
      return Status::Ok();
    }
    if (job->state != JobState::kRunning) return Status::Ok();
    auto now = options_.now();
    if (req.kind() == v1::HeartbeatRequest::NODE) {
      Status s = node_heartbeat(*job, req, now, datagram_seq, &new_recovery);
      if (!s.ok() || !new_recovery) return s;
    } else {
      if (datagram_seq != 0)
        return Status::Make(Code::kInvalidArgument, "only a NODE heartbeat may come as a datagram");
      if (!req.ranks().empty())
        return Status::Make(Code::kInvalidArgument,
                            "a WORKER heartbeat carries no ranks; only a NODE heartbeat does");
      if (req.rank() < 0 || req.rank() >= job->world_size)
        return Status::Make(Code::kInvalidArgument,
                            fmt::format("rank {} is out of range: job '{}' has world size {}", req.rank(),
                                        job->id, job->world_size));
      if (auto s = validate_coordinates(req.rank(), req.has_coordinates() ? &req.coordinates() : nullptr);
          !s.ok())
        return s;
      RankBeat beat{req.rank(),
                    req.pid(),
                    req.step(),
                    req.loss(),
                    req.tokens_per_s(),
                    req.has_coordinates() ? &req.coordinates() : nullptr,
                    1,
                    req.has_val_loss() ? std::optional<double>(req.val_loss()) : std::nullopt,
                    req.has_recovery() ? &req.recovery() : nullptr,
                    req.has_moe() ? &req.moe() : nullptr};
      std::lock_guard node_lock(stripe(job->rank_node[req.rank()]));
      if (!record_rank(*job, beat, req.host(), now)) return Status::Ok();
      new_recovery = &req.recovery();
    }
  }
  // Rank 0 reported a new recovery count: an event and a save, under the exclusive lock, if the
  // generation is still the one the heartbeat belongs to.
  std::lock_guard lock(mu_);
  Job* job = find_job(req.job_id());
  if (job && job->generation == req.generation() && job->state == JobState::kRunning)
    record_recovery(*job, *new_recovery);
  return Status::Ok();
}

Status Registry::validate_coordinates(int rank, const v1::Coordinates* c) {
  if (c && (c->dp_rank() < 0 || c->tp_rank() < 0 || c->pp_rank() < 0))
    return Status::Make(Code::kInvalidArgument,
                        fmt::format("rank {} reports coordinates dp {} tp {} pp {}; none may be negative", rank,
                                    c->dp_rank(), c->tp_rank(), c->pp_rank()));
  return Status::Ok();
}

// A node agent's heartbeat: the node is alive, and each entry is one of its ranks' heartbeats,
// heard age_ms ago. Every entry is checked before any is applied, so a bad one changes nothing.
Status Registry::node_heartbeat(Job& job, const v1::HeartbeatRequest& req, Clock::time_point now,
                                uint64_t datagram_seq, const v1::RecoveryStatus** new_recovery) {
  const int node = req.rank();
  if (node < 0 || node >= static_cast<int>(job.members.size()))
    return Status::Make(Code::kInvalidArgument, fmt::format("node rank {} is out of range: job '{}' has {} nodes",
                                                            node, job.id, job.members.size()));
  const auto& m = job.members[node];
  const int first = m.rank_offset(), count = m.nproc();
  std::vector<bool> seen(static_cast<size_t>(count), false);
  for (const auto& e : req.ranks()) {
    if (e.rank() < first || e.rank() >= first + count)
      return Status::Make(Code::kInvalidArgument,
                          fmt::format("node {} of job '{}' forwards rank {}, which is not one of its ranks {}..{}",
                                      node, job.id, e.rank(), first, first + count - 1));
    if (seen[e.rank() - first])
      return Status::Make(Code::kInvalidArgument,
                          fmt::format("node {} forwards rank {} twice in one heartbeat", node, e.rank()));
    seen[e.rank() - first] = true;
    if (e.age_ms() < 0 || e.age_ms() > options_.limits.max_wait_ms)
      return Status::Make(Code::kInvalidArgument, fmt::format("rank {}: age_ms {} is out of range (0..{})", e.rank(),
                                                              e.age_ms(), options_.limits.max_wait_ms));
    if (e.beats() < 0)
      return Status::Make(Code::kInvalidArgument, fmt::format("rank {}: beats {} is negative", e.rank(), e.beats()));
    if (auto s = validate_coordinates(e.rank(), e.has_coordinates() ? &e.coordinates() : nullptr); !s.ok())
      return s;
  }
  std::lock_guard node_lock(stripe(node));
  if (datagram_seq != 0) {
    if (datagram_seq <= job.node_datagram_seq[node])
      return Status::Make(Code::kFailedPrecondition,
                          fmt::format("node {} heartbeat datagram {} is not newer than {} (a replay, or out of order)",
                                      node, datagram_seq, job.node_datagram_seq[node]));
    job.node_datagram_seq[node] = datagram_seq;
  } else {
    // A gRPC call standing in for an unanswered datagram: that datagram, arriving late, is old.
    job.node_datagram_seq[node] = std::max(job.node_datagram_seq[node], req.datagram_seq());
  }
  job.node_seen[node] = now;
  if (job.restored) job.node_unknown[node] = 0;
  for (const auto& e : req.ranks()) {
    if (e.silent()) {
      // Not a heartbeat: the rank's process was alive age_ms ago. For a rank not heard in this
      // generation that starts its heartbeat timeout; a heard one is judged by its heartbeats.
      auto& w = job.workers[static_cast<size_t>(e.rank())];
      if (w.status.heartbeats() == 0) {
        w.seen = std::max(w.seen, now - std::chrono::milliseconds(e.age_ms()));
        w.status.set_rank(e.rank());
        if (w.status.host() != req.host()) w.status.set_host(req.host());
        w.status.set_pid(e.pid());
      }
      continue;
    }
    RankBeat beat{e.rank(),  e.pid(), e.step(), e.loss(), e.tokens_per_s(),
                  e.has_coordinates() ? &e.coordinates() : nullptr, std::max(1, e.beats()),
                  e.has_val_loss() ? std::optional<double>(e.val_loss()) : std::nullopt,
                  e.has_recovery() ? &e.recovery() : nullptr, e.has_moe() ? &e.moe() : nullptr};
    if (record_rank(job, beat, req.host(), now - std::chrono::milliseconds(e.age_ms())))
      *new_recovery = &e.recovery();
  }
  return Status::Ok();
}

// A report that cannot be true (a negative count, a negative or non-finite duration, a goodput
// outside 0..1) is a bug in the reporter: it is ignored rather than failing the heartbeat, which
// would end the generation over a figure.
static bool plausible(const v1::RecoveryStatus& r) {
  auto seconds = [](double s) { return std::isfinite(s) && s >= 0; };
  return r.recoveries() >= 0 && r.restored_step() >= 0 && r.steps_lost() >= 0 && r.steps_lost_total() >= 0 &&
         r.replaced() >= 0 && seconds(r.detect_to_generation_s()) && seconds(r.detect_to_restored_s()) &&
         seconds(r.detect_to_first_step_s()) &&
         (!r.has_goodput() || (std::isfinite(r.goodput()) && r.goodput() >= 0 && r.goodput() <= 1));
}

// An MoE report the coordinator keeps: bounded (MoeStatus) and every figure a possible one. Any
// other is a bug in the reporter and is ignored, never failing the heartbeat.
static bool plausible(const v1::MoeStatus& m) {
  auto figure = [](double v) { return std::isfinite(v) && v >= 0; };
  if (m.max_mean_size() > static_cast<int>(kMaxMoeLayers) || m.max_mean_size() != m.dead_experts_size() ||
      !figure(m.aux_loss()) || !figure(m.dropped()))
    return false;
  return std::all_of(m.max_mean().begin(), m.max_mean().end(), figure) &&
         std::all_of(m.dead_experts().begin(), m.dead_experts().end(), [](int32_t d) { return d >= 0; });
}

// One rank's heartbeat, heard at `at`, under its node's stripe. A heartbeat older than one
// already recorded (a forwarded one that raced a direct one) updates the progress but never makes
// the rank look older. Rank 0's recovery figures are kept here while their count stays the same;
// a new count, or a report that cannot be true, returns true for record_recovery.
bool Registry::record_rank(Job& job, const RankBeat& b, const std::string& host, Clock::time_point at) {
  auto& w = job.workers[static_cast<size_t>(b.rank)];
  w.seen = std::max(w.seen, at);
  auto& st = w.status;
  st.set_rank(b.rank);
  if (st.host() != host) st.set_host(host);
  st.set_pid(b.pid);
  st.set_step(b.step);
  st.set_loss(b.loss);
  st.set_tokens_per_s(b.tokens_per_s);
  st.set_heartbeats(st.heartbeats() + b.beats);
  if (b.coordinates) *st.mutable_coordinates() = *b.coordinates;
  if (b.val_loss) st.set_val_loss(*b.val_loss);
  if (b.rank == 0 && b.moe && plausible(*b.moe)) {
    w.moe = *b.moe;
    w.moe->DiscardUnknownFields();
  }
  int node = job.rank_node[static_cast<size_t>(b.rank)];
  job.node_seen[node] = std::max(job.node_seen[node], at);
  if (job.restored) job.node_unknown[node] = 0;
  if (b.rank != 0 || !b.recovery) return false;
  const int64_t before = job.recovery ? job.recovery->recoveries() : 0;
  if (!plausible(*b.recovery) || b.recovery->recoveries() != before) return true;
  job.recovery = *b.recovery;
  job.recovery->DiscardUnknownFields();  // as record_recovery() keeps it
  return false;
}

void Registry::record_recovery(Job& job, const v1::RecoveryStatus& r) {
  if (!plausible(r)) {
    // Every heartbeat carries it: one warning per job, the rest at debug level.
    log::emit(Subsys::kCoord, job.bad_recovery_logged ? spdlog::level::debug : spdlog::level::warn,
              "job {} gen {}: rank 0 reported an impossible recovery ({}); ignored", job.id, job.generation,
              r.ShortDebugString());
    job.bad_recovery_logged = true;
    return;
  }
  const int64_t before = job.recovery ? job.recovery->recoveries() : 0;
  job.recovery = r;
  // Only the fields this coordinator knows: the state log saves no others, and the state held
  // must be the state saved.
  job.recovery->DiscardUnknownFields();
  // Reports of one process arrive in order, so a different count is a recovery since the last
  // (a lower one: rank 0 started anew and counts from there).
  if (r.recoveries() == before) return;
  if (r.recoveries() > 0)
    emit(job, v1::Event::RECOVERED,
         fmt::format("recovery {} in generation {}: {}", r.recoveries(), job.generation, recovery_last(r)),
         r.restored_step());
  persist_job(job);
}

Status Registry::report_failure(const v1::ReportFailureRequest& req, v1::ReportFailureResponse* reply) {
  if (auto s = validate_job_id(req.job_id()); !s.ok()) return s;
  if (req.reason().size() > 4096)
    return Status::Make(Code::kInvalidArgument, "failure reason is longer than 4096 bytes");
  // The reason reaches other callers' messages, events and logs: one line, whatever was sent.
  const std::string reason = one_line(req.reason());
  Fired fired;
  {
    std::lock_guard lock(mu_);
    Job* job = nullptr;
    Status s = check_generation(req.job_id(), req.generation(), &job);
    if (s.code == Code::kAborted) {  // already moved on: nothing to do
      reply->set_generation(find_job(req.job_id())->generation);
      return Status::Ok();
    }
    if (!s.ok()) return s;
    if (job->state == JobState::kRunning && req.user_stop()) {
      stop_job(*job, reason, fired);
      reindex(*job);
    } else if (job->state == JobState::kRunning) {
      std::string cause = fmt::format("rank {} failed: {}", req.rank(), reason);
      emit(*job, v1::Event::FAILURE, cause);
      end_generation(*job, cause, fired);
      if (req.give_up()) {
        // The reporter will not re-join: nodes waiting for the next round would wait in vain.
        job->state = JobState::kFailed;
        job->failure = cause;
        Status failed = Status::Make(Code::kFailedPrecondition,
                                     fmt::format("job '{}' failed ({}); use a new job id", job->id, cause));
        for (auto& [_, j] : job->pending)
          for (auto& w : j.waiters) fired.push_back([d = std::move(w.done), failed] { d(failed, {}); });
        job->pending.clear();
        emit(*job, v1::Event::FINISHED, "job failed: " + cause);
        persist_job(*job);
      } else {
        try_complete_round(*job, fired);
      }
      reindex(*job);
    }
    reply->set_generation(job->generation);
  }
  run(fired);
  return Status::Ok();
}

Status Registry::finish(const v1::FinishRequest& req, v1::FinishResponse* reply) {
  std::lock_guard lock(mu_);
  Job* job = nullptr;
  if (auto s = check_generation(req.job_id(), req.generation(), &job); !s.ok()) return s;
  if (job->state == JobState::kCompleted) {
    reply->set_job_completed(true);
    return Status::Ok();
  }
  if (job->state != JobState::kRunning || req.node_rank() < 0 ||
      req.node_rank() >= static_cast<int>(job->members.size()))
    return Status::Make(Code::kInvalidArgument,
                        fmt::format("node rank {} is not a member of job '{}' generation {}",
                                    req.node_rank(), job->id, job->generation));
  if (job->finished.insert(req.node_rank()).second) {
    bool all = job->finished.size() == job->members.size();
    if (all) {
      job->state = JobState::kCompleted;
      job->ended_unix_ms = wall_ms();
    }
    emit(*job, v1::Event::FINISHED,
         fmt::format("node {} finished ({} of {}){}", req.node_rank(), job->finished.size(),
                     job->members.size(), all ? "; job completed" : ""));
    reindex(*job);
    persist_job(*job);
  }
  reply->set_job_completed(job->state == JobState::kCompleted);
  return Status::Ok();
}

// ---- time ----

void Registry::check_heartbeats(Job& job, Clock::time_point now, Fired& fired) {
  if (job.state != JobState::kRunning) return;
  auto timeout = options_.heartbeat_timeout;
  auto secs = [](Duration d) { return std::chrono::duration<double>(d).count(); };
  // Ranks first: their message names the process.
  for (size_t rank = 0; rank < job.workers.size(); ++rank) {
    const auto& w = job.workers[rank];
    if (w.seen == Clock::time_point{} || now - w.seen <= timeout) continue;  // unheard: judged with its node
    if (job.finished.count(job.rank_node[rank])) continue;
    return end_generation(job,
                          fmt::format("rank {} ({} pid {}) missed heartbeats for {:.1f} s", rank,
                                      w.status.host(), w.status.pid(), secs(now - w.seen)),
                          fired);
  }
  for (size_t i = 0; i < job.members.size(); ++i) {
    if (job.finished.count(static_cast<int>(i))) continue;
    if (now - job.node_seen[i] > timeout) {
      // A rank that had not reported yet when its node went silent is judged with its node;
      // the message names the node's ranks, so it reads like a rank's own.
      const auto& m = job.members[i];
      int first = -1, last = -1;
      for (int r = 0; r < static_cast<int>(job.rank_node.size()); ++r)
        if (job.rank_node[r] == static_cast<int>(i)) {
          if (first < 0) first = r;
          last = r;
        }
      const std::string ranks = first < 0 ? "" : first == last ? fmt::format(", rank {}", first)
                                                               : fmt::format(", ranks {}..{}", first, last);
      return end_generation(job,
                            fmt::format("node {} ({}{}) missed heartbeats for {:.1f} s", i, m.host(), ranks,
                                        secs(now - job.node_seen[i])),
                            fired);
    }
  }
}

void Registry::close() {
  Fired fired;
  {
    std::lock_guard lock(mu_);
    closed_ = true;
    Status s = Status::Make(Code::kUnavailable, "the coordinator stopped serving (shutting down, or no longer "
                                                "the leader); retry");
    v1::Event end;
    end.set_seq(-1);
    for (auto& [_, sub] : subscribers_) sub.fn(end);
    subscribers_.clear();
    for (auto& [_, job] : jobs_) {
      for (auto& [__, j] : job->pending)
        for (auto& w : j.waiters) fired.push_back([d = std::move(w.done), s] { d(s, {}); });
      job->pending.clear();
      for (auto& [__, ws] : job->get_waiters)
        for (auto& w : ws) fired.push_back([d = std::move(w.done), s] { d(s, {}); });
      job->get_waiters.clear();
      for (auto& [__, b] : job->barriers)
        for (auto& [___, w] : b.arrived) fired.push_back([d = std::move(w.done), s] { d(s, false); });
      job->barriers.clear();
    }
  }
  run(fired);
}

void Registry::reopen() {
  std::lock_guard lock(mu_);
  closed_ = false;
}

void Registry::tick() {
  Fired fired;
  {
    std::lock_guard lock(mu_);
    auto now = options_.now();
    // Heartbeat ages need no finer resolution than 0.1 s; waits and rounds get every tick.
    bool beats = now - last_heartbeat_check_ >= std::chrono::milliseconds(100);
    if (beats) last_heartbeat_check_ = now;
    for (auto& [_, job] : jobs_) {
      if (job->indexed_ended >= 0) continue;  // finished: nothing waits, nothing times out
      expire_waits(*job, now, fired);
      if (beats) check_heartbeats(*job, now, fired);
      try_complete_round(*job, fired);
      reindex(*job);
    }
    if (!kv_dirty_.empty() && now - last_kv_save_ >= std::chrono::milliseconds(200)) {
      for (const auto& id : std::vector<std::string>(kv_dirty_.begin(), kv_dirty_.end()))
        if (Job* job = find_job(id)) persist_job(*job);
      kv_dirty_.clear();
      last_kv_save_ = now;
    }
    if (now - last_expiry_ >= std::chrono::seconds(1)) {
      last_expiry_ = now;
      expire_jobs(/*need_room=*/false);
    }
  }
  run(fired);
}

}  // namespace trn::control
