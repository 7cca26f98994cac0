#include "launcher/agent/worker_group.h"

#include <fcntl.h>
#include <sched.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <set>
#include <thread>

#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "launcher/agent/binding.h"

extern char** environ;

namespace trn::launch {
namespace {

// Everything the child needs, prepared before fork: after fork only async-signal-safe calls.
struct Prepared {
  std::vector<std::string> argv_strings, env_strings;
  std::vector<char*> argv, envp;
  // The worker's CPU mask (spec.cpus), set in the child before execve so that every thread the
  // program starts inherits it; empty: the child keeps trnrun's.
  std::vector<unsigned long> mask;
};

std::vector<unsigned long> cpu_mask(const std::vector<int>& cpus) {
  constexpr int kBits = 8 * sizeof(unsigned long);
  std::vector<unsigned long> mask;
  for (int c : cpus) {
    if (static_cast<size_t>(c / kBits) >= mask.size()) mask.resize(c / kBits + 1, 0);
    mask[c / kBits] |= 1UL << (c % kBits);
  }
  return mask;
}

Prepared prepare(const WorkerSpec& spec) {
  Prepared p;
  p.argv_strings = spec.argv;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq != std::string::npos && spec.env.count(kv.substr(0, eq))) continue;
    p.env_strings.push_back(std::move(kv));
  }
  for (const auto& [k, v] : spec.env) p.env_strings.push_back(k + "=" + v);
  for (auto& s : p.argv_strings) p.argv.push_back(s.data());
  p.argv.push_back(nullptr);
  for (auto& s : p.env_strings) p.envp.push_back(s.data());
  p.envp.push_back(nullptr);
  p.mask = cpu_mask(spec.cpus);
  return p;
}

// exec_fd: the write end of a close-on-exec pipe. A successful execve closes it (the parent reads
// end of file); a failed one writes its errno there, so the parent tells "could not be executed"
// from a program that ran and exited 127 itself.
[[noreturn]] void exec_child(const Prepared& p, pid_t parent, int devnull, int out_fd, int err_fd, int exec_fd) {
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(127);  // trnrun died before the line above
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGCHLD, SIGQUIT}) signal(sig, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  dup2(devnull, STDIN_FILENO);
  dup2(out_fd, STDOUT_FILENO);
  dup2(err_fd, STDERR_FILENO);
  // The mask is a share of trnrun's own (binding.h), so this fails only if those CPUs went
  // offline since; the worker then runs on trnrun's CPUs, as under --bind none.
  if (!p.mask.empty())
    (void)sched_setaffinity(0, p.mask.size() * sizeof(unsigned long), reinterpret_cast<const cpu_set_t*>(p.mask.data()));
  execve(p.argv[0], p.argv.data(), p.envp.data());
  const int e = errno;
  (void)!write(exec_fd, &e, sizeof e);
  _exit(127);
}

// How long the parent waits for the child to exec (or say it cannot). Between fork and execve
// the child makes a few system calls and nothing else, so this passes only when something stops
// it there (SIGSTOP); the worker then counts as started, and a failed execve shows as exit 127.
constexpr int kExecWaitMs = 10000;

// What the child's execve failed with (read from exec_fd), or 0 once it executed the program.
int exec_errno(int exec_fd, pid_t pid) {
  pollfd pfd{exec_fd, POLLIN, 0};
  int ready;
  do {
    ready = ::poll(&pfd, 1, kExecWaitMs);
  } while (ready < 0 && errno == EINTR);
  if (ready <= 0) {
    log::warn(log::Subsys::kLaunch, "pid {} did not start its program within {} s; taking it as started", pid,
              kExecWaitMs / 1000);
    return 0;
  }
  int e = 0;
  ssize_t n;
  do {
    n = ::read(exec_fd, &e, sizeof e);
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(sizeof e) ? e : 0;
}

// Why execve refused program, in one line that says what to do.
std::string cannot_execute(const std::string& program, int e) {
  const char* name = strerrorname_np(e);
  std::string why = fmt::format("program {} cannot be executed: {} ({})", program, std::strerror(e),
                                name ? name : std::to_string(e));
  switch (e) {
    case ENOEXEC:
      return why + ": it is neither a binary for this machine nor a script starting with #!; give the right "
                   "binary, or run it through its interpreter (trnrun -- sh " + program + ")";
    case ENOENT:
      return why + ": it, or the interpreter its #! line names, does not exist; fix the path or the #! line";
    case EACCES:
      return why + ": no permission to execute it (its mode, a folder of its path, or a noexec mount); fix "
                   "the permissions or move it";
    default:
      return why + "; fix the program or the command";
  }
}

// True when pid is stopped (SIGSTOP, SIGTSTP: state T) or held by a tracer (t), per /proc.
bool is_stopped(pid_t pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[512];
  ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return false;
  buf[n] = 0;
  // "pid (comm) S ...": comm may hold spaces and parentheses, the state follows the last ')'.
  const char* close = std::strrchr(buf, ')');
  return close && close[1] == ' ' && (close[2] == 'T' || close[2] == 't');
}

}  // namespace

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

