// trn-coordbench: load on one trn-coordinator. N simulated workers (ranks) join one job, then
// heartbeat every interval for a while. Prints the time until all joined, heartbeat latency
// percentiles, and the coordinator's CPU and memory.
//
//   trn-coordbench [--workers 1000] [--ranks-per-node 1] [--seconds 30] [--interval 1]
//                  [--connections N] [--with-members] [--coordinator HOST:PORT --coordinator-pid PID]
// --ranks-per-node 1 (per-rank mode): every rank is a one-process node that heartbeats the
// coordinator itself, one RPC per rank per interval (workers not started by trnrun).
// --ranks-per-node K > 1 (node mode): the ranks form workers/K nodes of K processes, and each
// node sends one heartbeat per interval carrying its K ranks' entries, as trnrun's agent does.
// Either way each simulated sender has its own connection unless --connections says otherwise.
// --with-members: every join reply lists all members (O(nodes^2) bytes at the rendezvous).
// Without --coordinator it starts trn-coordinator (next to this program) on 127.0.0.1:0.
//
//   trn-coordbench --jobs 20000 [--state-dir DIR] [--max-finished-jobs N]
// Jobs mode: starts a coordinator with --state-dir (a fresh temporary folder by default) and runs
// N one-node jobs one after another, each joined, heartbeated, given one store key and finished;
// prints the mean cost of a job per slice of jobs (the first and the last slice should be close:
// saving a change costs the job it touches, not the whole state), the size of the state log, and
// whether a new job still joins at the end.
#include <absl/synchronization/mutex.h>
#include <grpcpp/grpcpp.h>
#include <netdb.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <vector>

#include "collectives/core/error.h"
#include "collectives/core/flags.h"
#include "collectives/core/main.h"
#include "launcher/client/address.h"
#include "launcher/client/datagram_heartbeats.h"
#include "launcher/client/heartbeat_datagram.h"
#include "launcher/client/rpc.h"
#include "trn/coordinator/v1/coordinator.grpc.pb.h"

namespace v1 = trn::coordinator::v1;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

namespace {

struct ProcStats {
  double cpu_s = 0;  // user + system
  long rss_kb = 0, hwm_kb = 0;
};

ProcStats proc_stats(pid_t pid) {
  ProcStats s;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  auto close = line.rfind(')');
  if (close != std::string::npos) {
    std::istringstream in(line.substr(close + 2));
    std::string f;
    std::vector<std::string> fields;
    while (in >> f) fields.push_back(f);
    // Fields after "(comm)": state is index 0; utime 11, stime 12.
    if (fields.size() > 12) s.cpu_s = (std::stod(fields[11]) + std::stod(fields[12])) / sysconf(_SC_CLK_TCK);
  }
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) s.rss_kb = std::stol(line.substr(6));
    if (line.rfind("VmHWM:", 0) == 0) s.hwm_kb = std::stol(line.substr(6));
  }
  return s;
}

double pct(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  size_t i = std::min(v.size() - 1, static_cast<size_t>(p / 100.0 * static_cast<double>(v.size())));
  std::nth_element(v.begin(), v.begin() + static_cast<long>(i), v.end());
  return v[i];
}

struct Options {
  int workers = 1000, connections = 0;
  int ranks_per_node = 1;
  double seconds = 30, interval = 1;
  std::string coordinator;
  pid_t coordinator_pid = 0;
  bool with_members = false;
  std::string transport;  // grpc | datagram; empty: datagram for node heartbeats, else grpc
  int jobs = 0;  // > 0: jobs mode
  std::string state_dir;
  std::string token_file;  // the coordinator requires tokens: this admin token
  long max_finished_jobs = -1;  // -1: the coordinator's default
};

