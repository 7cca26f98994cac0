// Registry: the checkpoint registry, status reports, snapshots and restore.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <set>

#include "launcher/server/job.h"
#include "launcher/server/registry.h"
#include "launcher/server/validate.h"
#include "collectives/core/error.h"

namespace trn::control {

static int64_t ms(Duration d) { return std::chrono::duration_cast<std::chrono::milliseconds>(d).count(); }

Status Registry::report_shard(const v1::ReportShardRequest& req, v1::ReportShardResponse* reply) {
  const auto& sh = req.shard();
  if (req.step() < 0) return Status::Make(Code::kInvalidArgument, fmt::format("step {} is negative", req.step()));
  if (sh.path().empty() || sh.path().size() > 4096)
    return Status::Make(Code::kInvalidArgument, "shard path must have 1 to 4096 characters");
  if (sh.sha256().size() > 128) return Status::Make(Code::kInvalidArgument, "shard sha256 is too long");
  std::lock_guard lock(mu_);
  Job* job = nullptr;
  if (auto s = check_generation(req.job_id(), req.generation(), &job); !s.ok()) return s;
  if (job->state == JobState::kForming)
    return Status::Make(Code::kFailedPrecondition,
                        fmt::format("job '{}' generation {} has not started", job->id, job->generation));
  if (sh.rank() < 0 || sh.rank() >= job->world_size)
    return Status::Make(Code::kInvalidArgument, fmt::format("rank {} is out of range: world size is {}",
                                                            sh.rank(), job->world_size));
  bool already = false;
  for (const auto& c : job->committed) already |= c.step() == req.step();
  if (!already) {
    auto& shards = job->collecting[req.step()];
    shards[sh.rank()] = sh;
    if (static_cast<int>(shards.size()) == job->world_size) {
      v1::Checkpoint c;
      c.set_step(req.step());
      c.set_generation(job->generation);
      c.set_committed_unix_ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                                  std::chrono::system_clock::now().time_since_epoch())
                                  .count());
      for (auto& [_, s] : shards) *c.add_shards() = s;
      job->collecting.erase(req.step());
      job->committed.push_back(std::move(c));
      if (job->committed.size() > options_.limits.checkpoints_kept) job->committed.pop_front();
      if (req.step() > job->last_committed_step) job->last_committed_step = req.step();
      // Steps older than a committed one can no longer complete usefully.
      for (auto it = job->collecting.begin(); it != job->collecting.end();)
        it = it->first < req.step() ? job->collecting.erase(it) : std::next(it);
      emit(*job, v1::Event::CHECKPOINT_COMMITTED,
           fmt::format("step {} committed ({} shards)", req.step(), job->world_size), req.step());
      persist_job(*job);
    }
  }
  reply->set_last_committed_step(job->last_committed_step);
  return Status::Ok();
}

namespace {

constexpr int kDefaultPage = 1024, kMaxPage = 16384, kDefaultAttention = 10, kMaxAttention = 1000;

enum class Health { kHealthy, kLate, kStuck, kDead, kStarting, kUnknown, kFinished };

struct Thresholds {
  int64_t late_ms, stuck_ms, dead_ms;
  // age_ms < 0: never heard from.
  Health of(int64_t age_ms) const {
    if (age_ms < 0) return Health::kStarting;
    if (age_ms >= dead_ms) return Health::kDead;
    if (age_ms >= stuck_ms) return Health::kStuck;
    if (age_ms >= late_ms) return Health::kLate;
    return Health::kHealthy;
  }
};

void count(Health h, v1::HealthCounts* c) {
  switch (h) {
    case Health::kHealthy:
      c->set_healthy(c->healthy() + 1);
      break;
    case Health::kLate:
      c->set_late(c->late() + 1);
      break;
    case Health::kStuck:
      c->set_stuck(c->stuck() + 1);
      break;
    case Health::kDead:
      c->set_dead(c->dead() + 1);
      break;
    case Health::kStarting:
      c->set_starting(c->starting() + 1);
      break;
    case Health::kUnknown:
      c->set_unknown(c->unknown() + 1);
      break;
    case Health::kFinished:
      c->set_finished(c->finished() + 1);
      break;
  }
}

bool needs_attention(Health h) {
  return h == Health::kLate || h == Health::kStuck || h == Health::kDead || h == Health::kUnknown;
}

// The `n` most silent of (age_ms, index) pairs, oldest first; an unknown age (-1) after every
// known one.
std::vector<std::pair<int64_t, int>> most_silent(std::vector<std::pair<int64_t, int>> v, size_t n) {
  auto older = [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  };
  n = std::min(n, v.size());
  std::partial_sort(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(n), v.end(), older);
  v.resize(n);
  return v;
}

}  // namespace