std::string WorkerExit::describe() const {
  if (signal) return fmt::format("was killed by signal {} ({})", signal, signal_name(signal));
  return fmt::format("exited with code {}", exit_code);
}

WorkerGroup::Worker WorkerGroup::spawn(const WorkerSpec& spec, int devnull) {
  TRN_CHECK(!spec.argv.empty());
  Prepared p = prepare(spec);
  int out[2] = {-1, -1}, err[2] = {-1, -1}, exec[2] = {-1, -1};
  auto close_all = [&] {
    for (int fd : {out[0], out[1], err[0], err[1], exec[0], exec[1]})
      if (fd >= 0) ::close(fd);
  };
  if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0 || pipe2(exec, O_CLOEXEC) != 0) {
    const int e = errno;
    close_all();
    throw internal_error("pipe2 failed: {}", strerror(e));
  }
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    const int e = errno;
    close_all();
    throw internal_error("fork failed: {}", strerror(e));
  }
  if (pid == 0) exec_child(p, parent, devnull, out[1], err[1], exec[1]);
  setpgid(pid, pid);  // also here, so signalling the group works at once
  for (int* fd : {&out[1], &err[1], &exec[1]}) {
    ::close(*fd);
    *fd = -1;
  }
  Worker w{spec.rank, spec.local_rank, pid, Clock::now()};
  const int exec_error = exec_errno(exec[0], pid);
  ::close(exec[0]);
  exec[0] = -1;
  if (exec_error != 0) {
    // The child exits at once; every restart would fail the same way, so this is the command's
    // fault: a usage error, not a failed worker.
    wait_exit(w);
    close_all();
    throw usage_error("{}", cannot_execute(spec.argv[0], exec_error));
  }
  log::debug(log::Subsys::kLaunch, "started rank {} (local rank {}) as pid {} on cpus {}: {}", spec.rank,
             spec.local_rank, pid, spec.cpus.empty() ? "of trnrun" : format_cpu_list(spec.cpus),
             fmt::join(spec.argv, " "));
  try {
    pump_.add(out[0], err[0], spec.sink);
  } catch (...) {
    ::kill(-pid, SIGKILL);
    wait_exit(w);
    throw;
  }
  return w;
}

WorkerGroup::WorkerGroup(const std::vector<WorkerSpec>& specs, OutputPump& pump) : pump_(pump) {
  int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (devnull < 0) throw internal_error("cannot open /dev/null: {}", strerror(errno));
  try {
    for (const auto& spec : specs) workers_.push_back(spawn(spec, devnull));
  } catch (...) {
    ::close(devnull);
    stop(0, Duration::zero());
    throw;
  }
  ::close(devnull);
}

void WorkerGroup::renumber(int first_rank) {
  for (auto& w : workers_) w.rank = first_rank + w.local_rank;
}

void WorkerGroup::replace(const WorkerSpec& spec) {
  auto it = std::find_if(workers_.begin(), workers_.end(),
                         [&](const Worker& w) { return w.local_rank == spec.local_rank; });
  if (it == workers_.end()) throw internal_error("worker group: no local rank {} to replace", spec.local_rank);
  if (!it->exited)
    throw internal_error("worker group: local rank {} (pid {}) is still running; it cannot be replaced",
                         spec.local_rank, it->pid);
  int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (devnull < 0) throw internal_error("cannot open /dev/null: {}", strerror(errno));
  try {
    *it = spawn(spec, devnull);
  } catch (...) {
    ::close(devnull);
    throw;
  }
  ::close(devnull);
}

WorkerExit WorkerGroup::wait_exit(Worker& w) {
  int status = 0;
  pid_t r;
  do {
    r = waitpid(w.pid, &status, 0);
  } while (r < 0 && errno == EINTR);
  w.exited = true;
  WorkerExit e{w.rank, w.local_rank, w.pid, 0, 0};
  if (r == w.pid && WIFEXITED(status)) e.exit_code = WEXITSTATUS(status);
  else if (r == w.pid && WIFSIGNALED(status)) e.signal = WTERMSIG(status);
  else e.exit_code = 255;  // lost (ECHILD): cannot know, count as failed
  return e;
}

