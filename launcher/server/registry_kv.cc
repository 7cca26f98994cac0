// Registry: the per-job key-value store, barriers, and the expiry of every kind of wait.
#include <fmt/format.h>

#include <charconv>

#include "launcher/server/job.h"
#include "launcher/server/registry.h"
#include "launcher/server/validate.h"

namespace trn::control {

static double secs(Duration d) { return std::chrono::duration<double>(d).count(); }

Status Registry::set(const v1::SetRequest& req) {
  const auto& lim = options_.limits;
  if (auto s = validate_key(req.key(), lim); !s.ok()) return s;
  if (req.value().size() > lim.max_value_bytes)
    return Status::Make(Code::kInvalidArgument, fmt::format("value of key '{}' is {} bytes; the limit is {}",
                                                            req.key(), req.value().size(), lim.max_value_bytes));
  Fired fired;
  {
    std::lock_guard lock(mu_);
    Job* job = nullptr;
    if (auto s = check_generation(req.job_id(), req.generation(), &job); !s.ok()) return s;
    auto it = job->kv.find(req.key());
    size_t old = it == job->kv.end() ? 0 : it->second.size() + it->first.size();
    if (it == job->kv.end() && job->kv.size() >= lim.max_keys_per_job)
      return Status::Make(Code::kResourceExhausted,
                          fmt::format("job '{}' already has {} keys (the limit)", job->id, job->kv.size()));
    size_t bytes = job->kv_bytes - old + req.key().size() + req.value().size();
    if (bytes > lim.max_kv_bytes_per_job)
      return Status::Make(Code::kResourceExhausted, fmt::format("job '{}' store would hold {} bytes; the "
                                                                "limit is {}",
                                                                job->id, bytes, lim.max_kv_bytes_per_job));
    job->kv[req.key()] = req.value();
    job->kv_bytes = bytes;
    kv_dirty_.insert(job->id);
    auto w = job->get_waiters.find(req.key());
    if (w != job->get_waiters.end()) {
      for (auto& g : w->second)
        fired.push_back([d = std::move(g.done), v = req.value()] { d(Status::Ok(), v); });
      job->get_waiters.erase(w);
    }
  }
  run(fired);
  return Status::Ok();
}

void Registry::get(const v1::GetRequest& req, Done<std::string> done) {
  if (auto s = validate_key(req.key(), options_.limits); !s.ok()) return done(s, {});
  if (auto s = validate_wait_ms("get timeout", req.timeout_ms(), options_.limits); !s.ok())
    return done(s, {});
  std::unique_lock lock(mu_);
  Job* job = nullptr;
  if (auto s = check_generation(req.job_id(), req.generation(), &job); !s.ok()) {
    lock.unlock();
    return done(s, {});
  }
  auto it = job->kv.find(req.key());
  if (it != job->kv.end()) {
    std::string v = it->second;
    lock.unlock();
    return done(Status::Ok(), v);
  }
  if (closed_) {
    lock.unlock();
    return done(Status::Make(Code::kUnavailable, "the coordinator is shutting down"), {});
  }
  auto now = options_.now();
  job->get_waiters[req.key()].push_back(
      {next_waiter_++, req.generation(), now, now + std::chrono::milliseconds(req.timeout_ms()), std::move(done)});
}

Status Registry::add(const v1::AddRequest& req, int64_t* value) {
  if (auto s = validate_key(req.key(), options_.limits); !s.ok()) return s;
  if (req.request_id().size() > 128) return Status::Make(Code::kInvalidArgument, "request_id is longer than 128 bytes");
  Fired fired;
  {
    std::lock_guard lock(mu_);
    Job* job = nullptr;
    if (auto s = check_generation(req.job_id(), req.generation(), &job); !s.ok()) return s;
    if (!req.request_id().empty()) {
      auto r = job->add_results.find(req.request_id());
      if (r != job->add_results.end()) {
        *value = r->second;
        return Status::Ok();
      }
    }
    int64_t cur = 0;
    auto it = job->kv.find(req.key());
    if (it != job->kv.end()) {
      const std::string& s = it->second;
      auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), cur);
      if (ec != std::errc() || p != s.data() + s.size())
        return Status::Make(Code::kInvalidArgument,
                            fmt::format("key '{}' holds a value that is not an integer; add() needs one",
                                        req.key()));
    } else if (job->kv.size() >= options_.limits.max_keys_per_job) {
      return Status::Make(Code::kResourceExhausted,
                          fmt::format("job '{}' already has {} keys (the limit)", job->id, job->kv.size()));
    }
    if (__builtin_add_overflow(cur, req.delta(), &cur))
      return Status::Make(Code::kInvalidArgument,
                          fmt::format("adding {} to key '{}' would overflow a 64-bit integer; the value stays {}",
                                      req.delta(), req.key(), it == job->kv.end() ? "0" : it->second));
    std::string nv = std::to_string(cur);
    size_t old = it == job->kv.end() ? 0 : it->first.size() + it->second.size();
    job->kv_bytes = job->kv_bytes - old + req.key().size() + nv.size();
    job->kv[req.key()] = nv;
    kv_dirty_.insert(job->id);
    *value = cur;
    if (!req.request_id().empty()) {
      job->add_results[req.request_id()] = cur;
      job->add_order.push_back(req.request_id());
      if (job->add_order.size() > 65536) {
        job->add_results.erase(job->add_order.front());
        job->add_order.pop_front();
      }
    }
    auto w = job->get_waiters.find(req.key());
    if (w != job->get_waiters.end()) {
      for (auto& g : w->second) fired.push_back([d = std::move(g.done), nv] { d(Status::Ok(), nv); });
      job->get_waiters.erase(w);
    }
  }
  run(fired);
  return Status::Ok();
}

