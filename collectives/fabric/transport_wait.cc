// Waiting and aborting: the parts of Transport that sleep or wake sleepers, and the waiter
// hand-off they share (waiters.h).
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

#include "collectives/core/log.h"
#include "collectives/fabric/tag.h"
#include "collectives/fabric/transport.h"

namespace trn::fabric {

Waiters::Waiters() {
  abort_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  epoll_event ev{};
  ev.events = EPOLLIN;
  can_sleep = abort_fd >= 0 && epoll_fd >= 0 && epoll_ctl(epoll_fd, EPOLL_CTL_ADD, abort_fd, &ev) == 0;
  wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  can_sleep = can_sleep && wake_fd >= 0 && epoll_ctl(epoll_fd, EPOLL_CTL_ADD, wake_fd, &ev) == 0;
}

Waiters::~Waiters() {
  if (epoll_fd >= 0) close(epoll_fd);
  if (abort_fd >= 0) close(abort_fd);
  if (wake_fd >= 0) close(wake_fd);
}

void Waiters::watch_fd(int fd) {
  epoll_event ev{};
  ev.events = EPOLLIN;
  if (can_sleep && fd >= 0 && epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev) != 0) can_sleep = false;
}

void Waiters::announce() {
  if (followers > 0 && completions != announced) {
    announced = completions;
    woken.notify_all();
  }
  if (fd_sleeper && completions != fd_announced && wake_fd >= 0) {
    fd_announced = completions;
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(wake_fd, &one, sizeof(one));
  }
}

void Waiters::wake_for_abort() {
  if (abort_fd < 0) return;
  uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(abort_fd, &one, sizeof(one));
}

void Waiters::leader_woke() {
  fd_sleeper = false;
  fd_announced = completions;
  uint64_t drained;
  [[maybe_unused]] ssize_t n = read(wake_fd, &drained, sizeof(drained));
  if (followers > 0) woken.notify_one();  // a follower may take the fds over
}

Error Transport::aborted_error_now() const {
  std::lock_guard lock(abort_mu_);
  return aborted_error("rank {}: fabric aborted: {}", rank_, abort_reason_);
}

Error Transport::timeout(const Op& op) const {
  const bool control = op.msg_tag & wire::kControlBit;
  const Endpoint* ep = router_.endpoint_of(op);
  return timeout_error(
      "rank {}: {}{} {} tag {:#x} ({} bytes over {}{}) did not complete by its deadline: the peer "
      "may have died or stopped answering (TRN_TIMEOUT sets the default deadline)",
      rank_, control ? "fabric handshake: " : "", op.send ? "send to" : "receive from", router_.peer_name(op.peer),
      wire::user_part(op.msg_tag), op.len, ep ? ep->provider() + " on " + ep->domain_name() : "a closed endpoint",
      router_.ring(op.peer) ? " and trn's shared-memory ring" : "");
}

bool Transport::test(Op& op) {
  std::lock_guard lock(mu_);
  if (!op.done) {
    if (aborted()) throw aborted_error_now();
    router_.progress();
  }
  if (!op.done) return false;
  if (op.error) throw *op.error;
  return true;
}

// kOnFds when every endpoint with outstanding work has a wait fd and fi_trywait says sleeping on
// them is safe; kNotYet when completions are pending; kNap when a busy endpoint has no fd. An idle
// endpoint without an fd (shm) does not keep the waiter from sleeping.
Transport::Sleep Transport::how_to_sleep_locked() {
  if (!waiters_.can_sleep) return Sleep::kNap;
  const std::vector<char> busy = router_.busy();
  const std::vector<Endpoint*>& eps = router_.endpoints();
  for (size_t i = 0; i < eps.size(); ++i) {
    if (!eps[i] || (eps[i]->wait_fd() < 0 && !busy[i])) continue;
    if (eps[i]->wait_fd() < 0) return Sleep::kNap;
    int rc = eps[i]->try_wait();
    if (rc == -FI_EAGAIN) return Sleep::kNotYet;
    if (rc != 0) {
      log::debug(log::Subsys::kFabric, "{} fi_trywait: {}; waits nap instead", eps[i]->provider(), fi_strerror(-rc));
      waiters_.can_sleep = false;
      return Sleep::kNap;
    }
  }
  return Sleep::kOnFds;
}

