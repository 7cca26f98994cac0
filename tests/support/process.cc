#include "tests/support/process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace trn::test {

std::string ProcResult::describe() const {
  std::string s;
  if (timed_out) s = "timed out (killed)";
  else if (signal) s = "killed by signal " + std::to_string(signal);
  else s = "exit " + std::to_string(exit_code);
  return s + "\n--- output ---\n" + output + "--------------";
}

Process::Process(const ProcSpec& spec) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq != std::string::npos && spec.env.count(kv.substr(0, eq))) continue;
    env_strings.push_back(kv);
  }
  for (auto& [k, v] : spec.env) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp, argv;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = spec.argv;
  for (auto& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);

  pid_ = fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    setpgid(0, 0);
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, STDIN_FILENO);
    execvpe(argv[0], argv.data(), envp.data());
    const char* msg = "exec failed: ";
    (void)!write(STDERR_FILENO, msg, strlen(msg));
    (void)!write(STDERR_FILENO, argv[0], strlen(argv[0]));
    _exit(127);
  }
  setpgid(pid_, pid_);  // also from the parent, so signal_group works at once
  close(fds[1]);
  fd_ = fds[0];
  fcntl(fd_, F_SETFL, O_NONBLOCK);
}

Process::~Process() {
  if (!reaped_ && pid_ > 0) {
    ::kill(-pid_, SIGKILL);
    ::kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (fd_ >= 0) close(fd_);
}

void Process::signal(int sig) {
  if (!reaped_) ::kill(pid_, sig);
}
void Process::signal_group(int sig) {
  if (!reaped_) ::kill(-pid_, sig);
}

void Process::drain(int timeout_ms) {
  if (fd_ < 0) return;
  pollfd p{fd_, POLLIN, 0};
  if (poll(&p, 1, timeout_ms) <= 0) return;
  char buf[65536];
  for (;;) {
    ssize_t n = read(fd_, buf, sizeof(buf));
    if (n > 0) {
      result_.output.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n == 0) {  // every writer closed
      close(fd_);
      fd_ = -1;
    }
    return;
  }
}

const std::string& Process::output_so_far() {
  drain(0);
  return result_.output;
}

bool Process::running() {
  if (reaped_) return false;
  // The group is killed while the exited child is a zombie (WNOWAIT): its pid, and so its group
  // id, cannot have been reused by another test's process yet. Then it is reaped.
  siginfo_t info{};
  const int rc = waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOHANG | WNOWAIT);
  if (rc < 0 && errno == EINTR) return true;
  if (rc == 0 && info.si_pid == 0) return true;  // still running
  int status = 0;
  if (rc == 0) {
    ::kill(-pid_, SIGKILL);  // no grandchild outlives its test
    while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
  }
  reaped_ = true;  // also when it cannot be waited for (ECHILD): nothing more will come of it
  if (rc == 0 && WIFEXITED(status)) result_.exit_code = WEXITSTATUS(status);
  if (rc == 0 && WIFSIGNALED(status)) result_.signal = WTERMSIG(status);
  return false;
}

ProcResult Process::wait(std::chrono::steady_clock::time_point deadline) {
  while (running()) {
    if (std::chrono::steady_clock::now() >= deadline) {
      result_.timed_out = true;
      ::kill(-pid_, SIGKILL);
      ::kill(pid_, SIGKILL);
      int status = 0;
      waitpid(pid_, &status, 0);
      reaped_ = true;
      if (WIFSIGNALED(status)) result_.signal = WTERMSIG(status);
      break;
    }
    drain(20);
  }
  // Collect what is left in the pipe (grandchildren were killed, so it closes soon).
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (fd_ >= 0 && std::chrono::steady_clock::now() < until) drain(50);
  return result_;
}

std::vector<ProcResult> run_all(const std::vector<ProcSpec>& specs, std::chrono::seconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<std::unique_ptr<Process>> procs;
  for (auto& s : specs) procs.push_back(std::make_unique<Process>(s));
  // Poll all so that no pipe fills up while another process is awaited.
  for (;;) {
    bool any = false;
    for (auto& p : procs) {
      p->output_so_far();
      any |= p->running();
    }
    if (!any || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::vector<ProcResult> results;
  for (auto& p : procs) results.push_back(p->wait(deadline));
  return results;
}

std::string self_exe() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

ProcSpec child(const std::string& name, std::vector<std::string> args,
               std::map<std::string, std::string> env) {
  ProcSpec s;
  s.argv = {self_exe(), "--trn-child", name};
  for (auto& a : args) s.argv.push_back(a);
  s.env = std::move(env);
  return s;
}

std::string bin(const std::string& name) {
  return (std::filesystem::path(self_exe()).parent_path() / name).string();
}

TempDir::TempDir() {
  std::string tmpl = (std::filesystem::temp_directory_path() / "trn-test-XXXXXX").string();
  if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
  path_ = tmpl;
}
TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

namespace {
std::map<std::string, ChildFn>& children() {
  static std::map<std::string, ChildFn> m;
  return m;
}
}  // namespace

bool register_child(const std::string& name, ChildFn fn) {
  children()[name] = std::move(fn);
  return true;
}

bool maybe_run_child(int argc, char** argv, int* exit_code) {
  if (argc < 3 || std::string(argv[1]) != "--trn-child") return false;
  auto it = children().find(argv[2]);
  if (it == children().end()) {
    fprintf(stderr, "no test child named %s\n", argv[2]);
    *exit_code = 127;
    return true;
  }
  std::vector<std::string> args(argv + 3, argv + argc);
  try {
    *exit_code = it->second(args);
  } catch (const std::exception& e) {
    fprintf(stderr, "child %s failed: %s\n", argv[2], e.what());
    *exit_code = 1;
  }
  return true;
}

}  // namespace trn::test
