// trnrun's signal handling: SIGINT, SIGTERM and SIGHUP are recorded (to be forwarded to the
// workers), SIGCHLD wakes the agent's loop, SIGPIPE is ignored. Waiting is a poll on a self-pipe,
// so a signal interrupts any wait at once. One watcher may exist at a time.
#pragma once

#include "collectives/core/deadline.h"

namespace trn::launch {

class SignalWatcher {
 public:
  SignalWatcher();   // installs the handlers
  ~SignalWatcher();  // restores the previous ones
  SignalWatcher(const SignalWatcher&) = delete;
  SignalWatcher& operator=(const SignalWatcher&) = delete;

  // The first terminating signal received (SIGINT, SIGTERM or SIGHUP), or 0.
  int first_signal() const;
  // How many terminating signals arrived (a second one means "stop now").
  int count() const;
  // Sleeps until a signal arrives, notify() is called, or timeout passes.
  void wait(Duration timeout);
  // Wakes wait() from another thread.
  void notify();
};

}  // namespace trn::launch