trn::flags::Table table(Options* o) {
  using trn::flags::Range;
  constexpr const char* kLoad = "Load on one coordinator";
  constexpr const char* kJobs = "Jobs mode";
  return {
      .program = "trn-coordbench",
      .summary = "\nLoad on one trn-coordinator: simulated ranks join one job and heartbeat every interval;\n"
                 "prints the time until all joined, heartbeat latency percentiles and the coordinator's CPU\n"
                 "and memory. With --jobs: N one-node jobs one after another on a coordinator with --state-dir,\n"
                 "and the mean cost of a job per slice of them.\n",
      .flags =
          {
              {.name = "--workers",
               .target = &o->workers,
               .help = "simulated ranks",
               .group = kLoad,
               .range = Range::kMinMax,
               .min = 1,
               .max = 100000,
               .invalid = "expected 1..100000"},
              {.name = "--ranks-per-node",
               .target = &o->ranks_per_node,
               .help = "1: each rank heartbeats the coordinator itself; K > 1: nodes of K ranks, one "
                       "heartbeat per "
                       "node carrying its ranks, as trnrun's agent sends",
               .group = kLoad, .value_name = "K", .range = Range::kMinMax, .min = 1, .max = 4096,
               .invalid = "expected 1..4096"},
              {.name = "--connections", .target = &o->connections, .help = "gRPC connections shared by the senders",
               .group = kLoad, .default_text = "one per sender", .range = Range::kMinMax, .min = 1, .max = 100000,
               .invalid = "expected 1..100000"},
              {.name = "--seconds", .target = &o->seconds, .help = "how long to heartbeat", .group = kLoad,
               .value_name = "S", .range = Range::kMinMax, .min = 1, .max = 3600, .invalid = "expected 1..3600"},
              {.name = "--interval", .target = &o->interval, .help = "seconds between a sender's heartbeats",
               .group = kLoad, .value_name = "S", .range = Range::kMinMax, .min = 0.01, .max = 60,
               .invalid = "expected 0.01..60"},
              {.name = "--transport", .target = &o->transport,
               .help = "how heartbeats travel: grpc (a call each) or datagram (UDP, node heartbeats only, as "
                       "trnrun's agent sends them)",
               .group = kLoad, .value_name = "grpc|datagram",
               .default_text = "datagram with --ranks-per-node > 1, else grpc"},
              {.name = "--token-file", .target = &o->token_file,
               .help = "the coordinator requires tokens: the admin token in FILE (for the joins, gRPC heartbeats "
                       "and status; datagrams are MACed with the job's token, as trnrun does)",
               .group = kLoad, .value_name = "FILE", .default_text = "no tokens"},
              {.name = "--with-members", .target = &o->with_members,
               .help = "every join reply lists all members (O(nodes^2) bytes at the rendezvous)", .group = kLoad},
              {.name = "--coordinator", .target = &o->coordinator,
               .help = "a running coordinator (with --coordinator-pid)", .group = kLoad, .value_name = "HOST:PORT",
               .default_text = "start trn-coordinator next to this program on 127.0.0.1:0"},
              {.name = "--coordinator-pid", .target = &o->coordinator_pid,
               .help = "its process, whose CPU and memory are read", .group = kLoad, .value_name = "PID",
               .default_text = "", .range = Range::kMinMax, .min = 1, .max = 1e9, .invalid = "expected 1..1e+09"},
              {.name = "--jobs", .target = &o->jobs, .help = "run N one-node jobs one after another", .group = kJobs,
               .default_text = "", .range = Range::kMinMax, .min = 1, .max = 10000000,
               .invalid = "expected 1..1e+07"},
              {.name = "--state-dir", .target = &o->state_dir, .help = "the coordinator's state", .group = kJobs,
               .value_name = "DIR", .default_text = "a fresh temporary folder"},
              {.name = "--max-finished-jobs", .target = &o->max_finished_jobs,
               .help = "passed to the coordinator", .group = kJobs, .default_text = "the coordinator's",
               .range = Range::kMinMax, .min = 0, .max = 1000000, .invalid = "expected 0..1e+06"},
          },
      .style = trn::flags::Style::kColon,
  };
}