Status Registry::del(const v1::DeleteRequest& req, bool* deleted) {
  if (auto s = validate_key(req.key(), options_.limits); !s.ok()) return s;
  std::lock_guard lock(mu_);
  Job* job = nullptr;
  if (auto s = check_generation(req.job_id(), req.generation(), &job); !s.ok()) return s;
  auto it = job->kv.find(req.key());
  *deleted = it != job->kv.end();
  if (*deleted) {
    job->kv_bytes -= it->first.size() + it->second.size();
    job->kv.erase(it);
    kv_dirty_.insert(job->id);
  }
  return Status::Ok();
}

void Registry::barrier(const v1::BarrierRequest& req, Done<bool> done) {
  if (req.name().empty() || req.name().size() > options_.limits.max_key_bytes)
    return done(Status::Make(Code::kInvalidArgument, "barrier name must have 1 to 4096 bytes"), false);
  if (auto s = validate_text("barrier name", req.name()); !s.ok()) return done(s, false);
  if (req.world_size() < 1 || req.rank() < 0 || req.rank() >= req.world_size())
    return done(Status::Make(Code::kInvalidArgument,
                             fmt::format("barrier '{}': rank {} with world size {} is out of range",
                                         req.name(), req.rank(), req.world_size())),
                false);
  if (auto s = validate_wait_ms("barrier timeout", req.timeout_ms(), options_.limits); !s.ok())
    return done(s, false);
  Fired fired;
  {
    std::lock_guard lock(mu_);
    Job* job = nullptr;
    if (auto s = check_generation(req.job_id(), req.generation(), &job); !s.ok() || closed_) {
      if (s.ok()) s = Status::Make(Code::kUnavailable, "the coordinator is shutting down");
      fired.push_back([d = std::move(done), s] { d(s, false); });
    } else {
      auto& b = job->barriers[req.name()];
      if (b.arrived.empty()) b.world_size = req.world_size();
      if (b.world_size != req.world_size()) {
        Status s = Status::Make(Code::kInvalidArgument,
                                fmt::format("barrier '{}': rank {} says world size {} but others said {}",
                                            req.name(), req.rank(), req.world_size(), b.world_size));
        fired.push_back([d = std::move(done), s] { d(s, false); });
      } else {
        auto now = options_.now();
        auto& slot = b.arrived[req.rank()];
        if (slot.done) {  // a retry of the same rank replaces its earlier wait
          fired.push_back([d = std::move(slot.done)] {
            d(Status::Make(Code::kAborted, "barrier wait superseded by a retry"), false);
          });
        }
        slot = {now, now + std::chrono::milliseconds(req.timeout_ms()), std::move(done)};
        if (static_cast<int>(b.arrived.size()) == b.world_size) {
          for (auto& [_, w] : b.arrived) fired.push_back([d = std::move(w.done)] { d(Status::Ok(), true); });
          job->barriers.erase(req.name());
        }
      }
    }
  }
  run(fired);
}

