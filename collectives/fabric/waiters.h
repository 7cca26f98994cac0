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

#include <condition_variable>
#include <cstdint>

namespace trn::fabric {

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
