// Waiting and aborting: the parts of Transport that sleep or wake sleepers.
#include <sched.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

#include "collectives/core/log.h"
#include "collectives/fabric/tag.h"
#include "collectives/fabric/transport.h"

namespace trn::fabric {

Error Transport::aborted_error_now() const {
  std::lock_guard lock(abort_mu_);
  return aborted_error("rank {}: fabric aborted: {}", rank_, abort_reason_);
}

Error Transport::timeout(const Op& op) const {
  const bool control = op.msg_tag & wire::kControlBit;
  const Endpoint* ep = op.ep ? op.ep : peers_[op.peer].ep;
  return timeout_error(
      "rank {}: {}{} {} tag {:#x} ({} bytes over {}{}) did not complete by its deadline: the peer "
      "may have died or stopped answering (TRN_TIMEOUT sets the default deadline)",
      rank_, control ? "fabric handshake: " : "", op.send ? "send to" : "receive from", peer_name(op.peer),
      wire::user_part(op.msg_tag), op.len, ep ? ep->provider() + " on " + ep->domain_name() : "a closed endpoint",
      peers_[op.peer].ring ? " and trn's shared-memory ring" : "");
}

bool Transport::test(Op& op) {
  std::lock_guard lock(mu_);
  if (!op.done) {
    if (aborted()) throw aborted_error_now();
    progress_locked();
  }
  if (!op.done) return false;
  if (op.error) throw *op.error;
  return true;
}

// kOnFds when every endpoint with outstanding work has a wait fd and fi_trywait says sleeping on
// them is safe; kNotYet when completions are pending; kNap when a busy endpoint has no fd. An idle
// endpoint without an fd (shm) does not keep the waiter from sleeping.
Transport::Sleep Transport::how_to_sleep_locked() {
  if (!can_sleep_) return Sleep::kNap;
  std::vector<char> busy(endpoints_.size(), 0);
  // The peer watch's standing receives do not count: a notice over shm may wait for the next
  // wake-up (at most a second), which is no reason to nap through every wait.
  for (const auto& [p, op] : active_)
    if (op->role != Op::Role::kWatch) {
      // A ring operation counts as shm's: rings are polled, never slept on.
      const Endpoint* ep = op->on_fabric ? op->ep : peers_[op->peer].ep;
      for (size_t i = 0; i < endpoints_.size(); ++i)
        if (endpoints_[i] == ep) busy[i] = 1;
    }
  const std::vector<Endpoint*>& eps = endpoints_;
  for (size_t i = 0; i < eps.size(); ++i) {
    if (!eps[i] || (eps[i]->wait_fd() < 0 && !busy[i])) continue;
    if (eps[i]->wait_fd() < 0) return Sleep::kNap;
    int rc = eps[i]->try_wait();
    if (rc == -FI_EAGAIN) return Sleep::kNotYet;
    if (rc != 0) {
      log::debug(log::Subsys::kFabric, "{} fi_trywait: {}; waits nap instead", eps[i]->provider(), fi_strerror(-rc));
      can_sleep_ = false;
      return Sleep::kNap;
    }
  }
  return Sleep::kOnFds;
}

void Transport::wait(Op& op, Deadline deadline) {
  const auto spin_end = Clock::now() + opts_.spin;
  // After the spin, poll yielding the core until yield_end (Options::yield), then sleep. Only a
  // wait with an operation in flight gets here.
  const auto yield_end = spin_end + opts_.yield;
  int nap_us = 0;
  bool spun = false;  // past the spin: every poll reads the clock
  for (unsigned polls = 0;; ++polls) {
    Sleep how = Sleep::kNap;
    bool yield = false;
    {
      std::unique_lock lock(mu_);
      if (!op.done && !aborted()) progress_locked();
      if (op.done) {
        if (op.error) throw *op.error;
        return;
      }
      if (aborted()) throw aborted_error_now();
      if (!spun && polls % 8 != 0) continue;  // spinning: a clock read costs as much as a poll
      const auto now = Clock::now();
      if (now >= deadline.when()) throw timeout(op);
      if (now < spin_end) continue;
      spun = true;
      yield = now < yield_end;
      if (!yield) {
        how = how_to_sleep_locked();
        if (how == Sleep::kNotYet) continue;  // completions are pending: poll again
        if (how == Sleep::kOnFds && fd_sleeper_) {
          // Another waiter sleeps on the fds: sleep until a progress completes something (or
          // that waiter leaves), then look again.
          ++followers_;
          woken_.wait_until(lock, std::min(deadline.when(), now + std::chrono::milliseconds(100)));
          --followers_;
          continue;
        }
        if (how == Sleep::kOnFds) {
          fd_sleeper_ = true;
          fd_announced_ = completions_;
        }
      }
    }
    if (yield) {
      sched_yield();
      continue;
    }
    if (how == Sleep::kOnFds) {
      auto ms = std::chrono::ceil<std::chrono::milliseconds>(deadline.remaining()).count();
      epoll_event events[4];
      // At most 250 ms: the peer watch probes from progress (transport_watch.cc).
      epoll_wait(epoll_fd_, events, 4, static_cast<int>(std::clamp<int64_t>(ms, 1, 250)));
      std::lock_guard lock(mu_);
      fd_sleeper_ = false;
      fd_announced_ = completions_;
      uint64_t drained;
      [[maybe_unused]] ssize_t n = read(wake_fd_, &drained, sizeof(drained));
      if (followers_ > 0) woken_.notify_one();  // a follower may take the fds over
    } else {
      // No fd to sleep on: nap, starting short so latency stays low, growing to 1 ms.
      nap_us = std::min(std::max(nap_us * 2, 8), 1000);
      std::this_thread::sleep_for(std::min<Duration>(std::chrono::microseconds(nap_us), deadline.remaining()));
    }
  }
}

void Transport::abort(const std::string& reason) {
  {
    std::lock_guard lock(abort_mu_);
    if (!aborted_.load()) abort_reason_ = reason.empty() ? "abort() called" : reason;
    aborted_.store(true, std::memory_order_release);
  }
  if (abort_fd_ >= 0) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(abort_fd_, &one, sizeof(one));
  }
  std::lock_guard lock(mu_);
  if (main_) log::info(log::Subsys::kFabric, "rank {}: fabric aborted: {}", rank_, reason);
  teardown_locked();
  woken_.notify_all();
}

}  // namespace trn::fabric