namespace {
thread_local SpinGovernor spin_governor;  // waiters.h: per waiting thread
}  // namespace

void Transport::wait(Op& op, Deadline deadline) {
  // The spin, unless TRN_FABRIC_SPIN_US fixed it, as the governor finds it pays (waiters.h).
  const bool spin = !opts_.spin_auto || spin_governor.should_spin();
  const auto spin_end = Clock::now() + (spin ? opts_.spin : Duration::zero());
  // After the spin, poll yielding the core until yield_end (Options::yield), then sleep. Only a
  // wait with an operation in flight gets here.
  const auto yield_end = spin_end + opts_.yield;
  int nap_us = 0, yields = 0;
  bool spun = false;  // past the spin: every poll reads the clock
  bool slept = false, gave_core = false;
  for (unsigned polls = 0;; ++polls) {
    Sleep how = Sleep::kNap;
    bool yield = false;
    {
      std::unique_lock lock(mu_);
      if (!op.done && !aborted()) router_.progress();
      if (op.done) {
        if (opts_.spin_auto) spin_governor.record(SpinGovernor::outcome(polls, spun, yields, gave_core, slept));
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
        if (how == Sleep::kOnFds && waiters_.fd_sleeper) {
          // Another waiter sleeps on the fds: sleep until a progress completes something (or
          // that waiter leaves), then look again.
          slept = true;
          ++waiters_.followers;
          waiters_.woken.wait_until(lock, std::min(deadline.when(), now + std::chrono::milliseconds(100)));
          --waiters_.followers;
          continue;
        }
        if (how == Sleep::kOnFds) {
          waiters_.fd_sleeper = true;
          waiters_.fd_announced = waiters_.completions;
        }
      }
    }
    if (yield) {
      const auto before = Clock::now();
      sched_yield();
      gave_core |= SpinGovernor::gave_core(Clock::now() - before);
      ++yields;
      continue;
    }
    slept = true;
    if (how == Sleep::kOnFds) {
      sleep_on_fds(deadline);
    } else {
      // No fd to sleep on: nap, starting short so latency stays low, growing to 1 ms.
      nap_us = std::min(std::max(nap_us * 2, 8), 1000);
      std::this_thread::sleep_for(std::min<Duration>(std::chrono::microseconds(nap_us), deadline.remaining()));
    }
  }
}

// The leader's sleep: in epoll on the completion queues, the wake fd and the abort fd.
void Transport::sleep_on_fds(Deadline deadline) {
  auto ms = std::chrono::ceil<std::chrono::milliseconds>(deadline.remaining()).count();
  epoll_event events[4];
  // At most 250 ms: the peer watch probes from progress (peer_watch.h).
  epoll_wait(waiters_.epoll_fd, events, 4, static_cast<int>(std::clamp<int64_t>(ms, 1, 250)));
  std::lock_guard lock(mu_);
  waiters_.leader_woke();
}

void Transport::abort(const std::string& reason) {
  {
    std::lock_guard lock(abort_mu_);
    if (!aborted_.load()) abort_reason_ = reason.empty() ? "abort() called" : reason;
    aborted_.store(true, std::memory_order_release);
  }
  waiters_.wake_for_abort();
  std::lock_guard lock(mu_);
  if (!router_.endpoints().empty()) log::info(log::Subsys::kFabric, "rank {}: fabric aborted: {}", rank_, reason);
  teardown_locked();
  waiters_.woken.notify_all();
}

}  // namespace trn::fabric
