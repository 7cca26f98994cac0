#include "collectives/engine.h"

#include <sched.h>

#include <algorithm>
#include <vector>

#include "collectives/core/log.h"
#include "collectives/core/settings.h"

namespace trn {

std::string OpLabel::format() const {
  switch (kind) {
    case Kind::kSend:
      return fmt::format("send of {} x {} to rank {} on communicator {}", call.count, to_string(call.dtype),
                         peer, comm);
    case Kind::kRecv:
      return fmt::format("receive of {} x {} from rank {} on communicator {}", call.count, to_string(call.dtype),
                         peer, comm);
    case Kind::kCollective: break;
  }
  return fmt::format("{} #{} on communicator {}", call.describe(), seq, comm);
}

Duration coll_poll_window() {
  static const Duration window = [] {
    const double us = settings::get_double("TRN_COLL_POLL_US");  // range checked by settings::validate
    return Duration(std::chrono::nanoseconds(static_cast<int64_t>(us * 1000)));
  }();
  return window;
}

const std::string& WorkState::what() {
  std::call_once(what_once_, [this] { what_ = label.format(); });
  return what_;
}

Engine::Engine(std::shared_ptr<PointToPoint> transport, std::shared_ptr<std::atomic<uint32_t>> ids)
    : transport_(std::move(transport)),
      ids_(ids ? std::move(ids) : std::make_shared<std::atomic<uint32_t>>(1)),
      poll_(coll_poll_window()) {
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
    // A running operation finishes (or meets its deadline); queued ones fail now.
    if (!queue_.empty()) fail_locked(aborted_error("communicator destroyed with operations queued"));
  }
  cv_.notify_all();
  thread_.join();
}

void Engine::finish(WorkState& s, std::optional<Error> error) {
  {
    std::lock_guard lock(s.mu);
    s.finished = std::chrono::steady_clock::now();
    if (s.started == std::chrono::steady_clock::time_point{}) s.started = s.finished;
    s.error = std::move(error);
    s.done.store(true, std::memory_order_release);
  }
  s.cv.notify_all();
}

void Engine::submit(std::shared_ptr<WorkState> state, std::function<void()> fn) {
  Task t;
  t.state = std::move(state);
  t.fn = std::move(fn);
  enqueue(std::move(t));
}

void Engine::submit_p2p(std::shared_ptr<WorkState> state, std::function<RequestPtr()> post,
                        std::function<void(Request&)> done, Duration timeout) {
  Task t;
  t.state = std::move(state);
  t.post = std::move(post);
  t.done = std::move(done);
  t.timeout = timeout;
  enqueue(std::move(t));
}

void Engine::enqueue(Task t) {
  std::unique_lock lock(mu_);
  if (failure_) {
    lock.unlock();
    finish(*t.state, aborted_error("{}: communicator failed earlier: {}", t.state->what(), failure_->what()));
    return;
  }
  t.queued_at = Clock::now();
  // An engine asleep in blocking style (ticking, or giving a lone collective's caller its
  // kIdleTick to claim it) is not woken for a lone collective: its caller runs it (run_inline).
  const bool unannounced = (ticking_ || claim_wait_) && queue_.empty() && t.fn;
  queue_.push_back(std::move(t));
  lock.unlock();
  if (!unannounced) cv_.notify_one();
}

void Engine::kick() {
  {
    std::lock_guard lock(mu_);
    if (!ticking_ || queue_.empty()) return;
  }
  cv_.notify_one();
}

void Engine::sleep_locked(std::unique_lock<std::mutex>& lock) {
  if (inline_streak_ < kBlockingStreak || !queue_.empty()) {
    cv_.wait(lock);
    return;
  }
  ticking_ = true;  // blocking style: submits stop waking this sleep (kBlockingStreak)
  cv_.wait_for(lock, kIdleTick);
  ticking_ = false;
}

void Engine::fail_locked(const Error& e) {
  if (!failure_) failure_ = e;
  for (auto& t : queue_)
    finish(*t.state, aborted_error("{}: communicator failed earlier: {}", t.state->what(), failure_->what()));
  queue_.clear();
  transport_->abort(failure_->what());
}

