// A test bed of hosts for one test (tests/multihost/testbed.sh): made by the constructor,
// removed by the destructor, so a failing test never leaves namespaces or processes behind.
// A bed left over by a test that was killed is swept when the next one starts.
#pragma once

#include <fmt/format.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "tests/support/process.h"

namespace trn::test {

class Bed {
 public:
  // rails > 1: each host gets interfaces eth0..eth(rails-1), one switch per rail; rate (a tc
  // rate, e.g. "200mbit") caps every rail link each way.
  explicit Bed(int hosts, int rails = 1, const std::string& rate = "")
      : hosts_(hosts), name_(fmt::format("m{}", getpid() % 10000000)) {
    if (geteuid() != 0)
      throw std::runtime_error("multi-host tests need root (network namespaces); run them as root");
    sh("sweep");
    sh(fmt::format("up {} {} --rails {}{}", name_, hosts, rails, rate.empty() ? "" : " --rate " + rate));
  }
  ~Bed() { std::system(fmt::format("{} down {} >/dev/null 2>&1", script(), name_).c_str()); }
  Bed(const Bed&) = delete;
  Bed& operator=(const Bed&) = delete;

  static std::string script() { return std::string(TRN_SOURCE_DIR) + "/tests/multihost/testbed.sh"; }
  static std::string rsh_agent() { return std::string(TRN_SOURCE_DIR) + "/tests/multihost/trn-rsh"; }

  int hosts() const { return hosts_; }
  const std::string& name() const { return name_; }
  std::string hostname(int k) const { return fmt::format("{}-h{}", name_, k); }
  std::string addr(int k, int rail = 0) const { return fmt::format("10.{}.{}.{}", 213 + rail, subnet(), k + 1); }

  // argv run inside host k (its network namespace and hostname).
  std::vector<std::string> in(int k, const std::vector<std::string>& argv) const {
    std::vector<std::string> c = {script(), "exec", name_, std::to_string(k)};
    c.insert(c.end(), argv.begin(), argv.end());
    return c;
  }
  // Delay and loss on host k's link of rail `rail`, both directions ("delay 1ms", "loss 100%",
  // "" clears).
  void netem(int k, const std::string& args, int rail = 0) const {
    sh(fmt::format("netem {} {} '{}' {}", name_, k, args, rail));
  }
  // Every process in host k dies at once (SIGKILL), as when the machine goes down.
  void kill(int k) const { sh(fmt::format("kill {} {}", name_, k)); }

  // Bytes host k has sent on interface dev so far: its tx_bytes counter, read inside the host
  // from /proc/net/dev (which follows the reader's network namespace; sysfs there shows the
  // bed's creator's).
  uint64_t tx_bytes(int k, const std::string& dev) const {
    const std::string cmd = fmt::format("{} exec {} {} cat /proc/net/dev", script(), name_, k);
    std::string text;
    if (FILE* f = ::popen(cmd.c_str(), "r")) {
      char buf[4096];
      size_t n;
      while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
      ::pclose(f);
    }
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) {
      const size_t colon = line.find(':');
      if (colon == std::string::npos) continue;
      std::string name = line.substr(0, colon);
      name.erase(0, name.find_first_not_of(' '));
      if (name != dev) continue;
      std::istringstream w(line.substr(colon + 1));
      uint64_t v[9] = {};
      for (auto& x : v) w >> x;  // 8 receive counters, then tx_bytes
      return v[8];
    }
    throw std::runtime_error(fmt::format("test bed: host {} has no interface {}", k, dev));
  }

  // mpirun in host 0 starting ranks_per_host[k] ranks of argv in host k, through trn-rsh (the
  // hostfile goes into dir); env is passed to every rank (-x).
  std::vector<std::string> mpirun(const std::string& dir, const std::vector<int>& ranks_per_host,
                                  const std::vector<std::string>& argv,
                                  const std::map<std::string, std::string>& env = {}) const {
    const std::string hostfile = dir + "/hostfile";
    std::ofstream f(hostfile);
    int np = 0;
    for (size_t k = 0; k < ranks_per_host.size(); ++k) {
      f << fmt::format("{} slots={}\n", hostname(int(k)), ranks_per_host[k]);
      np += ranks_per_host[k];
    }
    std::vector<std::string> c = {"mpirun",        "--allow-run-as-root", "--oversubscribe", "--mca",
                                  "plm_rsh_agent", rsh_agent(),           "--hostfile",      hostfile,
                                  "-np",           std::to_string(np),    "--map-by",        "slot"};
    for (const auto& [k, v] : env) c.insert(c.end(), {"-x", k + "=" + v});
    c.insert(c.end(), argv.begin(), argv.end());
    return in(0, c);
  }

 private:
  void sh(const std::string& args) const {
    const std::string cmd =
        fmt::format("TESTBED_OWNER={} TRN_NETDELAY={} {} {}", getpid(), bin("trn-netdelay"), script(), args);
    if (std::system(cmd.c_str()) != 0) throw std::runtime_error("test bed: '" + cmd + "' failed");
  }
  std::string subnet() const {
    auto s = file(fmt::format("/run/trn-testbed/{}/subnet", name_));
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
    return s;
  }
  static std::string file(const std::string& path) {
    std::string out;
    if (FILE* f = std::fopen(path.c_str(), "r")) {
      char buf[256];
      size_t n;
      while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
      std::fclose(f);
    }
    return out;
  }

  int hosts_;
  std::string name_;
};

}  // namespace trn::test
