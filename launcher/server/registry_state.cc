// Registry: the checkpoint registry, status reports, snapshots and restore.
#include <fmt/format.h>

#include <chrono>

#include "launcher/server/job.h"
#include "launcher/server/registry.h"

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

void Registry::fill_status(const Job& job, v1::JobStatus* out) {
  auto now = options_.now();
  out->set_job_id(job.id);
  out->set_generation(job.generation);
  out->set_state(to_string(job.state));
  out->set_world_size(job.world_size);
  out->set_min_nodes(job.min_nodes);
  out->set_max_nodes(job.max_nodes);
  out->set_pending_joiners(static_cast<int>(job.pending.size()));
  out->set_ended_unix_ms(job.ended_unix_ms);
  out->set_run_id(job.run_id);
  out->set_reason(job.failure);
  if (job.recovery) *out->mutable_recovery() = *job.recovery;
  for (size_t i = 0; i < job.members.size(); ++i) {
    auto* n = out->add_nodes();
    *n->mutable_member() = job.members[i];
    bool unknown = job.restored && job.node_unknown[i];
    n->set_heartbeat_unknown(unknown);
    n->set_heartbeat_age_ms(unknown ? -1 : ms(now - job.node_seen[i]));
    n->set_finished(job.finished.count(static_cast<int>(i)) > 0);
  }
  if (job.state != JobState::kForming) {
    for (int r = 0; r < job.world_size; ++r) {
      auto* w = out->add_workers();
      auto it = job.workers.find(r);
      if (it == job.workers.end()) {
        w->set_rank(r);
        w->set_heartbeat_age_ms(-1);
        w->set_heartbeat_unknown(job.restored);
        for (const auto& m : job.members)
          if (r >= m.rank_offset() && r < m.rank_offset() + m.nproc()) w->set_host(m.host());
        continue;
      }
      *w = it->second.status;
      w->set_heartbeat_age_ms(ms(now - it->second.seen));
    }
  }
  out->set_restarts(job.restarts);
  for (const auto& h : job.history) *out->add_restart_history() = h;
  out->set_last_committed_step(job.last_committed_step);
  for (const auto& c : job.committed) *out->add_checkpoints() = c;
}

Status Registry::status(const std::string& job_id, v1::GetStatusResponse* reply) {
  std::lock_guard lock(mu_);
  reply->set_heartbeat_timeout_ms(ms(options_.heartbeat_timeout));
  if (!job_id.empty()) {
    Job* job = find_job(job_id);
    if (!job) return Status::Make(Code::kNotFound, fmt::format("no job '{}' at this coordinator", job_id));
    fill_status(*job, reply->add_jobs());
    return Status::Ok();
  }
  for (const auto& [_, job] : jobs_) fill_status(*job, reply->add_jobs());
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
  std::lock_guard lock(mu_);
  jobs_.clear();
  finished_.clear();
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
    job->restored = true;
    job->node_unknown.assign(job->members.size(), true);
    job->ended_unix_ms = j.ended_unix_ms();
    // A snapshot of an older trn has no end times: its finished jobs count from this restart.
    if (job->ended_unix_ms == 0 && job->state != JobState::kRunning) job->ended_unix_ms = wall_ms();
    job->failure = j.reason();
    if (job->failure.empty() && job->state == JobState::kFailed && !j.restart_history().empty())
      job->failure = j.restart_history().rbegin()->cause();
    job->run_id = j.run_id();
    if (j.has_recovery()) job->recovery = j.recovery();
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
          jg.heartbeat_age_s = std::max(jg.heartbeat_age_s, std::chrono::duration<double>(now - job->node_seen[i]).count());
    if (auto w = job->workers.find(0); w != job->workers.end() && w->second.status.has_val_loss())
      jg.val_loss = w->second.status.val_loss();
    jg.recovery = job->recovery;
    for (const auto& c : job->committed) jg.last_committed_unix_ms = std::max(jg.last_committed_unix_ms, c.committed_unix_ms());
  }
  return g;
}

}  // namespace trn::control
