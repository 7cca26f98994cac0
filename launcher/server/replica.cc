#include "launcher/server/replica.h"

#include <fmt/format.h>

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
  etcd_ = std::make_unique<etcd::EtcdClient>(std::move(endpoints));
  leader_key_ = options_.prefix + "leader";
  thread_ = std::thread([this] { run(); });
}

Replica::~Replica() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::string Replica::refusal() const {
  if (leader_.load()) return {};
  std::lock_guard lock(mu_);
  return refusal_;
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
    if (!leader_.load()) {
      if (!campaign()) {
        std::unique_lock lock(mu_);
        cv_.wait_for(lock, kCampaignEvery, [&] { return stop_; });
      }
      continue;
    }
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return stop_ || !lost_.empty(); });
    if (stop_) break;
    std::string why = std::move(lost_);
    lost_.clear();
    lock.unlock();
    depose(why);
  }
  if (leader_.exchange(false) && keeper_) {
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
    return false;
  }
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
  keeper_ = std::make_unique<etcd::LeaseKeeper>(*etcd_, lease.value, [this](const std::string& why) {
    std::lock_guard lock(mu_);
    if (lost_.empty()) lost_ = "lost the leader lease: " + why;
    cv_.notify_all();
  });
  v1::Snapshot snap;
  std::string why;
  if (!load(&snap, &why)) {
    keeper_.reset();
    etcd_->revoke(lease.value.id);
    set_refusal("this coordinator does not accept calls: " + why);
    return false;
  }
  {
    std::lock_guard lock(write_mu_);
    guard_revision_ = created.value.current.create_revision;
    written_kv_.clear();
    for (const auto& j : snap.jobs()) {
      auto& kv = written_kv_[j.job_id()];
      for (const auto& e : j.kv()) kv[e.key()] = e.value();
    }
  }
  hooks_.elected(snap);
  leader_ = true;
  log::info(Subsys::kCoord, "elected leader ({} in etcd, lease {:x} of {} s): restored {} jobs", leader_key_,
            lease.value.id, lease.value.ttl_s, snap.jobs_size());
  return true;
}

bool Replica::load(v1::Snapshot* snap, std::string* why) {
  auto all = etcd_->range_prefix(options_.prefix);
  if (!all.ok()) {
    *why = all.status.message;
    return false;
  }
  std::map<std::string, v1::Snapshot::Job*> jobs;
  std::map<std::string, std::vector<std::pair<std::string, std::string>>> kvs;
  for (const auto& e : all.value) {
    std::string_view key(e.key);
    key.remove_prefix(options_.prefix.size());
    if (key.substr(0, 5) == "jobs/") {
      auto* j = snap->add_jobs();
      if (!j->ParseFromString(e.value)) {
        *why = fmt::format("etcd key {} does not hold a job record; is --store-prefix shared with something else?",
                           e.key);
        return false;
      }
      jobs[j->job_id()] = j;
    } else if (key.substr(0, 3) == "kv/") {
      key.remove_prefix(3);
      size_t slash = key.find('/');
      if (slash == std::string_view::npos) continue;
      kvs[std::string(key.substr(0, slash))].emplace_back(std::string(key.substr(slash + 1)), e.value);
    } else if (key == "meta/next_event_seq") {
      snap->set_next_event_seq(std::strtoll(e.value.c_str(), nullptr, 10));
    }
  }
  for (auto& [id, entries] : kvs) {
    auto it = jobs.find(id);
    if (it == jobs.end()) continue;  // a job removed between two transactions of its record
    for (auto& [k, v] : entries) {
      auto* kv = it->second->add_kv();
      kv->set_generation(it->second->generation());
      kv->set_key(std::move(k));
      kv->set_value(std::move(v));
    }
  }
  return true;
}

void Replica::persist(const v1::LogRecord& rec) {
  if (!leader_.load()) return;
  std::lock_guard lock(write_mu_);
  std::vector<etcd::Write> writes;
  std::map<std::string, std::string> kv_now;
  std::string id;
  if (rec.has_job()) {
    v1::Snapshot::Job job = rec.job();
    id = job.job_id();
    for (const auto& e : job.kv())
      if (e.generation() == job.generation()) kv_now[e.key()] = e.value();
    job.clear_kv();
    writes.push_back(etcd::Write::put(options_.prefix + "jobs/" + id, job.SerializeAsString()));
  } else {
    id = rec.removed_job();
    writes.push_back(etcd::Write::remove(options_.prefix + "jobs/" + id));
  }
  writes.push_back(etcd::Write::put(options_.prefix + "meta/next_event_seq", std::to_string(rec.next_event_seq())));
  // Only the keys that changed since the last write of this job.
  auto& before = written_kv_[id];
  const std::string kv_prefix = options_.prefix + "kv/" + id + "/";
  for (const auto& [k, v] : kv_now)
    if (auto it = before.find(k); it == before.end() || it->second != v) writes.push_back(etcd::Write::put(kv_prefix + k, v));
  for (const auto& [k, _] : before)
    if (!kv_now.count(k)) writes.push_back(etcd::Write::remove(kv_prefix + k));

  size_t i = 0;
  while (i < writes.size()) {
    std::vector<etcd::Write> txn;
    size_t bytes = 0;
    while (i < writes.size() && txn.size() < kWritesPerTxn &&
           (txn.empty() || bytes + writes[i].key.size() + writes[i].value.size() <= kBytesPerTxn)) {
      bytes += writes[i].key.size() + writes[i].value.size();
      txn.push_back(std::move(writes[i++]));
    }
    auto r = etcd_->txn_put_if(leader_key_, guard_revision_, txn);
    std::string why = !r.ok()     ? "a write to etcd failed: " + r.status.message
                      : !r.value ? "another replica holds the leader key now"
                                 : "";
    if (!why.empty()) {
      log::error(Subsys::kCoord, "saving job {} to etcd: {}", id, why);
      std::lock_guard l(mu_);
      if (lost_.empty()) lost_ = why;
      cv_.notify_all();
      return;
    }
  }
  if (rec.has_job()) before = std::move(kv_now);
  else written_kv_.erase(id);
}

void Replica::depose(const std::string& reason) {
  leader_ = false;
  set_refusal("this coordinator stopped accepting writes: " + reason);
  log::error(Subsys::kCoord, "stopped accepting writes: {}", reason);
  if (keeper_) {
    int64_t lease = keeper_->id();
    keeper_.reset();
    etcd_->revoke(lease);  // best effort: a successor need not wait for the TTL
  }
  hooks_.deposed(reason);
}

}  // namespace trn::control
