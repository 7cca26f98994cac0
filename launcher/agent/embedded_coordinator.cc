#include "launcher/agent/embedded_coordinator.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>
#include <vector>

#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "launcher/agent/worker_group.h"

extern char** environ;

namespace trn::launch {
namespace {

namespace fs = std::filesystem;

std::optional<int> read_port(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!in || !std::getline(in, text)) return std::nullopt;
  auto colon = text.rfind(':');
  if (colon != std::string::npos) text = text.substr(colon + 1);
  try {
    size_t used = 0;
    int port = std::stoi(text, &used);
    if (port > 0 && port < 65536) return port;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

}  // namespace

int remove_stale_run_dirs() {
  std::error_code ec;
  fs::path tmp = fs::temp_directory_path(ec);
  if (ec) return 0;
  int removed = 0;
  for (const auto& entry : fs::directory_iterator(tmp, ec)) {
    std::string name = entry.path().filename().string();
    if (name.rfind("trnrun-", 0) != 0) continue;
    char* end = nullptr;
    long pid = std::strtol(name.c_str() + 7, &end, 10);
    if (pid <= 0 || *end != '-') continue;  // not ours, or an older trnrun's without a pid
    struct stat st {};
    if (::lstat(entry.path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::getuid()) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // still running (or not ours)
    std::error_code rm;
    fs::remove_all(entry.path(), rm);
    if (!rm) {
      ++removed;
      log::debug(log::Subsys::kLaunch, "removed {}, left by trnrun pid {} which no longer runs",
                 entry.path().string(), pid);
    }
  }
  return removed;
}

std::string own_bin_dir() {
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) throw internal_error("cannot read /proc/self/exe: {}", ec.message());
  return exe.parent_path().string();
}

EmbeddedCoordinator::EmbeddedCoordinator(const std::string& program, const std::string& token_file,
                                         const std::string& log_path, Deadline deadline) {
  if (access(program.c_str(), X_OK) != 0)
    throw usage_error("no --coordinator given and {} is missing; build trn-coordinator or pass "
                      "--coordinator HOST:PORT", program);
  std::string tmpl = (fs::temp_directory_path() / fmt::format("trnrun-{}-XXXXXX", getpid())).string();
  if (!mkdtemp(tmpl.data())) throw internal_error("mkdtemp failed: {}", strerror(errno));
  dir_ = tmpl;
  std::string port_file = dir_ + "/port";
  std::vector<std::string> args = {program, "--listen", "127.0.0.1:0", "--port-file", port_file};
  if (!token_file.empty()) args.insert(args.end(), {"--token-file", token_file});
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  // Its routine lines (joins, generations) would bury the workers' output: warnings only, unless
  // the user chose a level.
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) env_strings.emplace_back(*e);
  if (!std::getenv("TRN_LOG_LEVEL")) env_strings.emplace_back("TRN_LOG_LEVEL=warn");
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  // A log file is written as PATH.partial and renamed once the coordinator has stopped.
  log_path_ = log_path;
  int out = log_path.empty() ? ::dup(STDERR_FILENO)
                             : ::open((log_path + ".partial").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out < 0) throw usage_error("cannot create {}.partial: {}; check --log-dir", log_path, strerror(errno));
  int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  pid_t parent = getpid();
  pid_ = fork();
  if (pid_ < 0) throw internal_error("fork failed: {}", strerror(errno));
  if (pid_ == 0) {
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGCHLD}) signal(sig, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    dup2(devnull, STDIN_FILENO);
    dup2(out, STDOUT_FILENO);
    dup2(out, STDERR_FILENO);
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  setpgid(pid_, pid_);
  ::close(out);
  ::close(devnull);
  while (true) {
    if (auto port = read_port(port_file)) {
      address_ = "127.0.0.1:" + std::to_string(*port);
      break;
    }
    if (!running()) {
      stop(Duration::zero());
      throw internal_error("the embedded trn-coordinator exited before reporting its port (see its output above)");
    }
    if (deadline.expired()) {
      stop(Duration::zero());
      throw timeout_error("the embedded trn-coordinator did not report its port in time");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  log::info(log::Subsys::kLaunch, "started embedded coordinator (pid {}) at {}", pid_, address_);
}

EmbeddedCoordinator::~EmbeddedCoordinator() {
  stop(std::chrono::seconds(5));
  std::error_code ec;
  if (!dir_.empty()) fs::remove_all(dir_, ec);
}

bool EmbeddedCoordinator::running() {
  if (reaped_) return false;
  int status = 0;
  pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == 0) return true;
  if (r < 0 && errno == EINTR) return true;
  reaped_ = true;
  status_ = r == pid_ ? status : 0;
  return false;
}

std::string EmbeddedCoordinator::lost() {
  if (stopping_ || pid_ <= 0 || running()) return "";
  std::string how = WIFSIGNALED(status_) ? fmt::format("was killed by signal {} ({})", WTERMSIG(status_),
                                                       signal_name(WTERMSIG(status_)))
                    : WIFEXITED(status_) ? fmt::format("exited with code {}", WEXITSTATUS(status_))
                                         : std::string("exited");
  return fmt::format("the embedded trn-coordinator (pid {}) {}", pid_, how);
}

void EmbeddedCoordinator::stop(Duration grace) {
  stopping_ = true;
  if (pid_ <= 0 || !running()) {
    finish_log();
    return;
  }
  ::kill(pid_, SIGTERM);
  Deadline deadline = Deadline::after(grace);
  while (running() && !deadline.expired()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (running()) {
    ::kill(-pid_, SIGKILL);
    while (waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
    }
    reaped_ = true;
  }
  log::debug(log::Subsys::kLaunch, "stopped embedded coordinator");
  finish_log();
}

void EmbeddedCoordinator::finish_log() {
  if (log_path_.empty() || !reaped_) return;
  std::string partial = log_path_ + ".partial";
  int fd = ::open(partial.c_str(), O_WRONLY | O_CLOEXEC);
  bool ok = fd >= 0 && ::fsync(fd) == 0;
  if (fd >= 0) ::close(fd);
  if (!ok || ::rename(partial.c_str(), log_path_.c_str()) != 0)
    log::warn(log::Subsys::kLaunch, "could not finish {}: {}", log_path_, strerror(errno));
  log_path_.clear();
}

}  // namespace trn::launch
