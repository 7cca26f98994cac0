// The coordinator trnrun starts for a one-node job run without --coordinator: the trn-coordinator
// program next to trnrun, listening on a free loopback port (`--listen 127.0.0.1:0 --port-file F`),
// stopped (SIGTERM, then SIGKILL) when trnrun ends. It dies with trnrun (PR_SET_PDEATHSIG).
// Its port file lives in $TMPDIR/trnrun-<trnrun's pid>-XXXXXX, removed when trnrun ends; one
// left by a trnrun that was SIGKILLed is removed by the next trnrun (remove_stale_run_dirs).
#pragma once

#include <sys/types.h>

#include <string>

#include "collectives/core/deadline.h"

namespace trn::launch {

class EmbeddedCoordinator {
 public:
  // program: path of trn-coordinator; token_file: passed on when not empty; log_path: where its
  // output goes (empty: trnrun's stderr; else written as PATH.partial, renamed once it stopped).
  // Waits until it reports its port, or throws.
  EmbeddedCoordinator(const std::string& program, const std::string& token_file, const std::string& log_path,
                      Deadline deadline);
  ~EmbeddedCoordinator();
  EmbeddedCoordinator(const EmbeddedCoordinator&) = delete;
  EmbeddedCoordinator& operator=(const EmbeddedCoordinator&) = delete;

  const std::string& address() const { return address_; }  // 127.0.0.1:PORT
  pid_t pid() const { return pid_; }
  // trnrun's private folder (mode 0700) that holds its port file, removed with it.
  const std::string& dir() const { return dir_; }
  // False once it has exited (it should not before stop()).
  bool running();
  // "" while it runs (or once stop() ended it); else one line saying that it ended, and how.
  std::string lost();
  void stop(Duration grace);

 private:
  void finish_log();

  pid_t pid_ = -1;
  std::string log_path_;  // empty once finished (or when there is none)
  bool reaped_ = false;
  bool stopping_ = false;
  int status_ = 0;  // its wait status, once reaped
  std::string dir_;
  std::string address_;
};

// Removes $TMPDIR/trnrun-<pid>-* folders of this user whose trnrun (pid) no longer runs.
// Returns how many it removed.
int remove_stale_run_dirs();

// The folder holding the running executable (where trn-coordinator is installed beside trnrun).
std::string own_bin_dir();

}  // namespace trn::launch
