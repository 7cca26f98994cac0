// A real trn-coordinator process for integration tests: started on loopback port 0 (or a
// given port, to restart on the same address), found through --port-file, logging to a file
// (so a full pipe never stalls it), killed with its process group at the end.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/process.h"

namespace trn::test {

class CoordinatorProcess {
 public:
  CoordinatorProcess(std::string workdir, std::vector<std::string> args)
      : dir_(std::move(workdir)), args_(std::move(args)) {
    start(0);
  }

  void start(int port) {
    std::string pf = dir_ + "/port";
    std::filesystem::remove(pf);
    std::string cmd = "exec " + bin("trn-coordinator") + " --listen 127.0.0.1:" + std::to_string(port) +
                      " --port-file " + pf;
    for (const auto& a : args_) cmd += " '" + a + "'";
    cmd += " 2>>" + dir_ + "/coordinator.log";
    proc_ = std::make_unique<Process>(ProcSpec{{"/bin/sh", "-c", cmd}, {{"TRN_LOG_LEVEL", "debug"}}});
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < deadline) {
      std::ifstream in(pf);
      int p = 0;
      if (in >> p && p > 0) {
        port_ = p;
        return;
      }
      if (!proc_->running()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    throw std::runtime_error("trn-coordinator did not start: " + log());
  }

  void kill9() {
    proc_->signal(SIGKILL);
    proc_->wait(std::chrono::steady_clock::now() + std::chrono::seconds(10));
  }
  void restart_same_port() { start(port_); }
  // SIGTERM and the exit code.
  ProcResult terminate() {
    proc_->signal(SIGTERM);
    return proc_->wait(std::chrono::steady_clock::now() + std::chrono::seconds(10));
  }
  bool running() { return proc_->running(); }
  int port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  std::string log() const {
    std::ifstream in(dir_ + "/coordinator.log");
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  std::string dir_;
  std::vector<std::string> args_;
  std::unique_ptr<Process> proc_;
  int port_ = 0;
};

}  // namespace trn::test