int Registry::fill_status(const Job& job, const StatusView& view, v1::JobStatus* out) {
  const auto now = options_.now();
  const Thresholds t{view.late_ms, view.stuck_ms, view.dead_ms};
  out->set_job_id(job.id);
  out->set_generation(job.generation);
  out->set_state(to_string(job.state));
  out->set_world_size(job.world_size);
  out->set_nnodes(static_cast<int>(job.members.size()));
  out->set_min_nodes(job.min_nodes);
  out->set_max_nodes(job.max_nodes);
  out->set_pending_joiners(static_cast<int>(job.pending.size()));
  out->set_ended_unix_ms(job.ended_unix_ms);
  out->set_run_id(job.run_id);
  out->set_reason(job.failure);
  if (job.recovery) *out->mutable_recovery() = *job.recovery;
  out->set_restarts(job.restarts);
  for (const auto& h : job.history) *out->add_restart_history() = h;
  out->set_last_committed_step(job.last_committed_step);
  for (const auto& c : job.committed) {
    auto* o = out->add_checkpoints();
    o->set_step(c.step());
    o->set_generation(c.generation());
    o->set_committed_unix_ms(c.committed_unix_ms());
    o->set_shard_count(c.shards_size());
    uint64_t bytes = 0;
    for (const auto& sh : c.shards()) bytes += sh.bytes();
    o->set_total_bytes(bytes);
    if (view.checkpoint_shards) *o->mutable_shards() = c.shards();
    else if (c.shards_size() > 0) *o->add_shards() = c.shards(0);
  }

  // Nodes: their health, and those needing attention.
  auto node_status = [&](size_t i, v1::NodeStatus* n) {
    *n->mutable_member() = job.members[i];
    bool unknown = job.restored && job.node_unknown[i];
    n->set_heartbeat_unknown(unknown);
    n->set_heartbeat_age_ms(unknown ? -1 : ms(now - job.node_seen[i]));
    n->set_finished(job.finished.count(static_cast<int>(i)) > 0);
  };
  std::vector<std::pair<int64_t, int>> silent;
  for (size_t i = 0; i < job.members.size(); ++i) {
    const bool unknown = job.restored && job.node_unknown[i];
    const int64_t age = unknown ? -1 : ms(now - job.node_seen[i]);
    Health h = job.finished.count(static_cast<int>(i)) ? Health::kFinished
               : unknown                               ? Health::kUnknown
                                                       : t.of(age);
    count(h, out->mutable_node_health());
    if (needs_attention(h)) silent.emplace_back(age, static_cast<int>(i));
  }
  for (const auto& [_, i] : most_silent(std::move(silent), static_cast<size_t>(view.max_attention)))
    node_status(static_cast<size_t>(i), out->add_attention_nodes());

  // Ranks: health, progress, attention. A rank not heard from in this generation reports nothing.
  const bool ranks = job.state != JobState::kForming;
  auto worker_status = [&](int r, v1::WorkerStatus* w) {
    const auto& wk = job.workers[static_cast<size_t>(r)];
    if (wk.status.heartbeats() == 0) {
      w->set_rank(r);
      w->set_heartbeat_age_ms(-1);
      w->set_heartbeat_unknown(job.restored);
      w->set_host(job.members[static_cast<size_t>(job.rank_node[static_cast<size_t>(r)])].host());
      if (wk.status.pid()) w->set_pid(wk.status.pid());  // its agent named the process (silent entry)
      return;
    }
    *w = wk.status;
    w->set_heartbeat_age_ms(ms(now - wk.seen));
  };
  silent.clear();
  auto* p = out->mutable_progress();
  double loss_sum = 0;
  int loss_n = 0;
  for (int r = 0; ranks && r < job.world_size; ++r) {
    const auto& wk = job.workers[static_cast<size_t>(r)];
    const bool heard = wk.status.heartbeats() > 0;
    const int64_t age = heard ? ms(now - wk.seen) : -1;
    Health h = job.finished.count(job.rank_node[static_cast<size_t>(r)]) ? Health::kFinished
               : !heard && job.restored                                  ? Health::kUnknown
                                                                         : t.of(age);
    count(h, out->mutable_rank_health());
    if (needs_attention(h)) silent.emplace_back(age, r);
    if (!heard) continue;
    const auto& st = wk.status;
    if (p->reporting() == 0 || st.step() < p->min_step()) p->set_min_step(st.step());
    if (p->reporting() == 0 || st.step() > p->max_step()) p->set_max_step(st.step());
    p->set_reporting(p->reporting() + 1);
    if (std::isfinite(st.loss())) loss_sum += st.loss(), loss_n++;
    if (std::isfinite(st.tokens_per_s())) p->set_tokens_per_s(p->tokens_per_s() + st.tokens_per_s());
  }
  if (loss_n) p->set_mean_loss(loss_sum / loss_n);
  for (const auto& [_, r] : most_silent(std::move(silent), static_cast<size_t>(view.max_attention)))
    worker_status(r, out->add_attention_ranks());

  // The page: ranks [start, end) and the nodes holding them.
  const int start = std::min(view.rank_start, job.world_size);
  int end = start;
  if (view.max_ranks >= 0) {
    if (ranks) end = start + std::min(view.max_ranks, job.world_size - start);
    for (int r = start; r < end; ++r) worker_status(r, out->add_workers());
    // Nodes: those holding the listed ranks.
    size_t first = 0, last = 0;
    if (end > start) {
      first = static_cast<size_t>(job.rank_node[static_cast<size_t>(start)]);
      last = static_cast<size_t>(job.rank_node[static_cast<size_t>(end - 1)]) + 1;
    }
    for (size_t i = first; i < last; ++i) node_status(i, out->add_nodes());
  }
  out->set_next_rank(end);
  return end - start;
}