void Engine::abort(const std::string& reason) {
  std::lock_guard lock(mu_);
  log::warn(log::Subsys::kColl, "communicator aborted: {}", reason);
  fail_locked(aborted_error("aborted: {}", reason));
}

bool Engine::failed() const {
  if (transport_->aborted()) return true;
  std::lock_guard lock(mu_);
  return failure_.has_value();
}

bool Engine::guarded(WorkState& state, const std::function<void()>& body) {
  {
    std::lock_guard lock(state.mu);
    if (state.started == std::chrono::steady_clock::time_point{}) state.started = std::chrono::steady_clock::now();
  }
  std::optional<Error> error;
  try {
    body();
    return true;
  } catch (const Error& e) {
    error = e.with_context(state.what());
  } catch (const std::exception& e) {
    error = internal_error("{}: {}", state.what(), e.what());
  }
  {
    std::lock_guard lock(mu_);
    // An aborted transport fails the operation with the abort's reason; log the first cause.
    if (!failure_) log::error(log::Subsys::kColl, "{}", error->what());
    fail_locked(*error);
  }
  finish(state, std::move(error));
  // Everything still pending fails with the engine. (An inline run only starts with nothing
  // pending, and then must not write pending_, which the engine thread may be reading.)
  if (!pending_.empty()) {
    for (auto& p : pending_)
      if (p.state.get() != &state)
        finish(*p.state, aborted_error("{}: communicator failed earlier: {}", p.state->what(), failure_->what()));
    pending_.clear();
  }
  return false;
}

void Engine::poll_pending() {
  // Operations with one peer in one direction complete in issue order: one whose message is done
  // still waits while an earlier one with the same peer and direction is not.
  std::vector<std::pair<OpLabel::Kind, int>> held;
  for (size_t i = 0; i < pending_.size();) {
    Pending& p = pending_[i];
    const std::pair<OpLabel::Kind, int> key{p.state->label.kind, p.state->label.peer};
    const bool behind = std::find(held.begin(), held.end(), key) != held.end();
    bool complete = false;
    auto st = p.state;
    if (!guarded(*st, [&] {
          complete = !behind && p.request->test();
          if (complete) {
            p.done(*p.request);
          } else if (p.deadline.expired()) {
            p.request->wait(p.deadline);  // throws the transport's timeout error
          }
        }))
      return;  // pending_ was cleared
    if (complete) {
      finish(*st, std::nullopt);
      pending_.erase(pending_.begin() + static_cast<long>(i));
    } else {
      if (!behind) held.push_back(key);
      ++i;
    }
  }
}

void Engine::wait_all_pending() {
  while (!pending_.empty()) {
    Pending p = std::move(pending_.front());
    pending_.pop_front();
    if (!guarded(*p.state, [&] {
          p.request->wait(p.deadline);
          p.done(*p.request);
        }))
      return;
    finish(*p.state, std::nullopt);
  }
}

bool Engine::poll_for_work() {
  if (poll_ <= Duration::zero() || !idle_poll_.should_poll()) return false;
  const auto end = Clock::now() + poll_;
  for (;;) {
    {
      std::lock_guard lock(mu_);
      if (!queue_.empty() || stop_) {
        idle_poll_.record(true);
        return true;
      }
    }
    if (Clock::now() >= end) {
      idle_poll_.record(false);
      return false;
    }
    sched_yield();
  }
}

