#include "launcher/server/replica.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <set>
#include <tuple>

#include "collectives/core/error.h"
#include "collectives/core/log.h"

namespace trn::control {

namespace v1 = ::trn::coordinator::v1;
using log::Subsys;

namespace {

constexpr size_t kWritesPerTxn = 100;       // etcd refuses more than 128 by default
constexpr size_t kBytesPerTxn = 1 << 20;    // and requests over 1.5 MiB
constexpr auto kCampaignEvery = std::chrono::milliseconds(250);

}  // namespace

Replica::Replica(ReplicaOptions options, Hooks hooks) : options_(std::move(options)), hooks_(std::move(hooks)) {
  auto endpoints = etcd::parse_endpoints(options_.store);
  if (options_.advertise.empty()) throw usage_error("--store needs --advertise HOST:PORT (how clients reach this replica)");
  if (options_.prefix.empty() || options_.prefix.back() != '/')
    throw usage_error("--store-prefix {}: expected a key prefix ending in '/'", options_.prefix);
  if (options_.lease_ttl_s < 1) throw usage_error("--leader-ttl {}: expected whole seconds, at least 1", options_.lease_ttl_s);
  etcd_ = std::make_unique<etcd::EtcdClient>(std::move(endpoints), options_.etcd);
  leader_key_ = options_.prefix + "leader";
  thread_ = std::thread([this] { run(); });
}

Replica::~Replica() { stop(); }

void Replica::stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::lock_guard lock(mu_);
  refusal_ = "the coordinator is shutting down";
}

std::string Replica::refusal() const {
  const bool leading = leader_.load();
  std::lock_guard lock(mu_);
  if (!leading) return refusal_;
  if (doubt_.empty()) return {};
  return "this coordinator does not accept calls while it cannot confirm that it still leads: " + doubt_;
}

void Replica::set_refusal(std::string why) {
  std::lock_guard lock(mu_);
  refusal_ = std::move(why);
}

void Replica::run() {
  for (;;) {
    {
      std::lock_guard lock(mu_);
      if (stop_) break;
    }
    {
      std::unique_lock lock(mu_);
      if (!lost_.empty()) {  // lose() ran: finish the deposition on this thread
        std::string why = std::move(lost_);
        lost_.clear();
        lock.unlock();
        depose(why);
        continue;
      }
    }
    if (!leader_.load()) {
      if (!campaign()) {
        std::unique_lock lock(mu_);
        cv_.wait_for(lock, kCampaignEvery, [&] { return stop_; });
      }
      continue;
    }
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return stop_ || !lost_.empty(); });
  }
  {
    std::lock_guard lock(mu_);
    refusal_ = "the coordinator is shutting down";
    leader_ = false;
  }
  if (keeper_) {
    // Give the lease back: etcd deletes the leader key now, and a standby takes over at once
    // instead of after the TTL.
    int64_t lease = keeper_->id();
    keeper_.reset();
    if (auto s = etcd_->revoke(lease); !s.ok())
      log::warn(Subsys::kCoord, "could not give the leader lease back ({}); a standby takes over after its TTL",
                s.message);
  }
}

