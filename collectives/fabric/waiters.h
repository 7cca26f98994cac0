// The waiter hand-off of the transport (transport.h, "Locking"). Internal to collectives/fabric.
//
// Several threads may wait at once (each communicator has its own engine thread). Only one of
// them sleeps in epoll (the leader); the others sleep on a condition variable that every
// progress which completed an operation notifies, and the leader on waking hands its place to a
// follower; a progress that completes something while the leader sleeps writes an eventfd in
// its epoll set. Otherwise a thread could sleep in epoll on completions another thread already
// read from the queue, and wake only at the next unrelated event. Every field is guarded by the
// transport's lock, except the fds, which are set once.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>

namespace trn::fabric {

// Whether a wait spins (Options::spin) before it polls yielding the core. A spin pays when the
// peer runs on another core: its message lands while this rank polls. When the peer shares this
// rank's core, the message cannot come until the spinner gives the core up, so every hop of a
// small collective costs the whole spin and a switch (bench/results/2026-12-07-all-to-all-v.md).
//
// Each wait reports how it ended: caught (the spin saw the completion after polling at least
// once), missed (the spin ran out, and the completion came within the first kFewYields yields,
// one of which gave the core away briefly: another thread, the peer, ran on it for a moment), or
// neither (it completed at the first poll; or only after many yields or a sleep, a slow peer;
// or no yield gave the core away, an idle core; or one gave it away for a scheduler slice, to
// other work on a busy host). After kSkipAfter misses in a row waits skip the spin, spinning
// again on every kProbeEvery-th to see whether it pays again; a caught spin resets the count.
// The transport keeps one per waiting thread (thread_local), as each engine thread and inline
// caller waits for itself.
class SpinGovernor {
 public:
  static constexpr int kSkipAfter = 4;
  static constexpr uint32_t kProbeEvery = 16;
  static constexpr int kFewYields = 4;
  // A yield that took this long let another thread run (a bare sched_yield returns in about a
  // microsecond); one this long or longer was a scheduler slice of other work, not the peer's hop.
  static constexpr std::chrono::nanoseconds kGaveCore{2000}, kSlice{500000};
  enum class Outcome { kCaught, kMissed, kNeither };

  // Once per wait, at its start.
  bool should_spin() { return misses_ < kSkipAfter || ++skipped_ % kProbeEvery == 0; }
  void record(Outcome o) {
    if (o == Outcome::kCaught) misses_ = 0;
    if (o == Outcome::kMissed) misses_ = std::min(misses_ + 1, kSkipAfter);
  }
  static bool gave_core(std::chrono::nanoseconds yield_took) { return yield_took >= kGaveCore && yield_took < kSlice; }
  // The outcome of a wait from where its completion found it: polls before it, whether the spin
  // had run out, yields since, whether one of them gave the core away briefly (gave_core), and
  // whether it slept.
  static Outcome outcome(unsigned polls, bool past_spin, int yields, bool gave_core, bool slept) {
    if (polls == 0 || slept) return Outcome::kNeither;
    if (!past_spin) return Outcome::kCaught;
    return yields <= kFewYields && gave_core ? Outcome::kMissed : Outcome::kNeither;
  }

 private:
  int misses_ = 0;
  uint32_t skipped_ = 0;
};

struct Waiters {
  Waiters();  // opens the epoll set with the abort and wake eventfds in it
  ~Waiters();
  Waiters(const Waiters&) = delete;
  Waiters& operator=(const Waiters&) = delete;

  // Adds a completion queue's wait fd (-1: none) to the epoll set; can_sleep goes false if that fails.
  void watch_fd(int fd);
  // The end of every progress: wakes the followers, and the leader, when it completed something.
  void announce();
  void wake_for_abort();  // writes abort_fd: a leader in epoll returns at once
  void leader_woke();     // the leader is back from epoll: drains the wake fd, hands over

  int epoll_fd = -1;
  int abort_fd = -1;
  int wake_fd = -1;  // in the epoll set: written when another thread completed something
  bool can_sleep = false;
  std::condition_variable woken;
  bool fd_sleeper = false;    // a waiter sleeps in epoll
  uint64_t fd_announced = 0;  // completions when wake_fd was last written
  int followers = 0;          // waiters sleeping on woken
  uint64_t completions = 0;   // operations finished so far
  uint64_t announced = 0;     // completions when woken was last notified
};

}  // namespace trn::fabric