Status Registry::status(const std::string& job_id, v1::GetStatusResponse* reply) {
  v1::GetStatusRequest req;
  req.set_job_id(job_id);
  return status(req, reply);
}

Status Registry::status(const v1::GetStatusRequest& req, v1::GetStatusResponse* reply) {
  if (req.rank_start() < 0)
    return Status::Make(Code::kInvalidArgument, fmt::format("rank_start {} is negative", req.rank_start()));
  if (req.max_ranks() > kMaxPage)
    return Status::Make(Code::kInvalidArgument,
                        fmt::format("max_ranks {} is more than a page of {} ranks; page with rank_start",
                                    req.max_ranks(), kMaxPage));
  if (req.late_ms() < 0 || req.stuck_ms() < 0 || req.dead_ms() < 0)
    return Status::Make(Code::kInvalidArgument, "health thresholds must not be negative");
  if (req.max_attention() < 0 || req.max_attention() > kMaxAttention)
    return Status::Make(Code::kInvalidArgument, fmt::format("max_attention {} is out of range (0..{})",
                                                            req.max_attention(), kMaxAttention));
  StatusView view;
  view.rank_start = req.rank_start();
  view.max_ranks = req.max_ranks() == 0 ? kDefaultPage : req.max_ranks();
  view.dead_ms = req.dead_ms() ? req.dead_ms() : ms(options_.heartbeat_timeout);
  view.stuck_ms = std::min(req.stuck_ms() ? req.stuck_ms() : 10000, view.dead_ms);
  view.late_ms = std::min(req.late_ms() ? req.late_ms() : 3000, view.stuck_ms);
  view.max_attention = req.max_attention() ? req.max_attention() : kDefaultAttention;
  view.checkpoint_shards = req.checkpoint_shards();

  std::lock_guard lock(mu_);
  reply->set_heartbeat_timeout_ms(ms(options_.heartbeat_timeout));
  if (!req.job_id().empty()) {
    if (auto s = validate_job_id(req.job_id()); !s.ok()) return s;
    Job* job = find_job(req.job_id());
    if (!job)
      return Status::Make(Code::kNotFound, fmt::format("no job '{}' at this coordinator", req.job_id()));
    fill_status(*job, view, reply->add_jobs());
    return Status::Ok();
  }
  // Every job: one budget of listed ranks for the whole reply.
  int budget = kMaxPage;
  for (const auto& [_, job] : jobs_) {
    StatusView v = view;
    if (v.max_ranks >= 0) v.max_ranks = budget > 0 ? std::min(v.max_ranks, budget) : -1;
    budget -= fill_status(*job, v, reply->add_jobs());
  }
  return Status::Ok();
}