bool Replica::campaign() {
  auto current = etcd_->get(leader_key_);
  if (!current.ok()) {
    set_refusal("this coordinator does not accept calls: " + current.status.message);
    // Once per outage, so a replica that cannot reach etcd (down, or a TLS setting wrong) says so.
    if (!etcd_unreachable_logged_)
      log::warn(Subsys::kCoord, "cannot reach etcd ({}); refusing calls until it answers", current.status.message);
    etcd_unreachable_logged_ = true;
    return false;
  }
  etcd_unreachable_logged_ = false;
  if (current.value) {
    set_refusal("standby coordinator; the leader is " + current.value->value);
    return false;
  }
  auto lease = etcd_->grant(options_.lease_ttl_s);
  if (!lease.ok()) {
    set_refusal("this coordinator does not accept calls: " + lease.status.message);
    return false;
  }
  auto created = etcd_->create_if_absent(leader_key_, options_.advertise, lease.value.id);
  if (!created.ok() || !created.value.created) {
    etcd_->revoke(lease.value.id);
    set_refusal(created.ok() ? "standby coordinator; the leader is " + created.value.current.value
                             : "this coordinator does not accept calls: " + created.status.message);
    return false;
  }
  keeper_ = std::make_unique<etcd::LeaseKeeper>(
      *etcd_, lease.value, [this](const std::string& why) { lose("lost the leader lease: " + why); },
      [this](const std::string& why) {
        std::lock_guard lock(mu_);
        doubt_ = why;
      });
  v1::Snapshot snap;
  std::string why;
  bool loaded, damaged = false;
  {
    std::lock_guard lock(write_mu_);
    loaded = load(&snap, &why, &damaged);
  }
  if (!loaded) {
    keeper_.reset();
    etcd_->revoke(lease.value.id);
    if (damaged) refuse_damaged_state(why);
    else set_refusal("this coordinator does not accept calls: " + why);
    return false;
  }
  {
    std::lock_guard lock(write_mu_);
    guard_revision_ = created.value.current.create_revision;
  }
  try {
    hooks_.elected(snap);
  } catch (const Error& e) {  // the state in etcd is invalid: refuse to lead on it
    keeper_.reset();
    etcd_->revoke(lease.value.id);
    refuse_damaged_state(e.what());
    return false;
  }
  damaged_logged_.clear();
  {
    // A failure reported for an earlier term (a write of the old term that failed as it was
    // deposed, a keeper of a lease given up) does not depose this one.
    std::lock_guard lock(mu_);
    lost_.clear();
    refusal_.clear();
    doubt_.clear();
  }
  leader_ = true;
  if (keeper_->lost()) lose("lost the leader lease: " + keeper_->lost_reason());  // while loading
  log::info(Subsys::kCoord, "elected leader ({} in etcd, lease {:x} of {} s): restored {} jobs", leader_key_,
            lease.value.id, lease.value.ttl_s, snap.jobs_size());
  return true;
}

void Replica::refuse_damaged_state(const std::string& why) {
  set_refusal("this coordinator does not accept calls: " + why);
  if (why != damaged_logged_)
    log::error(Subsys::kCoord,
               "refusing every call: {}; mend or delete that record in etcd (this replica tries again every {} ms)",
               why, kCampaignEvery.count());
  damaged_logged_ = why;
  if (hooks_.refused_state) hooks_.refused_state(why);
}

namespace {

constexpr size_t kShardBytesPerKey = 256 << 10;  // a committed checkpoint's shards, per etcd key

uint64_t hash(const std::string& v) { return XXH64(v.data(), v.size(), 0); }

std::string step_key(int64_t step) { return fmt::format("{:020}", step); }

// A committed checkpoint as etcd keys' values: chunks of its shards, the first with its step,
// generation and commit time.
std::vector<std::string> checkpoint_chunks(const v1::Checkpoint& c) {
  std::vector<std::string> out;
  v1::Checkpoint chunk;
  chunk.set_step(c.step());
  chunk.set_generation(c.generation());
  chunk.set_committed_unix_ms(c.committed_unix_ms());
  size_t bytes = 0;
  for (const auto& sh : c.shards()) {
    if (bytes > kShardBytesPerKey) {
      out.push_back(chunk.SerializeAsString());
      chunk.Clear();
      bytes = 0;
    }
    *chunk.add_shards() = sh;
    bytes += sh.ByteSizeLong();
  }
  out.push_back(chunk.SerializeAsString());
  return out;
}

}  // namespace