bool Engine::run_inline(const WorkState* state) {
  Task task;
  {
    std::lock_guard lock(mu_);
    if (engine_state_ == state) {  // the engine thread took it, but its caller waits all the same
      inline_streak_ = std::min(inline_streak_ + 1, kBlockingStreak);
      return false;
    }
    if (running_task_ || has_pending_ || failure_ || stop_ || queue_.empty()) return false;
    if (queue_.front().state.get() != state || !queue_.front().fn) return false;
    task = std::move(queue_.front());
    queue_.pop_front();
    running_task_ = true;
  }
  if (guarded(*task.state, task.fn)) finish(*task.state, std::nullopt);
  bool more;
  {
    std::lock_guard lock(mu_);
    running_task_ = false;
    inline_streak_ = std::min(inline_streak_ + 1, kBlockingStreak);
    more = !queue_.empty() || stop_;
  }
  if (more) cv_.notify_one();  // otherwise the engine sleeps on until the next submit wakes it
  return true;
}

void Engine::loop() {
  auto nap = std::chrono::microseconds(20);
  for (;;) {
    Task task;
    {
      std::unique_lock lock(mu_);
      for (;;) {
        if (running_task_) {  // a caller runs a collective inline; it notifies when more is queued
          sleep_locked(lock);
          continue;
        }
        if (!queue_.empty()) {
          const Task& front = queue_.front();
          // In blocking style the caller runs each collective itself: leave it a tick to come
          // (it may be descheduled between submit and wait), sleeping meanwhile.
          const bool blocking = inline_streak_ >= kBlockingStreak;
          const Clock::time_point ready = front.queued_at + (blocking ? kIdleTick : kClaimGrace);
          if (queue_.size() > 1 || !front.fn || stop_ || Clock::now() >= ready) break;
          if (blocking) {
            // Asleep in blocking style: a submit queued once the caller claimed this one does
            // not wake it either (enqueue), or every operation would cost the caller two switches
            // on its core while the engine waits out one collective after another.
            claim_wait_ = true;
            cv_.wait_until(lock, ready);
            claim_wait_ = false;
            continue;
          }
          lock.unlock();  // a lone new collective: its caller may be about to wait and run it
          while (Clock::now() < ready) sched_yield();
          lock.lock();
          continue;
        }
        if (stop_) break;
        if (pending_.empty()) {
          // In blocking style the caller runs each collective itself: a poll would find only the
          // next one, which the engine leaves to its caller anyway, and would take turns with
          // that caller on its core after every tick. Sleep on (sleep_locked ticks).
          if (inline_streak_ < kBlockingStreak) {
            lock.unlock();
            const bool work = poll_for_work();
            lock.lock();
            if (work) continue;
          }
          if (queue_.empty() && !stop_) sleep_locked(lock);
          continue;
        }
        lock.unlock();
        poll_pending();
        lock.lock();
        has_pending_ = !pending_.empty();
        if (queue_.empty() && !pending_.empty() && !stop_) {
          cv_.wait_for(lock, nap);
          nap = std::min<std::chrono::microseconds>(nap * 2, std::chrono::milliseconds(1));
        }
      }
      if (queue_.empty()) break;  // stopping
      // Collectives queued behind one another, or one nobody came for within a tick: not
      // blocking style.
      const bool unwaited = queue_.size() > 1 || Clock::now() >= queue_.front().queued_at + kIdleTick;
      task = std::move(queue_.front());
      queue_.pop_front();
      running_task_ = true;
      if (task.fn) {
        engine_state_ = task.state.get();
        if (unwaited) inline_streak_ = 0;
      }
    }
    nap = std::chrono::microseconds(20);
    if (task.post) {
      RequestPtr req;
      if (guarded(*task.state, [&] { req = task.post(); }))
        pending_.push_back({task.state, req, std::move(task.done), Deadline::after(task.timeout)});
    } else {
      wait_all_pending();
      if (guarded(*task.state, task.fn)) finish(*task.state, std::nullopt);
    }
    std::lock_guard lock(mu_);
    running_task_ = false;
    engine_state_ = nullptr;
    has_pending_ = !pending_.empty();
  }
  // Stopping: point-to-point operations still pending fail, and the transport lets go of their buffers.
  if (!pending_.empty()) transport_->abort("communicator destroyed with point-to-point operations pending");
  for (auto& p : pending_)
    finish(*p.state, aborted_error("{}: communicator destroyed before it completed", p.state->what()));
}

}  // namespace trn
