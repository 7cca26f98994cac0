#include "collectives/core/main.h"

#include <fmt/format.h>

#include <signal.h>

#include <cstdio>
#include <exception>
#include <new>

#include "collectives/core/error.h"
#include "collectives/core/settings.h"

namespace trn {
namespace {

// SIGINT and SIGTERM end the process at once until the program installs its own stop handlers
// (trn-train's step-boundary stop, trnrun's forwarding). A handler found here was not inherited
// (exec resets handlers; an ignored signal stays ignored and is kept so) but installed by a
// constructor of a library loaded with trn: libinfinipath, which libfabric's psm provider links,
// installs one that calls exit(). exit() runs libfabric's destructor, which takes the lock a
// thread inside fi_getinfo holds, so a SIGTERM during start-up (trnrun stopping a rank whose peer
// made a usage error) hung the rank on its own lock, with SIGTERM blocked inside the handler,
// until SIGKILL. Providers that install handlers later (shm's, which unlinks its files) chain to
// the default action restored here, which ends the process.
void default_stop_signals() {
  for (int sig : {SIGINT, SIGTERM}) {
    struct sigaction now {};
    if (sigaction(sig, nullptr, &now) != 0) continue;
    const bool handler = (now.sa_flags & SA_SIGINFO) || (now.sa_handler != SIG_DFL && now.sa_handler != SIG_IGN);
    if (!handler) continue;
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, nullptr);
  }
}

}  // namespace

int run_main(const char* program, const std::function<int()>& body) {
  default_stop_signals();
  try {
    settings::validate();  // a bad TRN_* value ends the program before it starts (settings.h)
    return body();
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kUsage)
      fmt::print(stderr, "{}: error: {}\n", program, e.what());
    else
      fmt::print(stderr, "{}: {}: {}\n", program, to_string(e.kind()), e.what());
    return exit_code_for(e.kind());
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "{}: error: out of memory\n", program);
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}: internal error (a trn bug, please report it): {}\n", program, e.what());
    return 1;
  }
}

}  // namespace trn