v1::Snapshot Registry::snapshot() {
  std::lock_guard lock(mu_);
  return snapshot_locked();
}

v1::Snapshot Registry::snapshot_locked() {
  v1::Snapshot snap;
  snap.set_next_event_seq(next_seq_);
  for (const auto& [_, job] : jobs_) save_job(*job, snap.add_jobs());
  return snap;
}

void save_job(const Registry::Job& job, v1::Snapshot::Job* j) {
  j->set_job_id(job.id);
  j->set_generation(job.generation);
  j->set_state(to_string(job.state));
  for (const auto& m : job.members) *j->add_members() = m;
  for (int f : job.finished) j->add_finished_nodes(f);
  for (const auto& h : job.history) *j->add_restart_history() = h;
  j->set_restarts(job.restarts);
  for (const auto& c : job.committed) *j->add_checkpoints() = c;
  j->set_min_nodes(job.min_nodes);
  j->set_max_nodes(job.max_nodes);
  j->set_ended_unix_ms(job.ended_unix_ms);
  j->set_run_id(job.run_id);
  j->set_token_nonce(job.token_nonce);
  for (const auto& id : job.last_member_ids) j->add_last_member_ids(id);
  j->set_reason(job.failure);
  if (job.recovery) *j->mutable_recovery() = *job.recovery;
  for (const auto& [k, v] : job.kv) {
    auto* kv = j->add_kv();
    kv->set_generation(job.generation);
    kv->set_key(k);
    kv->set_value(v);
  }
}