// The command line; std::nullopt after printing --help.
std::optional<Options> parse(int argc, char** argv) {
  Options o;
  if (!trn::flags::parse(table(&o), std::vector<std::string>(argv + 1, argv + argc))) return std::nullopt;
  if (o.workers % o.ranks_per_node != 0)
    throw trn::usage_error("--workers {} is not a multiple of --ranks-per-node {}", o.workers, o.ranks_per_node);
  if (o.connections == 0) o.connections = o.workers / o.ranks_per_node;
  if (o.transport.empty()) o.transport = o.ranks_per_node > 1 ? "datagram" : "grpc";
  if (o.transport != "grpc" && o.transport != "datagram")
    throw trn::usage_error("--transport {}: expected grpc or datagram", o.transport);
  if (o.transport == "datagram" && o.ranks_per_node == 1)
    throw trn::usage_error("--transport datagram carries node heartbeats only; give --ranks-per-node K > 1");
  if (o.jobs > 0 && !o.coordinator.empty())
    throw trn::usage_error("--jobs starts its own coordinator (with --state-dir); drop --coordinator");
  if (o.jobs == 0 && (!o.state_dir.empty() || o.max_finished_jobs >= 0))
    throw trn::usage_error("--state-dir and --max-finished-jobs go with --jobs N");
  if (!o.coordinator.empty()) trn::control::parse_address(o.coordinator, "--coordinator");
  if (!o.coordinator.empty() && o.coordinator_pid == 0)
    throw trn::usage_error("--coordinator needs --coordinator-pid (to read its CPU and memory)");
  return o;
}

// Starts trn-coordinator next to this program; returns its pid and address.
pid_t spawn_coordinator(std::string* address, const std::string& port_file,
                        std::vector<std::string> extra = {}) {
  auto exe = std::filesystem::read_symlink("/proc/self/exe").parent_path() / "trn-coordinator";
  std::vector<std::string> args = {exe.string(), "--listen", "127.0.0.1:0", "--port-file", port_file,
                                   "--heartbeat-timeout", "60"};
  args.insert(args.end(), extra.begin(), extra.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    setenv("TRN_LOG_LEVEL", "warn", 1);
    execv(argv[0], argv.data());
    _exit(127);
  }
  for (int i = 0; i < 1000; ++i) {
    std::ifstream in(port_file);
    int port = 0;
    if (in >> port && port > 0) {
      *address = "127.0.0.1:" + std::to_string(port);
      return pid;
    }
    std::this_thread::sleep_for(10ms);
  }
  kill(pid, SIGKILL);
  throw trn::remote_error("trn-coordinator ({}) did not start", exe.string());
}

// Counts outstanding async calls; wait() until all finished.
struct Outstanding {
  std::mutex mu;
  std::condition_variable cv;
  long n = 0;
  void add() {
    std::lock_guard l(mu);
    ++n;
  }
  void done() {
    std::lock_guard l(mu);
    if (--n == 0) cv.notify_all();
  }
  bool wait(Clock::duration d) {
    std::unique_lock l(mu);
    return cv.wait_for(l, d, [&] { return n == 0; });
  }
};