bool Replica::load(v1::Snapshot* snap, std::string* why, bool* damaged) {
  auto all = etcd_->range_prefix(options_.prefix);
  if (!all.ok()) {
    *why = all.status.message;
    return false;
  }
  // kv/<job>/<generation>/<key> and ckpt/<job>/<step>/<chunk>: the job id has no '/', the
  // numbers are digits; a key of the store may hold anything.
  std::map<std::string, v1::Snapshot::Job> jobs;
  std::map<std::string, std::vector<std::tuple<int64_t, std::string, std::string>>> kvs;  // gen, key, value
  std::map<std::string, std::map<int64_t, std::vector<std::string>>> ckpts;  // chunks in key order
  written_.clear();
  for (const auto& e : all.value) {
    std::string_view key(e.key);
    key.remove_prefix(options_.prefix.size());
    auto take = [&](std::string_view& k) {  // the next '/'-separated part
      size_t slash = k.find('/');
      std::string part(k.substr(0, slash));
      k.remove_prefix(slash == std::string_view::npos ? k.size() : slash + 1);
      return part;
    };
    if (key.substr(0, 5) == "jobs/") {
      key.remove_prefix(5);
      v1::Snapshot::Job j;
      if (!j.ParseFromString(e.value)) {
        *why = fmt::format("etcd key {} does not hold a job record; is --store-prefix shared with something else?",
                           e.key);
        *damaged = true;
        return false;
      }
      jobs[j.job_id()] = std::move(j);
    } else if (key.substr(0, 3) == "kv/") {
      key.remove_prefix(3);
      std::string id = take(key), gen = take(key);
      kvs[id].emplace_back(std::strtoll(gen.c_str(), nullptr, 10), std::string(key), e.value);
      written_[id].kv[e.key] = hash(e.value);
    } else if (key.substr(0, 5) == "ckpt/") {
      key.remove_prefix(5);
      std::string id = take(key), step = take(key);
      ckpts[id][std::strtoll(step.c_str(), nullptr, 10)].push_back(e.value);
      written_[id].checkpoints[std::strtoll(step.c_str(), nullptr, 10)]++;
    } else if (key == "meta/next_event_seq") {
      snap->set_next_event_seq(std::strtoll(e.value.c_str(), nullptr, 10));
    }
  }
  for (auto& [id, j] : jobs) {
    for (auto& [gen, k, v] : kvs[id]) {
      if (gen != j.generation()) continue;  // written for a generation the record never reached
      auto* kv = j.add_kv();
      kv->set_generation(gen);
      kv->set_key(std::move(k));
      kv->set_value(std::move(v));
    }
    for (auto& [step, chunks] : ckpts[id]) {
      v1::Checkpoint c, part;
      for (const auto& chunk : chunks) {
        if (!part.ParseFromString(chunk)) {
          *why = fmt::format("etcd holds a damaged checkpoint record of job {} step {} (keys {}ckpt/{}/{}/)", id,
                             step, options_.prefix, id, step_key(step));
          *damaged = true;
          return false;
        }
        if (&chunk == &chunks.front()) c = part;
        else c.mutable_shards()->MergeFrom(part.shards());
      }
      *j.add_checkpoints() = std::move(c);
    }
    *snap->add_jobs() = std::move(j);
  }
  return true;
}

