// trn-p2pbench: ping-pong latency and bandwidth between two ranks over the fabric, 8 B..64 MiB,
// optionally side by side with libfabric's own fi_pingpong over the same provider, in the same
// run, alternating the two (A B A B) and printing medians.
//
//   trn-p2pbench --spawn --provider tcp --anchor       # both ranks on this host, plus fi_pingpong
//   trn-p2pbench --rank 0 --size 2 --store-dir D       # one rank of two (the other: --rank 1)
//   mpirun -np 2 trn-p2pbench                          # ranks and addresses from MPI
//
// Latency is one-way (round trip / 2) and bandwidth 2 * bytes * iterations / time in MiB/s, as
// fi_pingpong reports them; cpu is the process's CPU time over wall time while it ran (100% = one core).
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

#include "collectives/bootstrap/file_store.h"
#include "collectives/bootstrap/mpi_bootstrap.h"
#include "collectives/core/aligned.h"
#include "collectives/core/error.h"
#include "collectives/core/flags.h"
#include "collectives/core/log.h"
#include "collectives/core/main.h"
#include "collectives/fabric/fabric.h"

namespace {

using namespace trn;

struct Args {
  int rank = -1, size = 2;
  std::string store_dir, provider;
  int shm = -1;
  bool spawn = false, anchor = false;
  size_t min = 8, max = 64u << 20;
  int iters = 0, reps = 3;
  double spin_us = -1;
  double idle_s = 0;
};

struct Result {
  double lat_us = 0, mbps = 0, cpu = 0;
};

constexpr uint64_t kCmdTag = 1, kDataTag = 2;

flags::Table table(Args* a) {
  using flags::Range;
  return {
      .program = "trn-p2pbench",
      .summary = "\nPing-pong latency (one-way) and bandwidth between two ranks over the fabric, from --min to\n"
                 "--max bytes, optionally side by side with libfabric's fi_pingpong (--anchor). Give --spawn\n"
                 "(both ranks on this host), or --rank R --size 2 --store-dir D on each rank, or run under mpirun.\n",
      .flags =
          {
              {"--spawn", &a->spawn, "start rank 1 on this host and be rank 0"},
              {"--rank", &a->rank, "this rank (0 or 1) of a FileStore bootstrap", "", "R", ""},
              {"--size", &a->size, "ranks (a ping-pong has two)", "", "N"},
              {"--store-dir", &a->store_dir, "FileStore bootstrap directory", "", "DIR"},
              {"--provider", &a->provider, "libfabric provider", "", "auto|efa|tcp|shm|sockets", "auto"},
              {.name = "--shm", .target = [a](auto&, auto& v) { a->shm = v == "1"; },
               .help = "1: same-host peers through shared memory", .default_text = "the fabric's choice",
               .choices = "0|1"},
              {.name = "--min", .target = flags::Bytes{&a->min}, .help = "smallest message"},
              {.name = "--max", .target = flags::Bytes{&a->max}, .help = "largest message", .default_text = "64M"},
              {.name = "--iters", .target = &a->iters, .help = "round trips per size", .default_text = "by size",
               .range = Range::kPositive},
              {.name = "--reps", .target = &a->reps, .help = "runs per size (the median is printed)",
               .range = Range::kPositive},
              {.name = "--spin-us", .target = &a->spin_us, .help = "fabric wait spin before sleeping",
               .value_name = "US", .default_text = "the fabric's", .range = Range::kNonNegative},
              {.name = "--idle", .target = &a->idle_s, .help = "also measure the CPU a wait of S seconds costs",
               .value_name = "S", .range = Range::kNonNegative},
              {"--anchor", &a->anchor, "run fi_pingpong over the same provider too, alternating with trn"},
          },
      .style = flags::Style::kColon,
  };
}

// The command line; std::nullopt after printing --help.
std::optional<Args> parse(int argc, char** argv) {
  Args a;
  if (!flags::parse(table(&a), std::vector<std::string>(argv + 1, argv + argc))) return std::nullopt;
  if (a.size != 2) throw usage_error("--size must be 2 (a ping-pong has two ranks)");
  if (a.min < 1 || a.min > a.max) throw usage_error("--min {} must be between 1 and --max {}", a.min, a.max);
  return a;
}

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

int iterations_for(const Args& a, size_t bytes) {
  if (a.iters > 0) return a.iters;
  return static_cast<int>(std::clamp<size_t>((64u << 20) / std::max<size_t>(bytes, 1), 10, 1000));
}

// Rank 0: one timed ping-pong of iters round trips at this size.
Result ping(PointToPoint& p, char* out, char* in, size_t bytes, int iters) {
  uint64_t cmd[2] = {bytes, static_cast<uint64_t>(iters)};
  p.isend(1, kCmdTag, cmd, sizeof(cmd))->wait(Deadline::from_default_timeout());
  auto warm = p.irecv(1, kDataTag, in, bytes);  // one untimed round trip
  p.isend(1, kDataTag, out, bytes)->wait(Deadline::from_default_timeout());
  warm->wait(Deadline::from_default_timeout());
  const double c0 = cpu_seconds();
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    auto r = p.irecv(1, kDataTag, in, bytes);
    p.isend(1, kDataTag, out, bytes)->wait(Deadline::from_default_timeout());
    r->wait(Deadline::from_default_timeout());
  }
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  return {s * 1e6 / (2.0 * iters), 2.0 * bytes * iters / s / (1 << 20), (cpu_seconds() - c0) / s};
}