void Registry::expire_waits(Job& job, Clock::time_point now, Fired& fired) {
  for (auto it = job.pending.begin(); it != job.pending.end();) {
    auto& ws = it->second.waiters;
    for (auto w = ws.begin(); w != ws.end();) {
      if (now < w->deadline) {
        ++w;
        continue;
      }
      Status s = Status::Make(
          Code::kDeadlineExceeded,
          fmt::format("rendezvous of job '{}' timed out: {} of min {} nodes joined (max {})", job.id,
                      job.pending.size(), job.min_nodes, job.max_nodes));
      fired.push_back([d = std::move(w->done), s] { d(s, {}); });
      w = ws.erase(w);
    }
    if (ws.empty()) {
      emit(job, v1::Event::RENDEZVOUS_TIMEOUT,
           fmt::format("node {} gave up waiting: {} of min {} nodes joined", it->first, job.pending.size(),
                       job.min_nodes));
      it = job.pending.erase(it);
      // A job nobody waits for any more is finished until someone joins it again.
      if (job.pending.empty() && job.state == JobState::kForming) {
        job.ended_unix_ms = wall_ms();
        persist_job(job);  // so that a restart expires it when this one would have
      }
    } else {
      ++it;
    }
  }
  for (auto it = job.get_waiters.begin(); it != job.get_waiters.end();) {
    auto& ws = it->second;
    for (auto w = ws.begin(); w != ws.end();) {
      if (now < w->deadline) {
        ++w;
        continue;
      }
      Status s = Status::Make(Code::kDeadlineExceeded,
                              fmt::format("waited {:.1f} s for key '{}' (job '{}', generation {}); no "
                                          "rank set it",
                                          secs(now - w->start), it->first, job.id, w->generation));
      fired.push_back([d = std::move(w->done), s] { d(s, {}); });
      w = ws.erase(w);
    }
    it = ws.empty() ? job.get_waiters.erase(it) : std::next(it);
  }
  for (auto it = job.barriers.begin(); it != job.barriers.end();) {
    auto& b = it->second;
    for (auto w = b.arrived.begin(); w != b.arrived.end();) {
      if (now < w->second.deadline) {
        ++w;
        continue;
      }
      std::string missing;
      int shown = 0;
      for (int r = 0; r < b.world_size && shown < 16; ++r) {
        if (b.arrived.count(r)) continue;
        if (shown++) missing.push_back(',');
        missing.append(std::to_string(r));
      }
      Status s = Status::Make(
          Code::kDeadlineExceeded,
          fmt::format("barrier '{}' (job '{}', generation {}): {} of {} ranks arrived after {:.1f} s; "
                      "missing ranks: {}",
                      it->first, job.id, job.generation, b.arrived.size(), b.world_size,
                      secs(now - w->second.start), missing));
      fired.push_back([d = std::move(w->second.done), s] { d(s, false); });
      w = b.arrived.erase(w);
    }
    it = b.arrived.empty() ? job.barriers.erase(it) : std::next(it);
  }
}

}  // namespace trn::control
