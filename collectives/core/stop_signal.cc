#include "collectives/core/stop_signal.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>

namespace trn::stop_signal {
namespace {

std::atomic<int> g_signal{0};
std::atomic<bool> g_deferred{true};

void on_signal(int sig) {
  if (!g_deferred.load()) {
    signal(sig, SIG_DFL);
    raise(sig);  // pending until this handler returns, then ends the process
    return;
  }
  if (g_signal.exchange(sig) != 0) _exit(128 + sig);  // a second signal: now
}

}  // namespace

void install(bool deferred) {
  g_deferred = deferred;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM}) sigaction(sig, &sa, nullptr);
}

void set_deferred(bool deferred) { g_deferred = deferred; }

int received() { return g_signal.load(); }

}  // namespace trn::stop_signal