std::optional<WorkerExit> WorkerGroup::kill(int local_rank) {
  for (auto& w : workers_) {
    if (w.local_rank != local_rank || w.exited) continue;
    ::kill(-w.pid, SIGKILL);  // also wakes a stopped process, to die
    return wait_exit(w);
  }
  return std::nullopt;
}

std::vector<WorkerInfo> WorkerGroup::workers() const {
  std::vector<WorkerInfo> out;
  for (const auto& w : workers_) out.push_back({w.rank, w.local_rank, w.pid, w.started, !w.exited});
  return out;
}

WorkerGroup::~WorkerGroup() { stop(0, Duration::zero()); }

std::vector<WorkerExit> WorkerGroup::reap() {
  std::vector<WorkerExit> exits;
  for (auto& w : workers_) {
    if (w.exited) continue;
    // Seen exited but not yet reaped (WNOWAIT): while the zombie holds its pid, the pid and its
    // process group id cannot be reused, so killing what it left behind in its group cannot hit
    // another process's group. Only then is it reaped (at once: it is a zombie already).
    siginfo_t info{};
    int rc;
    do {
      rc = waitid(P_PID, static_cast<id_t>(w.pid), &info, WEXITED | WNOHANG | WNOWAIT);
    } while (rc < 0 && errno == EINTR);
    if (rc == 0 && info.si_pid == 0) continue;  // still running
    int status = 0;
    pid_t r = -1;
    if (rc == 0) {
      ::kill(-w.pid, SIGKILL);  // anything it left behind in its group
      do {
        r = waitpid(w.pid, &status, 0);
      } while (r < 0 && errno == EINTR);
    }
    w.exited = true;
    WorkerExit e{w.rank, w.local_rank, w.pid, 0, 0};
    if (r == w.pid && WIFEXITED(status)) e.exit_code = WEXITSTATUS(status);
    else if (r == w.pid && WIFSIGNALED(status)) e.signal = WTERMSIG(status);
    else e.exit_code = 255;  // lost (ECHILD): cannot know, count as failed
    exits.push_back(e);
  }
  return exits;
}

size_t WorkerGroup::running() const {
  size_t n = 0;
  for (const auto& w : workers_) n += !w.exited;
  return n;
}

std::vector<pid_t> WorkerGroup::pids() const {
  std::vector<pid_t> p;
  for (const auto& w : workers_) p.push_back(w.pid);
  return p;
}

void WorkerGroup::signal_all(int sig) {
  for (const auto& w : workers_)
    if (!w.exited) ::kill(-w.pid, sig);
}

std::vector<WorkerExit> WorkerGroup::stop(int sig, Duration grace, const std::function<bool()>& kill_now) {
  std::vector<WorkerExit> exits = reap();
  if (sig != 0) signal_all(sig);
  Deadline deadline = Deadline::after(grace);
  // A stopped worker cannot act on the signal until continued, so the grace period would be
  // spent for nothing: it is killed at once. (Not continued first: whatever stopped it, a
  // debugger or a hang the coordinator already gave up on, it has no part in the job any more,
  // and a tracer's stop would not even let it run.)
  std::set<pid_t> killed;
  auto kill_stopped = [&] {
    if (sig == 0) return;
    for (const auto& w : workers_)
      if (!w.exited && !killed.count(w.pid) && is_stopped(w.pid)) {
        killed.insert(w.pid);
        log::info(log::Subsys::kLaunch, "rank {} (pid {}) is stopped and cannot act on {}; sending SIGKILL now",
                  w.rank, w.pid, signal_name(sig));
        ::kill(-w.pid, SIGKILL);
      }
  };
  kill_stopped();
  while (running() > 0 && !deadline.expired() && !(kill_now && kill_now())) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    auto more = reap();
    exits.insert(exits.end(), more.begin(), more.end());
    kill_stopped();
  }
  if (running() > 0)
    log::debug(log::Subsys::kLaunch, "{} workers still running; sending SIGKILL", running());
  // Only the unreaped: a reaped worker's pid is free, and its number may already lead another
  // process's group (its own leftovers were killed when it was reaped).
  for (const auto& w : workers_)
    if (!w.exited) ::kill(-w.pid, SIGKILL);
  for (auto& w : workers_)
    if (!w.exited) exits.push_back(wait_exit(w));
  return exits;
}

}  // namespace trn::launch