// Rank 1: answers commands until told to stop.
void pong(PointToPoint& p, char* out, char* in) {
  for (;;) {
    uint64_t cmd[2];
    p.irecv(0, kCmdTag, cmd, sizeof(cmd))->wait(Deadline::from_default_timeout());
    if (cmd[0] == UINT64_MAX) return;
    if (cmd[0] == UINT64_MAX - 1) {  // idle probe: answer after cmd[1] microseconds
      p.irecv(0, kDataTag, in, 8)->wait(Deadline::from_default_timeout());
      std::this_thread::sleep_for(std::chrono::microseconds(cmd[1]));
      p.isend(0, kDataTag, out, 8)->wait(Deadline::from_default_timeout());
      continue;
    }
    for (uint64_t i = 0; i < cmd[1] + 1; ++i) {
      p.irecv(0, kDataTag, in, cmd[0])->wait(Deadline::from_default_timeout());
      p.isend(0, kDataTag, out, cmd[0])->wait(Deadline::from_default_timeout());
    }
  }
}

// Runs a program, returns its exit status; *out gets its stdout+stderr and *cpu its CPU seconds.
pid_t start(const std::vector<std::string>& argv, const std::string& log_path) {
  pid_t pid = fork();
  if (pid == 0) {
    int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    std::vector<char*> cargv;
    for (const auto& s : argv) cargv.push_back(const_cast<char*>(s.c_str()));
    cargv.push_back(nullptr);
    execvp(cargv[0], cargv.data());
    _exit(127);
  }
  return pid;
}