// Jobs mode (see the top of this file).
int run_jobs(const Options& o) {
  std::string state_dir = o.state_dir;
  bool own_dir = state_dir.empty();
  if (own_dir) state_dir = std::filesystem::temp_directory_path() / ("trn-coordbench-state-" + std::to_string(getpid()));
  std::string port_file = std::filesystem::temp_directory_path() / ("trn-coordbench-" + std::to_string(getpid()));
  std::vector<std::string> extra = {"--state-dir", state_dir};
  if (o.max_finished_jobs >= 0) extra.insert(extra.end(), {"--max-finished-jobs", std::to_string(o.max_finished_jobs)});
  std::string address;
  pid_t pid = spawn_coordinator(&address, port_file, extra);
  auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  auto check = [](const grpc::Status& s, const char* what, const std::string& job) {
    if (!s.ok()) throw trn::remote_error("{} of job {} failed: {}", what, job, trn::control::status_text(s));
  };
  auto one_job = [&](const std::string& job) {
    auto deadline = std::chrono::system_clock::now() + 30s;
    auto call = [&](auto method, const auto& req, auto* resp, const char* what) {
      grpc::ClientContext ctx;
      ctx.set_deadline(deadline);
      check(((*stub).*method)(&ctx, req, resp), what, job);
    };
    v1::JoinRequest jr;
    jr.set_job_id(job);
    jr.set_node_id("node-0");
    jr.set_host("bench");
    jr.set_nproc_per_node(1);
    jr.set_min_nodes(1);
    jr.set_max_nodes(1);
    jr.set_timeout_ms(20000);
    v1::JoinResponse jresp;
    call(&v1::Coordinator::Stub::Join, jr, &jresp, "join");
    v1::HeartbeatRequest hb;
    hb.set_job_id(job);
    hb.set_generation(jresp.generation());
    hb.set_host("bench");
    hb.set_step(1);
    v1::HeartbeatResponse hbr;
    call(&v1::Coordinator::Stub::Heartbeat, hb, &hbr, "heartbeat");
    v1::SetRequest set;
    set.set_job_id(job);
    set.set_generation(jresp.generation());
    set.set_key("fabric/g0/addr/0");
    set.set_value(std::string(64, 'a'));
    v1::SetResponse setr;
    call(&v1::Coordinator::Stub::Set, set, &setr, "set");
    v1::FinishRequest fin;
    fin.set_job_id(job);
    fin.set_generation(jresp.generation());
    fin.set_node_rank(0);
    v1::FinishResponse finr;
    call(&v1::Coordinator::Stub::Finish, fin, &finr, "finish");
  };
  int slice = std::max(1, std::min(1000, o.jobs / 10));
  std::printf("%d one-node jobs in a row (join, heartbeat, set, finish) against trn-coordinator --state-dir %s%s\n",
              o.jobs, state_dir.c_str(),
              o.max_finished_jobs >= 0 ? fmt::format(" --max-finished-jobs {}", o.max_finished_jobs).c_str() : "");
  std::printf("%12s %16s\n", "jobs", "ms per job");
  double first = 0, last = 0;
  ProcStats base = proc_stats(pid);
  for (int start = 0; start < o.jobs; start += slice) {
    int n = std::min(slice, o.jobs - start);
    auto t0 = Clock::now();
    for (int i = 0; i < n; ++i) one_job(fmt::format("job-{:08}", start + i));
    double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / n;
    if (start == 0) first = ms;
    last = ms;
    std::printf("%5d..%-6d %16.3f\n", start, start + n - 1, ms);
    std::fflush(stdout);
  }
  ProcStats fin = proc_stats(pid);
  bool joins = true;
  std::string why;
  try {
    one_job("job-after-all");
  } catch (const trn::Error& e) {
    joins = false;
    why = e.what();
  }
  uintmax_t log_bytes = 0;
  std::error_code ec;
  for (const auto& f : std::filesystem::directory_iterator(state_dir, ec))
    if (f.is_regular_file()) log_bytes += f.file_size();
  std::printf("first slice %.3f ms per job, last slice %.3f ms per job: last/first %.2f\n", first, last,
              first > 0 ? last / first : 0);
  std::printf("a new job after all of them: %s%s%s\n", joins ? "joined and finished" : "FAILED", joins ? "" : ": ",
              why.c_str());
  std::printf("state dir %.1f KiB at the end; coordinator cpu %.2f s, rss %.1f MiB\n", log_bytes / 1024.0,
              fin.cpu_s - base.cpu_s, fin.rss_kb / 1024.0);
  stub.reset();
  kill(pid, SIGTERM);
  waitpid(pid, nullptr, 0);
  std::filesystem::remove(port_file, ec);
  if (own_dir) std::filesystem::remove_all(state_dir, ec);
  return joins ? 0 : 1;
}