void Registry::restore(const v1::Snapshot& snap) {
  // All or nothing: a job that breaks what the registry relies on refuses the whole state.
  std::set<std::string> ids;
  for (const auto& j : snap.jobs()) {
    if (const Status s = validate_saved_job(j, options_.limits); !s.ok())
      throw usage_error("the saved state of a job is invalid ({}); it was not written by trn or is damaged",
                        s.message);
    if (!ids.insert(j.job_id()).second)
      throw usage_error("the saved state names job '{}' twice; it was not written by trn or is damaged", j.job_id());
  }
  std::lock_guard lock(mu_);
  jobs_.clear();
  finished_.clear();
  job_tokens_.clear();
  next_seq_ = std::max<int64_t>(next_seq_, snap.next_event_seq());
  auto now = options_.now();
  for (const auto& j : snap.jobs()) {
    auto job = std::make_unique<Job>();
    job->id = j.job_id();
    job->generation = j.generation();
    job->state = j.state() == "running"     ? JobState::kRunning
                 : j.state() == "completed" ? JobState::kCompleted
                 : j.state() == "failed"    ? JobState::kFailed
                 : j.state() == "stopped"   ? JobState::kStopped
                                            : JobState::kForming;
    job->members.assign(j.members().begin(), j.members().end());
    // The heartbeat timeout counts from now, but nobody has been heard from yet: status says
    // "unknown" until each member heartbeats again.
    job->node_seen.assign(job->members.size(), now);
    job->node_datagram_seq.assign(job->members.size(), 0);
    job->restored = true;
    job->node_unknown.assign(job->members.size(), true);
    job->ended_unix_ms = j.ended_unix_ms();
    // A snapshot of an older trn has no end times: its finished jobs count from this restart. So
    // does a job that was forming: if nobody joins it again, it expires like a finished one.
    if (job->ended_unix_ms == 0 && job->state != JobState::kRunning) job->ended_unix_ms = wall_ms();
    job->failure = j.reason();
    if (job->failure.empty() && job->state == JobState::kFailed && !j.restart_history().empty())
      job->failure = j.restart_history().rbegin()->cause();
    job->run_id = j.run_id();
    job->token_nonce = j.token_nonce();
    if (!job->token_nonce.empty()) ensure_token(*job);
    if (j.has_recovery()) {
      job->recovery = j.recovery();
      job->recovery->DiscardUnknownFields();  // as record_recovery() keeps it
    }
    job->last_member_ids.insert(j.last_member_ids().begin(), j.last_member_ids().end());
    // A state log of an older trn has neither: its running members carry the run on.
    for (const auto& m : j.members()) {
      if (j.last_member_ids().empty()) job->last_member_ids.insert(m.node_id());
      job->last_node_rank[m.node_id()] = m.node_rank();
    }
    job->index_ranks();
    job->finished.insert(j.finished_nodes().begin(), j.finished_nodes().end());
    job->history.assign(j.restart_history().begin(), j.restart_history().end());
    job->restarts = j.restarts();
    job->committed.assign(j.checkpoints().begin(), j.checkpoints().end());
    for (const auto& c : job->committed) job->last_committed_step = std::max(job->last_committed_step, c.step());
    job->min_nodes = j.min_nodes();
    job->max_nodes = j.max_nodes();
    for (const auto& kv : j.kv()) {
      if (kv.generation() != job->generation) continue;
      job->kv[kv.key()] = kv.value();
      job->kv_bytes += kv.key().size() + kv.value().size();
    }
    Job& ref = *job;
    jobs_[job->id] = std::move(job);
    reindex(ref);
  }
}

RegistryGauges Registry::gauges() {
  std::lock_guard lock(mu_);
  RegistryGauges g;
  const auto now = options_.now();
  g.jobs = static_cast<int64_t>(jobs_.size());
  g.heartbeats = heartbeats_total_;
  g.heartbeat_timeout_s = std::chrono::duration<double>(options_.heartbeat_timeout).count();
  for (const auto& [_, job] : jobs_) {
    g.members += static_cast<int64_t>(job->members.size());
    g.restarts += job->restarts;
    g.waiters += static_cast<int64_t>(job->waiters());
    auto& jg = g.per_job.emplace_back();
    jg.job_id = job->id;
    jg.generation = job->generation;
    jg.members = static_cast<int64_t>(job->members.size());
    jg.restarts = job->restarts;
    jg.last_committed_step = job->last_committed_step;
    jg.state = to_string(job->state);
    if (job->state == JobState::kRunning)
      for (size_t i = 0; i < job->node_seen.size(); ++i)
        if (!job->finished.count(static_cast<int>(i)))
          jg.heartbeat_age_s =
              std::max(jg.heartbeat_age_s, std::chrono::duration<double>(now - job->node_seen[i]).count());
    if (!job->workers.empty() && job->workers[0].status.has_val_loss())
      jg.val_loss = job->workers[0].status.val_loss();
    jg.recovery = job->recovery;
    if (!job->workers.empty()) jg.moe = job->workers[0].moe;
    for (const auto& c : job->committed) jg.last_committed_unix_ms = std::max(jg.last_committed_unix_ms, c.committed_unix_ms());
  }
  return g;
}

}  // namespace trn::control