void Replica::persist(const v1::LogRecord& rec) {
  if (!leader_.load()) return;
  std::lock_guard lock(write_mu_);
  const std::string id = rec.has_job() ? rec.job().job_id() : rec.removed_job();
  auto& before = written_[id];
  Written now;
  std::vector<etcd::Write> writes;
  if (rec.has_job()) {
    const auto& job = rec.job();
    // The store's keys of the current generation: only those that changed since the last write.
    // The generation is part of the key, so keys of a generation its record never reached are
    // ignored by load(), whatever order the transactions land in.
    const std::string kv_prefix = fmt::format("{}kv/{}/{}/", options_.prefix, id, job.generation());
    for (const auto& e : job.kv()) {
      if (e.generation() != job.generation()) continue;
      std::string key = kv_prefix + e.key();
      uint64_t h = hash(e.value());
      if (auto it = before.kv.find(key); it == before.kv.end() || it->second != h)
        writes.push_back(etcd::Write::put(key, e.value()));
      now.kv[key] = h;
    }
    // Committed checkpoints never change: each is written once, in chunks.
    for (const auto& c : job.checkpoints()) {
      if (auto it = before.checkpoints.find(c.step()); it != before.checkpoints.end()) {
        now.checkpoints[c.step()] = it->second;
        continue;
      }
      auto chunks = checkpoint_chunks(c);
      for (size_t k = 0; k < chunks.size(); ++k)
        writes.push_back(etcd::Write::put(
            fmt::format("{}ckpt/{}/{}/{:06}", options_.prefix, id, step_key(c.step()), k), std::move(chunks[k])));
      now.checkpoints[c.step()] = static_cast<int>(chunks.size());
    }
  }
  // Keys gone from the current generation are removed one by one; a past generation's all at
  // once after the record (one range delete, not a write per key: load() ignores them anyway).
  const std::string kv_base = fmt::format("{}kv/{}/", options_.prefix, id);
  const std::string kv_current =
      rec.has_job() ? fmt::format("{}{}/", kv_base, rec.job().generation()) : std::string("\n");
  std::set<std::string> past;  // "kv/<id>/<generation>/" of generations the job left
  for (const auto& [key, _] : before.kv) {
    if (now.kv.count(key)) continue;
    if (key.compare(0, kv_current.size(), kv_current) == 0) {
      writes.push_back(etcd::Write::remove(key));
    } else {
      size_t slash = key.find('/', kv_base.size());
      past.insert(key.substr(0, slash == std::string::npos ? key.size() : slash + 1));
    }
  }
  for (const auto& [step, chunks] : before.checkpoints)
    if (!now.checkpoints.count(step))
      for (int k = 0; k < chunks; ++k)
        writes.push_back(
            etcd::Write::remove(fmt::format("{}ckpt/{}/{}/{:06}", options_.prefix, id, step_key(step), k)));
  // The record last: a record never lands ahead of the keys it stands on.
  writes.push_back(etcd::Write::put(options_.prefix + "meta/next_event_seq", std::to_string(rec.next_event_seq())));
  if (rec.has_job()) {
    v1::Snapshot::Job record = rec.job();
    record.clear_kv();
    record.clear_checkpoints();
    writes.push_back(etcd::Write::put(options_.prefix + "jobs/" + id, record.SerializeAsString()));
  } else {
    writes.push_back(etcd::Write::remove(options_.prefix + "jobs/" + id));
  }

  size_t i = 0;
  while (i < writes.size()) {
    std::vector<etcd::Write> txn;
    size_t bytes = 0;
    while (i < writes.size() && txn.size() < kWritesPerTxn &&
           (txn.empty() || bytes + writes[i].key.size() + writes[i].value.size() <= kBytesPerTxn)) {
      bytes += writes[i].key.size() + writes[i].value.size();
      txn.push_back(std::move(writes[i++]));
    }
    // Unanswered (UNAVAILABLE, a deadline: an etcd election, a member lost) is retried while
    // the lease holds; lose() ends the loop when the keeper gives the lease up. A retry of a
    // write that did land is harmless: the same keys get the same values under the same guard.
    for (int attempt = 1;; ++attempt) {
      auto r = etcd_->txn_put_if(leader_key_, guard_revision_, txn);
      if (r.ok() && r.value) break;
      const bool unanswered =
          !r.ok() && (r.status.code == Code::kUnavailable || r.status.code == Code::kDeadlineExceeded);
      if (unanswered && leader_.load()) {
        if (attempt == 1)
          log::warn(Subsys::kCoord, "saving job {} to etcd: {}; retrying while the leader lease holds", id,
                    r.status.message);
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      if (!leader_.load()) return;  // the lease was lost meanwhile: already deposed, with its reason
      std::string why = !r.ok() ? "a write to etcd failed: " + r.status.message
                                : "another replica holds the leader key now";
      log::error(Subsys::kCoord, "saving job {} to etcd: {}", id, why);
      lose(why);
      return;
    }
  }
  for (const auto& prefix : past)
    if (auto r = etcd_->delete_prefix(prefix); !r.ok())
      log::warn(Subsys::kCoord, "job {}: keys of a past generation left in etcd ({}); they are ignored", id,
                r.status.message);
  if (rec.has_job()) before = std::move(now);
  else written_.erase(id);
}

void Replica::lose(const std::string& why) {
  std::lock_guard lock(mu_);
  if (!leader_.load()) return;  // not leading (any more): nothing to lose
  // Refuse at once, before the replica's thread wakes: the call whose write failed, and every
  // call after it, is answered UNAVAILABLE (CoordinatorService re-checks after each call).
  refusal_ = "this coordinator stopped accepting writes: " + why;
  leader_ = false;
  if (lost_.empty()) lost_ = why;
  cv_.notify_all();
}

void Replica::depose(const std::string& reason) {
  leader_ = false;
  set_refusal("this coordinator stopped accepting writes: " + reason);
  log::error(Subsys::kCoord, "stopped accepting writes: {}", reason);
  hooks_.deposed(reason);  // first: waiting calls are released before the revoke below can stall
  if (keeper_) {
    int64_t lease = keeper_->id();
    keeper_.reset();
    etcd_->revoke(lease);  // best effort: a successor need not wait for the TTL
  }
}

}  // namespace trn::control