int finish(pid_t pid, Deadline deadline, double* cpu) {
  for (;;) {
    int status = 0;
    rusage u{};
    pid_t r = wait4(pid, &status, WNOHANG, &u);
    if (r == pid) {
      if (cpu) *cpu = u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
    }
    if (deadline.expired()) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return 124;
    }
    usleep(2000);
  }
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// fi_pingpong over the same provider at one size: its usec/xfer and MB/sec, and the client's CPU.
Result fi_pingpong(const std::string& provider, size_t bytes, int iters, const std::string& dir) {
  static int port = 23000 + getpid() % 5000;
  ++port;
  std::vector<std::string> common = {"fi_pingpong", "-p", provider, "-e", "rdm", "-m", "tagged",
                                     "-S", std::to_string(bytes), "-I", std::to_string(iters)};
  auto server = common, client = common;
  server.insert(server.end(), {"-B", std::to_string(port)});
  client.insert(client.end(), {"-P", std::to_string(port), "127.0.0.1"});
  pid_t s = start(server, dir + "/server.log");
  usleep(300000);
  const auto t0 = Clock::now();
  pid_t c = start(client, dir + "/client.log");
  double cpu = 0;
  Deadline deadline = Deadline::after(std::chrono::seconds(120));
  int rc = finish(c, deadline, &cpu);
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  finish(s, Deadline::after(std::chrono::seconds(5)), nullptr);
  std::string out = slurp(dir + "/client.log");
  Result r;
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream l(line);
    std::string b, sent, ack, total, time;
    double mbps = 0, usec = 0;
    if ((l >> b >> sent >> ack >> total >> time >> mbps >> usec) && b != "bytes") {
      r.lat_us = usec;
      r.mbps = mbps;
    }
  }
  if (rc != 0 || r.lat_us == 0)
    log::warn(log::Subsys::kFabric, "fi_pingpong -p {} -S {} failed (exit {}): {}", provider, bytes, rc, out);
  r.cpu = cpu / wall;
  return r;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int run(const Args& a, PointToPoint& p) {
  AlignedVector<char> out(a.max, 'p'), in(a.max, 0);  // 64-byte aligned, as tensors are
  if (p.rank() == 1) {
    pong(p, out.data(), in.data());
    return 0;
  }
  char tmpl[] = "/tmp/trn-p2pbench-XXXXXX";
  std::string dir = a.anchor ? mkdtemp(tmpl) : "";
  std::string fi_prov = a.provider.empty() || a.provider == "auto" ? "tcp" : a.provider;
  fmt::print("# trn-p2pbench: {}\n# median of {} runs per size{}\n", p.describe(), a.reps,
             a.anchor ? fmt::format(", alternating with fi_pingpong -p {} -e rdm -m tagged", fi_prov) : "");
  fmt::print("{:>10} {:>6} {:>10} {:>10} {:>6}", "bytes", "iters", "lat_us", "MiB/s", "cpu%");
  if (a.anchor) fmt::print(" | {:>10} {:>10} {:>6} | {:>8} {:>8}", "fi_lat_us", "fi_MiB/s", "cpu%", "lat/fi", "bw/fi");
  fmt::print("\n");
  for (size_t bytes = a.min; bytes <= a.max; bytes = bytes * 8 > a.max && bytes < a.max ? a.max : bytes * 8) {
    const int iters = iterations_for(a, bytes);
    std::vector<double> lat, bw, cpu, flat, fbw, fcpu;
    for (int rep = 0; rep < a.reps; ++rep) {
      Result r = ping(p, out.data(), in.data(), bytes, iters);
      lat.push_back(r.lat_us), bw.push_back(r.mbps), cpu.push_back(r.cpu * 100);
      if (a.anchor) {
        Result f = fi_pingpong(fi_prov, bytes, iters, dir);
        flat.push_back(f.lat_us), fbw.push_back(f.mbps), fcpu.push_back(f.cpu * 100);
      }
    }
    fmt::print("{:>10} {:>6} {:>10.2f} {:>10.1f} {:>6.0f}", bytes, iters, median(lat), median(bw), median(cpu));
    if (a.anchor)
      fmt::print(" | {:>10.2f} {:>10.1f} {:>6.0f} | {:>8.2f} {:>8}", median(flat), median(fbw), median(fcpu),
                 median(lat) / std::max(median(flat), 1e-9),
                 median(fbw) >= 0.05 ? fmt::format("{:.2f}", median(bw) / median(fbw)) : "-");  // fi_pingpong prints 0.00
    fmt::print("\n");
    std::fflush(stdout);
  }
  if (a.idle_s > 0) {  // how much CPU a wait of idle_s seconds costs
    uint64_t cmd[2] = {UINT64_MAX - 1, static_cast<uint64_t>(a.idle_s * 1e6)};
    p.isend(1, kCmdTag, cmd, sizeof(cmd))->wait(Deadline::from_default_timeout());
    auto r = p.irecv(1, kDataTag, in.data(), 8);
    p.isend(1, kDataTag, out.data(), 8)->wait(Deadline::from_default_timeout());
    const double c0 = cpu_seconds();
    const auto t0 = Clock::now();
    r->wait(Deadline::from_default_timeout());
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    fmt::print("# idle wait of {:.2f} s used {:.1f} ms of CPU ({:.2f}% of a core)\n", s, (cpu_seconds() - c0) * 1e3,
               (cpu_seconds() - c0) / s * 100);
  }
  uint64_t stop[2] = {UINT64_MAX, 0};
  p.isend(1, kCmdTag, stop, sizeof(stop))->wait(Deadline::from_default_timeout());
  if (!dir.empty()) std::filesystem::remove_all(dir);
  return 0;
}

fabric::Options options(const Args& a) {
  fabric::Options o = fabric::Options::from_environment();
  if (!a.provider.empty()) o.provider = a.provider;
  if (a.shm >= 0) o.shm = a.shm;
  if (a.spin_us >= 0) o.spin = std::chrono::nanoseconds(static_cast<int64_t>(a.spin_us * 1000));
  o.prefix = "p2pbench";
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  return run_main("trn-p2pbench", [&] {
    std::optional<Args> parsed = parse(argc, argv);
    if (!parsed) return 0;
    Args& a = *parsed;
    if (mpi::launched_by_mpirun() && a.rank < 0) {
      mpi::Bootstrap boot;
      auto p = boot.connect(options(a));
      return run(a, *p);
    }
    if (a.spawn) {
      char tmpl[] = "/tmp/trn-p2pbench-store-XXXXXX";
      a.store_dir = mkdtemp(tmpl);
      std::vector<std::string> peer = {"/proc/self/exe", "--rank", "1", "--size", "2", "--store-dir", a.store_dir};
      for (int i = 1; i < argc; ++i)
        if (std::string(argv[i]) != "--spawn" && std::string(argv[i]) != "--anchor") peer.push_back(argv[i]);
      pid_t child = start(peer, a.store_dir + "/rank1.log");
      a.rank = 0;
      FileStore store(a.store_dir);
      int rc = run(a, *fabric::connect(store, 0, 2, options(a)));
      int crc = finish(child, Deadline::after(std::chrono::seconds(30)), nullptr);
      std::string log1 = slurp(a.store_dir + "/rank1.log");
      std::filesystem::remove_all(a.store_dir);
      if (crc != 0) throw remote_error("rank 1 exited with {}: {}", crc, log1);
      return rc;
    }
    if (a.rank < 0 || a.store_dir.empty())
      throw usage_error("give --spawn, or --rank R --size 2 --store-dir D, or run under mpirun");
    FileStore store(a.store_dir);
    return run(a, *fabric::connect(store, a.rank, a.size, options(a)));
  });
}
