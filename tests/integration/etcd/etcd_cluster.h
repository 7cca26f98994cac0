// A real etcd cluster on loopback for tests: N members (1 or 3, usually), each an etcd process
// with its own data folder in a temporary directory, client and peer ports picked free. Fast
// raft timing (heartbeat 50 ms, election 500 ms), so an election takes about a second and the
// minimum lease TTL is 1 s. Logs go to DIR/m<i>.log; errors quote their tail.
//
//   trn::test::EtcdCluster etcd(3);
//   etcd.start();                          // throws unless every member follows one leader
//   EtcdClient c(parse_endpoints(etcd.endpoints()));
//   etcd.kill(0);                          // SIGKILL; etcd.restart(0) brings it back
//   etcd.pause(1);                         // SIGSTOP: hung, not dead; etcd.resume(1)
//
// use_tls() before start(): members serve clients over TLS only and require client
// certificates, from a CA made for the cluster (tls_file("ca.pem"), "client.pem", "client.key").
//
// etcd is a required test dependency (deploy/install-deps.sh installs etcd-server): without it
// start() fails the test, loudly. The destructor kills every member and removes the folder; a
// member also dies with the thread that started it (setpriv --pdeathsig), so start and restart
// members from a thread that outlives the cluster (the test's own).
#pragma once

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "launcher/server/etcd.h"
#include "tests/support/process.h"

namespace trn::test {

class EtcdCluster {
 public:
  static constexpr const char* kEtcd = "/usr/bin/etcd";

  explicit EtcdCluster(int members = 3) : n_(members) {
    pick_ports();
    procs_.resize(static_cast<size_t>(n_));
  }
  ~EtcdCluster() { procs_.clear(); }  // each Process kills its member; dir_ then goes
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  int size() const { return n_; }

  // A CA, a certificate for the members (127.0.0.1) and one for clients, in dir(); every member
  // then requires TLS and a client certificate the CA signed.
  void use_tls() {
    const std::string script = fmt::format(
        "set -e; cd {0}; "
        "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=trn-etcd-ca -keyout ca.key -out ca.pem; "
        "for who in server client; do "
        "openssl req -newkey rsa:2048 -nodes -subj /CN=$who -keyout $who.key -out $who.csr; "
        "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\nextendedKeyUsage=serverAuth,clientAuth' > $who.ext; "
        "openssl x509 -req -in $who.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 -extfile $who.ext "
        "-out $who.pem; done",
        dir_.path());
    auto r = run_all({ProcSpec{{"/bin/sh", "-c", script}, {}}}, std::chrono::seconds(60)).at(0);
    if (!r.ok()) throw std::runtime_error("cannot make the etcd test certificates: " + r.describe());
    tls_ = true;
  }
  std::string tls_file(const std::string& name) const { return dir_.path() + "/" + name; }
  // What a client of this cluster needs: with use_tls(), the CA and the client certificate.
  control::etcd::Options client_options() const {
    control::etcd::Options o;
    if (tls_) {
      o.tls_ca = slurp(tls_file("ca.pem"));
      o.tls_cert = slurp(tls_file("client.pem"));
      o.tls_key = slurp(tls_file("client.key"));
    }
    return o;
  }
  const std::string& dir() const { return dir_.path(); }
  // "127.0.0.1:P" of member i, and "etcd://127.0.0.1:P0,127.0.0.1:P1,..." of all.
  std::string endpoint(int i) const {
    return fmt::format("127.0.0.1:{}", client_ports_.at(static_cast<size_t>(i)));
  }
  std::string endpoints() const {
    std::string s = "etcd://";
    for (int i = 0; i < n_; ++i) s += fmt::format("{}{}", i ? "," : "", endpoint(i));
    return s;
  }
  std::vector<std::string> endpoint_list() const {
    std::vector<std::string> v;
    for (int i = 0; i < n_; ++i) v.push_back(endpoint(i));
    return v;
  }

  // Starts every member and waits until all follow one leader. When a port picked free was
  // taken in the meantime (etcd exits: "address already in use"), starts over on new ports.
  void start(std::chrono::seconds within = std::chrono::seconds(30)) {
    if (::access(kEtcd, X_OK) != 0)
      throw std::runtime_error(
          fmt::format("{} not found: the etcd tests need etcd 3.4+; install the Debian packages "
                      "etcd-server etcd-client (deploy/install-deps.sh does)",
                      kEtcd));
    for (int attempt = 1;; ++attempt) {
      for (int i = 0; i < n_; ++i) launch(i);
      try {
        wait_healthy(within);
        return;
      } catch (const std::runtime_error&) {
        if (attempt == 3 || logs().find("address already in use") == std::string::npos) throw;
      }
      for (int i = 0; i < n_; ++i) kill(i);
      for (const auto& e : std::filesystem::directory_iterator(dir_.path()))
        if (e.path().filename().string().rfind('m', 0) == 0)  // members' data and logs, not the certificates
          std::filesystem::remove_all(e.path());
      pick_ports();
    }
  }

  // SIGKILL to member i; returns once it is reaped.
  void kill(int i) {
    auto& p = procs_.at(static_cast<size_t>(i));
    if (!p) return;
    p->signal(SIGKILL);
    p->wait(std::chrono::steady_clock::now() + std::chrono::seconds(10));
    p.reset();
  }

  // SIGSTOP / SIGCONT to member i: a hung member keeps its connections but answers nothing.
  void pause(int i) { procs_.at(static_cast<size_t>(i))->signal(SIGSTOP); }
  void resume(int i) { procs_.at(static_cast<size_t>(i))->signal(SIGCONT); }

  // Starts a killed member again, with its data (it re-joins the cluster).
  void restart(int i) {
    if (procs_.at(static_cast<size_t>(i)))
      throw std::runtime_error(fmt::format("etcd member {} is running", i));
    launch(i);
  }