// Heartbeats as datagrams (what trnrun's agent sends by default): one thread sends on a few
// sockets, another reads the answers; each answer is matched to its heartbeat by sequence number.
class DatagramSender {
 public:
  DatagramSender(const std::string& host, int port, int sockets, std::string key, uint64_t epoch)
      : key_(std::move(key)), epoch_(epoch) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_DGRAM;
    addrinfo* res = nullptr;
    if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res)
      throw trn::remote_error("cannot resolve {}", host);
    std::memcpy(&to_, res->ai_addr, res->ai_addrlen);
    to_len_ = res->ai_addrlen;
    const int family = res->ai_family;
    freeaddrinfo(res);
    epoll_ = epoll_create1(EPOLL_CLOEXEC);
    for (int i = 0; i < sockets; ++i) {
      int fd = socket(family, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0) throw trn::remote_error("socket: {}", std::strerror(errno));
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.fd = fd;
      epoll_ctl(epoll_, EPOLL_CTL_ADD, fd, &ev);
      fds_.push_back(fd);
    }
    reader_ = std::thread([this] { read_loop(); });
  }
  ~DatagramSender() {
    stop_ = true;
    reader_.join();
    for (int fd : fds_) close(fd);
    close(epoll_);
  }
  void send(int node, long round, const v1::HeartbeatRequest& req) {
    const uint64_t seq = next_seq_++;
    auto bytes = trn::control::encode_datagram(trn::control::DatagramType::kRequest, seq, epoch_,
                                               trn::control::DatagramHeartbeats::padded_payload(req, !key_.empty()),
                                               key_);
    if (!bytes) throw trn::usage_error("a node heartbeat of {} ranks does not fit in a datagram", req.ranks_size());
    {
      std::lock_guard l(mu_);
      pending_[seq] = {Clock::now(), round, std::string(trn::control::mac_of(*bytes, !key_.empty()))};
    }
    if (sendto(fds_[static_cast<size_t>(node) % fds_.size()], bytes->data(), bytes->size(), 0,
               reinterpret_cast<const sockaddr*>(&to_), to_len_) < 0) {
      std::lock_guard l(mu_);
      pending_.erase(seq);
      ++lost_;
    }
  }
  void finish(Clock::duration grace) {
    auto until = Clock::now() + grace;
    while (Clock::now() < until) {
      {
        std::lock_guard l(mu_);
        if (pending_.empty()) break;
      }
      std::this_thread::sleep_for(10ms);
    }
    std::lock_guard l(mu_);
    lost_ += static_cast<long>(pending_.size());
    pending_.clear();
  }
  std::vector<std::pair<long, double>> latencies() {
    std::lock_guard l(mu_);
    return done_;
  }
  long lost() {
    std::lock_guard l(mu_);
    return lost_;
  }
  long aborts() {
    std::lock_guard l(mu_);
    return aborts_;
  }

 private:
  void read_loop() {
    std::vector<char> buf(trn::control::kMaxDatagram + 1);
    epoll_event evs[64];
    while (!stop_) {
      int n = epoll_wait(epoll_, evs, 64, 50);
      for (int i = 0; i < n; ++i) {
        for (;;) {
          ssize_t got = recv(evs[i].data.fd, buf.data(), buf.size(), MSG_DONTWAIT);
          if (got < 0) break;
          auto at = Clock::now();
          auto d = trn::control::parse_datagram(std::string_view(buf.data(), static_cast<size_t>(got)), nullptr);
          if (!d || d->type != trn::control::DatagramType::kReply) continue;
          v1::HeartbeatResponse resp;
          bool ok = resp.ParseFromArray(d->payload.data(), static_cast<int>(d->payload.size()));
          std::lock_guard l(mu_);
          auto it = pending_.find(d->seq);
          if (it == pending_.end() || !trn::control::datagram_mac_ok(*d, key_, it->second.mac)) continue;
          done_.emplace_back(it->second.round, std::chrono::duration<double, std::milli>(at - it->second.sent).count());
          if (!ok || resp.abort()) ++aborts_;
          pending_.erase(it);
        }
      }
    }
  }

  struct Pending {
    Clock::time_point sent;
    long round = 0;
    std::string mac;  // the request's: the reply's MAC covers it
  };
  std::string key_;
  uint64_t epoch_ = 0;
  sockaddr_storage to_{};
  socklen_t to_len_ = 0;
  int epoll_ = -1;
  std::vector<int> fds_;
  std::atomic<uint64_t> next_seq_{1};
  std::atomic<bool> stop_{false};
  std::thread reader_;
  std::mutex mu_;
  std::unordered_map<uint64_t, Pending> pending_;
  std::vector<std::pair<long, double>> done_;
  long lost_ = 0, aborts_ = 0;
};

