#include "collectives/engine.h"

#include "collectives/core/log.h"

namespace trn {

Engine::Engine(std::shared_ptr<PointToPoint> transport) : transport_(std::move(transport)) {
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
    if (!queue_.empty() || running_task_)
      fail_locked(aborted_error("communicator destroyed with operations in flight"));
  }
  cv_.notify_all();
  thread_.join();
}

void Engine::finish(WorkState& s, std::optional<Error> error) {
  {
    std::lock_guard lock(s.mu);
    s.error = std::move(error);
    s.done = true;
  }
  s.cv.notify_all();
}

void Engine::submit(std::shared_ptr<WorkState> state, std::function<void()> fn) {
  std::unique_lock lock(mu_);
  if (failure_) {
    lock.unlock();
    finish(*state, aborted_error("{}: communicator failed earlier: {}", state->what, failure_->what()));
    return;
  }
  queue_.push_back({std::move(state), std::move(fn)});
  lock.unlock();
  cv_.notify_one();
}

void Engine::fail_locked(const Error& e) {
  if (!failure_) failure_ = e;
  for (auto& t : queue_)
    finish(*t.state, aborted_error("{}: communicator failed earlier: {}", t.state->what, failure_->what()));
  queue_.clear();
  transport_->abort(failure_->what());
}

void Engine::abort(const std::string& reason) {
  std::lock_guard lock(mu_);
  log::warn(log::Subsys::kColl, "communicator aborted: {}", reason);
  fail_locked(aborted_error("aborted: {}", reason));
}

bool Engine::failed() const {
  std::lock_guard lock(mu_);
  return failure_.has_value();
}

void Engine::loop() {
  for (;;) {
    Task task;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping
      task = std::move(queue_.front());
      queue_.pop_front();
      running_task_ = true;
    }
    std::optional<Error> error;
    try {
      task.fn();
    } catch (const Error& e) {
      error = e.with_context(task.state->what);
    } catch (const std::exception& e) {
      error = internal_error("{}: {}", task.state->what, e.what());
    }
    {
      std::lock_guard lock(mu_);
      running_task_ = false;
      if (error) {
        // An aborted transport fails the operation with the abort's reason; keep the first cause.
        if (!failure_) log::error(log::Subsys::kColl, "{}", error->what());
        fail_locked(*error);
      }
    }
    finish(*task.state, std::move(error));
  }
}

}  // namespace trn