  bool running(int i) {
    return procs_.at(static_cast<size_t>(i)) && procs_[static_cast<size_t>(i)]->running();
  }

  // Waits until every running member reports the same leader (a member that knows none, or
  // does not answer, keeps waiting).
  void wait_healthy(std::chrono::seconds within = std::chrono::seconds(30)) {
    control::etcd::Options o = client_options();
    o.timeout = std::chrono::milliseconds(500);
    control::etcd::EtcdClient c(endpoint_list(), o);
    auto deadline = std::chrono::steady_clock::now() + within;
    std::string why;
    while (std::chrono::steady_clock::now() < deadline) {
      why.clear();
      uint64_t leader = 0;
      for (int i = 0; i < n_ && why.empty(); ++i) {
        if (!procs_[static_cast<size_t>(i)]) continue;
        if (!procs_[static_cast<size_t>(i)]->running()) {
          why = fmt::format("member {} exited", i);
          throw std::runtime_error(fmt::format("etcd cluster did not start: {}\n{}", why, logs()));
        }
        auto s = c.member_status(static_cast<size_t>(i));
        if (!s.ok())
          why = s.status.message;
        else if (s.value.leader == 0)
          why = fmt::format("member {} knows no leader", i);
        else if (leader != 0 && s.value.leader != leader)
          why = fmt::format("member {} follows another leader", i);
        else
          leader = s.value.leader;
      }
      if (why.empty()) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    throw std::runtime_error(
        fmt::format("etcd cluster not healthy within {} s: {}\n{}", within.count(), why, logs()));
  }

  // The index of the member that is the raft leader, or -1 (asks every running member).
  int leader() {
    control::etcd::EtcdClient c(endpoint_list(), client_options());
    std::vector<uint64_t> ids(static_cast<size_t>(n_), 0);
    uint64_t leader = 0;
    for (int i = 0; i < n_; ++i) {
      if (!procs_[static_cast<size_t>(i)]) continue;
      auto s = c.member_status(static_cast<size_t>(i));
      if (!s.ok()) continue;
      ids[static_cast<size_t>(i)] = s.value.member_id;
      if (s.value.leader) leader = s.value.leader;
    }
    for (int i = 0; i < n_; ++i)
      if (leader && ids[static_cast<size_t>(i)] == leader) return i;
    return -1;
  }

  // The last lines of every member's log, for failure messages.
  std::string logs(size_t lines = 15) const {
    std::string out;
    for (int i = 0; i < n_; ++i) {
      std::ifstream in(log_path(i));
      std::vector<std::string> all;
      for (std::string l; std::getline(in, l);) all.push_back(l);
      out += fmt::format("--- etcd member {} ({}), last {} lines ---\n", i, log_path(i), lines);
      for (size_t k = all.size() > lines ? all.size() - lines : 0; k < all.size(); ++k) out += all[k] + "\n";
    }
    return out;
  }

 private:
  static std::string slurp(const std::string& path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  std::string log_path(int i) const { return fmt::format("{}/m{}.log", dir_.path(), i); }

  // Free loopback ports for every member's client and peer URLs. Every socket is held until
  // all are picked, so no two get the same port.
  void pick_ports() {
    client_ports_.clear();
    peer_ports_.clear();
    std::vector<int> fds;
    for (int i = 0; i < 2 * n_; ++i) {
      int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
      socklen_t len = sizeof a;
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
      (i < n_ ? client_ports_ : peer_ports_).push_back(ntohs(a.sin_port));
      fds.push_back(fd);
    }
    for (int fd : fds) ::close(fd);
  }

  void launch(int i) {
    static std::atomic<int> counter{0};
    if (token_.empty()) token_ = fmt::format("trn-test-{}-{}", ::getpid(), counter++);
    std::string cluster;
    for (int k = 0; k < n_; ++k)
      cluster +=
          fmt::format("{}m{}=http://127.0.0.1:{}", k ? "," : "", k, peer_ports_[static_cast<size_t>(k)]);
    std::string client =
        fmt::format("{}://127.0.0.1:{}", tls_ ? "https" : "http", client_ports_[static_cast<size_t>(i)]);
    std::string peer = fmt::format("http://127.0.0.1:{}", peer_ports_[static_cast<size_t>(i)]);
    ProcSpec spec;
    // setpriv: a member dies with the thread that started it, so a test killed before its
    // destructors ran (a timeout, a broken pipe) leaves no etcd behind.
    // clang-format off
    spec.argv = {"setpriv", "--pdeathsig", "KILL", kEtcd,
                 "--name", fmt::format("m{}", i),
                 "--data-dir", fmt::format("{}/m{}.etcd", dir_.path(), i),
                 "--listen-client-urls", client,
                 "--advertise-client-urls", client,
                 "--listen-peer-urls", peer,
                 "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", cluster,
                 "--initial-cluster-state", "new",
                 "--initial-cluster-token", token_,
                 "--heartbeat-interval", "50",
                 "--election-timeout", "500",
                 "--logger", "zap",
                 "--log-outputs", log_path(i)};
    // clang-format on
    if (tls_)
      spec.argv.insert(spec.argv.end(), {"--cert-file", tls_file("server.pem"), "--key-file", tls_file("server.key"),
                                         "--trusted-ca-file", tls_file("ca.pem"), "--client-cert-auth"});
    procs_[static_cast<size_t>(i)] = std::make_unique<Process>(spec);
  }

  int n_;
  bool tls_ = false;
  TempDir dir_;
  std::string token_;
  std::vector<int> client_ports_, peer_ports_;
  std::vector<std::unique_ptr<Process>> procs_;
};

}  // namespace trn::test