int run(const Options& o) {
  if (o.jobs > 0) return run_jobs(o);
  std::string address = o.coordinator;
  pid_t pid = o.coordinator_pid;
  std::string port_file = std::filesystem::temp_directory_path() / ("trn-coordbench-" + std::to_string(getpid()));
  bool spawned = address.empty();
  std::string token;
  if (!o.token_file.empty()) {
    std::ifstream in(o.token_file);
    if (!(in >> token)) throw trn::usage_error("--token-file {}: cannot read a token from it", o.token_file);
  }
  auto authorize = [&token](grpc::ClientContext& ctx) {
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  };
  if (spawned)
    pid = spawn_coordinator(&address, port_file,
                            token.empty() ? std::vector<std::string>{}
                                          : std::vector<std::string>{"--token-file", o.token_file});
  ProcStats base = proc_stats(pid);
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);  // as the coordinator does

  std::vector<std::unique_ptr<v1::Coordinator::Stub>> stubs;
  for (int c = 0; c < o.connections; ++c) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // one TCP connection per simulated worker
    args.SetInt("trn.bench.channel", c);
    // As trnrun's agents do (CoordinatorClient): no retry buffering, no channelz accounting.
    args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
    args.SetInt(GRPC_ARG_ENABLE_CHANNELZ, 0);
    stubs.push_back(v1::Coordinator::NewStub(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args)));
  }
  const std::string job = "coordbench-" + std::to_string(getpid());
  const int per_node = o.ranks_per_node, nodes = o.workers / per_node;
  const bool node_mode = per_node > 1;
  std::vector<int> node_rank(static_cast<size_t>(nodes), -1), rank_offset(static_cast<size_t>(nodes), -1);

  // Phase 1: every node joins (min = max = nodes).
  Outstanding out;
  std::atomic<int> join_ok{0}, join_err{0};
  std::mutex emu;
  std::string first_error;
  auto t0 = Clock::now();
  std::atomic<int64_t> last_join_ns{0};
  std::atomic<int> udp_port{0};
  std::atomic<uint64_t> epoch{0};
  std::mutex job_token_mu;
  std::string job_token;
  for (int w = 0; w < nodes; ++w) {
    struct Call {
      grpc::ClientContext ctx;
      v1::JoinRequest req;
      v1::JoinResponse resp;
    };
    auto* c = new Call;
    c->ctx.set_deadline(std::chrono::system_clock::now() + 120s);
    authorize(c->ctx);
    c->req.set_job_id(job);
    c->req.set_node_id(fmt::format("worker-{:06}", w));
    c->req.set_host("bench");
    c->req.set_nproc_per_node(per_node);
    c->req.set_min_nodes(nodes);
    c->req.set_max_nodes(nodes);
    c->req.set_timeout_ms(110000);
    c->req.set_omit_members(!o.with_members);
    out.add();
    stubs[w % o.connections]->async()->Join(&c->ctx, &c->req, &c->resp, [&, c, w](grpc::Status s) {
      if (s.ok()) {
        join_ok++;
        node_rank[static_cast<size_t>(w)] = c->resp.node_rank();
        rank_offset[static_cast<size_t>(w)] = c->resp.rank_offset();
        udp_port = c->resp.heartbeat_udp_port();
        epoch = c->resp.heartbeat_epoch();
        std::lock_guard l(job_token_mu);
        job_token = c->resp.job_token();
        int64_t ns = (Clock::now() - t0).count(), cur = last_join_ns.load();
        while (ns > cur && !last_join_ns.compare_exchange_weak(cur, ns)) {
        }
      } else {
        join_err++;
        std::lock_guard l(emu);
        if (first_error.empty()) first_error = trn::control::status_text(s);
      }
      delete c;
      out.done();
    });
  }
  out.wait(130s);
  double join_s = std::chrono::duration<double>(Clock::duration(last_join_ns.load())).count();
  ProcStats after_join = proc_stats(pid);
  std::unique_ptr<DatagramSender> dgram;
  if (o.transport == "datagram") {
    if (udp_port == 0) throw trn::remote_error("the coordinator takes no heartbeat datagrams (its join replies name no UDP port)");
    // The host as getaddrinfo takes it: an IPv6 address without its brackets.
    dgram = std::make_unique<DatagramSender>(trn::control::parse_address(address, "--coordinator").host, udp_port,
                                             std::min(nodes, 256), job_token, epoch.load());
  }
  if (node_mode)
    std::printf("mode: node heartbeats: %d ranks as %d nodes x %d ranks, one heartbeat %s per node per interval\n",
                o.workers, nodes, per_node, dgram ? "datagram" : "RPC");
  else
    std::printf("mode: per-rank heartbeats: %d ranks, one heartbeat RPC per rank per interval\n", o.workers);
  std::printf("join replies %s the member list\n", o.with_members ? "carry" : "omit");
  std::printf("ranks %d  nodes %d  connections %d  all joined: %s in %.3f s  (ok %d, failed %d%s%s)\n", o.workers,
              nodes, o.connections, join_ok == nodes ? "yes" : "NO", join_s, join_ok.load(), join_err.load(),
              first_error.empty() ? "" : ", first error: ", first_error.c_str());
  std::fflush(stdout);

  // Phase 2: heartbeats, each sender (a rank, or a node carrying its ranks) every interval,
  // spread evenly over the interval.
  std::vector<double> lat_ms;
  lat_ms.reserve(static_cast<size_t>(nodes * (o.seconds / o.interval + 1)));
  std::vector<std::vector<double>> round_ms(static_cast<size_t>(o.seconds / o.interval + 1));
  std::atomic<long> hb_err{0}, hb_abort{0};
  std::mutex lmu;
  auto interval = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.interval));
  auto start = Clock::now();
  auto end = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.seconds));
  long sent = 0;
  for (long k = 0;; ++k) {
    auto round = start + k * interval;
    if (round >= end) break;
    for (int w = 0; w < nodes; ++w) {
      if (node_rank[static_cast<size_t>(w)] < 0) continue;  // did not join
      auto at = round + interval * w / nodes;
      std::this_thread::sleep_until(at);
      v1::HeartbeatRequest req;
      req.set_job_id(job);
      req.set_generation(0);
      req.set_host("bench");
      if (node_mode) {
        req.set_kind(v1::HeartbeatRequest::NODE);
        req.set_rank(node_rank[static_cast<size_t>(w)]);
        for (int i = 0; i < per_node; ++i) {
          int rank = rank_offset[static_cast<size_t>(w)] + i;
          auto* e = req.add_ranks();
          e->set_rank(rank);
          e->set_pid(rank);
          e->set_step(k);
          e->set_loss(1.0 / static_cast<double>(k + 1));
          e->set_tokens_per_s(1000);
          e->mutable_coordinates()->set_dp_rank(rank);
          e->set_age_ms(i);  // as heard by the agent, a little before the call
          e->set_beats(1);
        }
      } else {
        req.set_rank(rank_offset[static_cast<size_t>(w)]);
        req.set_pid(w);
        req.set_step(k);
        req.set_loss(1.0 / static_cast<double>(k + 1));
        req.set_tokens_per_s(1000);
        req.mutable_coordinates()->set_dp_rank(rank_offset[static_cast<size_t>(w)]);
      }
      ++sent;
      if (dgram) {
        dgram->send(w, k, req);
        continue;
      }
      struct Call {
        grpc::ClientContext ctx;
        v1::HeartbeatRequest req;
        v1::HeartbeatResponse resp;
        Clock::time_point sent;
      };
      auto* c = new Call;
      c->ctx.set_deadline(std::chrono::system_clock::now() + 10s);
      authorize(c->ctx);
      c->req = std::move(req);
      c->sent = Clock::now();
      out.add();
      stubs[w % o.connections]->async()->Heartbeat(&c->ctx, &c->req, &c->resp, [&, c, k](grpc::Status s) {
        double ms = std::chrono::duration<double, std::milli>(Clock::now() - c->sent).count();
        if (!s.ok()) hb_err++;
        else if (c->resp.abort()) hb_abort++;
        {
          std::lock_guard l(lmu);
          lat_ms.push_back(ms);
          if (static_cast<size_t>(k) < round_ms.size()) round_ms[static_cast<size_t>(k)].push_back(ms);
        }
        delete c;
        out.done();
      });
    }
  }
  if (dgram) {
    // Answers still on their way get up to 2 s; a datagram unanswered by then counts as lost
    // (trnrun would have sent it again over gRPC after 0.5 s).
    dgram->finish(2s);
    std::lock_guard l(lmu);
    for (const auto& [k, ms] : dgram->latencies()) {
      lat_ms.push_back(ms);
      if (static_cast<size_t>(k) < round_ms.size()) round_ms[static_cast<size_t>(k)].push_back(ms);
    }
    hb_abort += dgram->aborts();
    // A lost one counts at least the 0.5 s trnrun waits before sending it over gRPC.
    for (long i = 0; i < dgram->lost(); ++i) lat_ms.push_back(500.0);
    hb_err += dgram->lost();
  }
  out.wait(30s);
  ProcStats fin = proc_stats(pid);
  double hb_s = std::chrono::duration<double>(Clock::now() - start).count();
  std::vector<double> l;
  {
    std::lock_guard lk(lmu);
    l = lat_ms;
  }
  double p50 = pct(l, 50), p90 = pct(l, 90), p99 = pct(l, 99),
         mx = l.empty() ? 0 : *std::max_element(l.begin(), l.end());
  {
    // A backlog shows as p99 growing round by round; a start-up burst as early rounds alone.
    std::lock_guard lk(lmu);
    std::string by_round;
    for (auto& r : round_ms)
      if (!r.empty()) by_round += fmt::format(" {:.1f}", pct(r, 99));
    std::printf("heartbeat p99 by round, ms:%s\n", by_round.c_str());
  }
  // What the coordinator holds: every rank heard, with the last round's step.
  // The job's summary (what `trnctl status` asks for), timed: it counts the ranks that reported.
  int heard = 0;
  double status_ms = -1;
  {
    v1::GetStatusRequest req;
    req.set_job_id(job);
    req.set_max_ranks(-1);
    v1::GetStatusResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 30s);
    authorize(ctx);
    auto t = Clock::now();
    grpc::Status s = stubs[0]->GetStatus(&ctx, req, &resp);
    status_ms = std::chrono::duration<double, std::milli>(Clock::now() - t).count();
    if (s.ok() && resp.jobs_size() == 1)
      heard = resp.jobs(0).progress().reporting();
    else
      std::printf("status failed: %s\n", trn::control::status_text(s).c_str());
  }
  std::printf("heartbeats sent %ld (%s)  answered %zu  %s %ld  abort replies %ld  over %.1f s\n", sent,
              dgram ? "datagrams" : "RPCs", l.size() - static_cast<size_t>(dgram ? hb_err.load() : 0),
              dgram ? "lost (unanswered within 2 s)" : "errors",
              hb_err.load(), hb_abort.load(), hb_s);
  std::printf("rank heartbeats delivered %ld (%.0f per second); ranks the coordinator heard from: %d of %d\n",
              sent * per_node, static_cast<double>(sent * per_node) / hb_s, heard, o.workers);
  std::printf("job status summary answered in %.1f ms\n", status_ms);
  std::printf("heartbeat latency ms: p50 %.3f  p90 %.3f  p99 %.3f  max %.3f\n", p50, p90, p99, mx);
  std::printf("coordinator cpu: join phase %.2f s, heartbeat phase %.2f s (%.1f%% of one core)\n",
              after_join.cpu_s - base.cpu_s, fin.cpu_s - after_join.cpu_s,
              100.0 * (fin.cpu_s - after_join.cpu_s) / hb_s);
  std::printf("coordinator memory: rss %.1f MiB, peak %.1f MiB\n", fin.rss_kb / 1024.0, fin.hwm_kb / 1024.0);
  ProcStats self = proc_stats(getpid());
  std::printf("bench process cpu %.2f s (shares the machine with the coordinator)\n", self.cpu_s);
  bool floor_ok = join_ok == nodes && join_s <= 10 && p99 < 50 && hb_err == 0 && heard == o.workers;
  std::printf("floor (all joined within 10 s, heartbeat p99 < 50 ms, no errors, every rank heard): %s\n",
              floor_ok ? "met" : "NOT met");
  std::fflush(stdout);
  stubs.clear();
  if (spawned) {
    kill(pid, SIGTERM);
    waitpid(pid, nullptr, 0);
    std::filesystem::remove(port_file);
  }
  return floor_ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return trn::run_main("trn-coordbench", [&] {
    const std::optional<Options> o = parse(argc, argv);
    return o ? run(*o) : 0;
  });
}
