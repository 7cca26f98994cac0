#include "launcher/agent/signals.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <iterator>

#include "collectives/core/error.h"

namespace trn::launch {
namespace {

constexpr int kHandled[] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD};

int g_pipe[2] = {-1, -1};
std::atomic<int> g_first{0};
std::atomic<int> g_count{0};
std::atomic<bool> g_active{false};
struct sigaction g_old[std::size(kHandled)];
struct sigaction g_old_pipe;

void on_signal(int sig) {
  int saved = errno;
  if (sig != SIGCHLD) {
    int expected = 0;
    g_first.compare_exchange_strong(expected, sig);
    g_count.fetch_add(1);
  }
  char c = static_cast<char>(sig);
  (void)!::write(g_pipe[1], &c, 1);
  errno = saved;
}

}  // namespace

SignalWatcher::SignalWatcher() {
  if (g_active.exchange(true)) throw internal_error("only one SignalWatcher may exist at a time");
  if (pipe2(g_pipe, O_CLOEXEC | O_NONBLOCK) != 0) throw internal_error("pipe2 failed: errno {}", errno);
  g_first = 0;
  g_count = 0;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (size_t i = 0; i < std::size(kHandled); ++i) sigaction(kHandled[i], &sa, &g_old[i]);
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigaction(SIGPIPE, &ignore, &g_old_pipe);
}

SignalWatcher::~SignalWatcher() {
  for (size_t i = 0; i < std::size(kHandled); ++i) sigaction(kHandled[i], &g_old[i], nullptr);
  sigaction(SIGPIPE, &g_old_pipe, nullptr);
  ::close(g_pipe[0]);
  ::close(g_pipe[1]);
  g_pipe[0] = g_pipe[1] = -1;
  g_active = false;
}

int SignalWatcher::first_signal() const { return g_first.load(); }
int SignalWatcher::count() const { return g_count.load(); }

void SignalWatcher::wait(Duration timeout) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count();
  pollfd p{g_pipe[0], POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(std::max<int64_t>(ms, 0))) > 0) {
    char buf[64];
    while (::read(g_pipe[0], buf, sizeof(buf)) > 0) {
    }
  }
}

void SignalWatcher::notify() {
  char c = 0;
  (void)!::write(g_pipe[1], &c, 1);
}

}  // namespace trn::launch
