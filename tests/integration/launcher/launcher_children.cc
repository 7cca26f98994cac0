#include "tests/integration/launcher/launcher_children.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "launcher/agent/binding.h"
#include "launcher/agent/worker_env.h"
#include "launcher/client/coordinator_client.h"
#include "launcher/client/rpc.h"

namespace {

std::string env_or(const char* name, const char* fallback = "-") {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

void say(const std::string& line) {
  std::string l = line + "\n";
  (void)!write(STDOUT_FILENO, l.data(), l.size());
}

}  // namespace

// Prints its TRN_* environment on one line; exits with args[0] (default 0).
TRN_TEST_CHILD(env_report) {
  say("rank=" + env_or("TRN_RANK") + " local_rank=" + env_or("TRN_LOCAL_RANK") + " world_size=" +
      env_or("TRN_WORLD_SIZE") + " local_world_size=" + env_or("TRN_LOCAL_WORLD_SIZE") + " node_rank=" +
      env_or("TRN_NODE_RANK") + " generation=" + env_or("TRN_GENERATION") + " job_id=" + env_or("TRN_JOB_ID") +
      " coordinator=" + env_or("TRN_COORDINATOR") + " token_file=" + env_or("TRN_TOKEN_FILE") +
      " pid=" + std::to_string(getpid()));
  return args.empty() ? 0 : std::atoi(args[0].c_str());
}

// The CPUs it may run on (its sched_getaffinity mask, as trnrun --bind left it):
// "rank=R cpus=C,C,...".
TRN_TEST_CHILD(cpus_report) {
  std::string list;
  for (int c : trn::launch::allowed_cpus()) {
    if (!list.empty()) list += ',';
    list += std::to_string(c);
  }
  say("rank=" + env_or("TRN_RANK") + " cpus=" + list);
  return 0;
}

// What identity_from_environment() makes of this process's environment (mpirun / srun / trnrun).
TRN_TEST_CHILD(identity_report) {
  auto id = trn::launch::identity_from_environment();
  std::printf("identity source=%s rank=%d world_size=%d local_rank=%d local_world_size=%d node_rank=%d job_id=%s\n",
              trn::launch::to_string(id.source), id.rank, id.world_size, id.local_rank, id.local_world_size,
              id.node_rank, id.job_id.c_str());
  return 0;
}

// Prints many lines, each in several small writes, to stdout and stderr.
TRN_TEST_CHILD(chatter) {
  int n = std::atoi(args.at(0).c_str());
  std::string rank = env_or("TRN_RANK");
  for (int i = 0; i < n; ++i) {
    int fd = i % 7 == 0 ? STDERR_FILENO : STDOUT_FILENO;
    std::string parts[] = {"chatter ", rank, " line ", std::to_string(i), " end\n"};
    for (auto& p : parts) (void)!write(fd, p.data(), p.size());
  }
  (void)!write(STDOUT_FILENO, "unterminated", 12);
  return 0;
}

// Like fail_rank, saying its TRN_RUN_ID as well: "rank=R generation=G run_id=ID".
TRN_TEST_CHILD(run_id_report) {
  int rank = std::atoi(env_or("TRN_RANK", "0").c_str());
  int generation = std::atoi(env_or("TRN_GENERATION", "0").c_str());
  say("rank=" + std::to_string(rank) + " generation=" + std::to_string(generation) + " run_id=" + env_or("TRN_RUN_ID"));
  if (generation >= std::atoi(args.at(2).c_str())) return 0;
  if (rank == std::atoi(args.at(0).c_str())) return std::atoi(args.at(1).c_str());
  std::this_thread::sleep_for(std::chrono::seconds(60));
  return 0;
}

// Rank args[0] exits with code args[1] in generations below args[2]; other ranks wait to be
// stopped in those generations; everyone exits 0 from generation args[2] on.
TRN_TEST_CHILD(fail_rank) {
  int rank = std::atoi(env_or("TRN_RANK", "0").c_str());
  int generation = std::atoi(env_or("TRN_GENERATION", "0").c_str());
  say("rank=" + std::to_string(rank) + " generation=" + std::to_string(generation) + " pid=" +
      std::to_string(getpid()));
  if (generation >= std::atoi(args.at(2).c_str())) return 0;
  if (rank == std::atoi(args.at(0).c_str())) return std::atoi(args.at(1).c_str());
  std::this_thread::sleep_for(std::chrono::seconds(60));
  return 0;
}

// Starts a grandchild (same process group), reports both pids, then waits. With args[0] ==
// "stubborn" it ignores SIGINT and SIGTERM, so only SIGKILL ends it.
TRN_TEST_CHILD(sleeper) {
  bool stubborn = !args.empty() && args[0] == "stubborn";
  pid_t grandchild = fork();
  if (grandchild == 0) {
    execl("/bin/sleep", "sleep", "60", static_cast<char*>(nullptr));
    _exit(127);
  }
  if (stubborn) {
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
  }
  say("ready pid=" + std::to_string(getpid()) + " grandchild=" + std::to_string(grandchild));
  std::this_thread::sleep_for(std::chrono::seconds(60));
  return 0;
}

// A worker that heartbeats like a trainer: a step every 20 ms, at (dp, tp, pp) = (rank, 0, 0),
// until the file args[0] exists. Says once how its heartbeats travel, and when told to abort
// says why. It ignores SIGTERM, so that its answer to an abort is seen before trnrun's SIGKILL
// at the end of the grace period, unless args[1] is "obey-sigterm".
TRN_TEST_CHILD(heartbeat_worker) {
  if (args.size() < 2 || args[1] != "obey-sigterm") signal(SIGTERM, SIG_IGN);
  auto id = trn::launch::identity_from_environment();
  trn::control::CoordinatorClient client(trn::control::options_from_environment());
  std::atomic<bool> aborted{false};
  trn::control::Heartbeater hb(client, id.job_id, id.generation, id.rank, [&](const std::string& reason) {
    say("on_abort rank=" + std::to_string(id.rank) + " reason=" + reason);
    aborted = true;
  });
  hb.set_coordinates(id.rank, 0, 0);
  say("heartbeat_worker rank=" + std::to_string(id.rank) + " pid=" + std::to_string(getpid()) +
      " via_agent=" + (hb.via_agent() ? "1" : "0"));
  for (int64_t step = 1; !std::ifstream(args.at(0)).good(); ++step) {
    if (!aborted) hb.update(step, 1.0 / static_cast<double>(step), 1000.0 * static_cast<double>(id.rank + 1));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return 0;
}

// A worker that talks to its coordinator the way trn-train does (options_from_environment: TLS
// and its token from trnrun's TRN_* variables) and says what it found: whether its token is the
// admin token in args[0], whether its job's store and a barrier work, and what a status call
// on job args[1] (not its own) is answered.
TRN_TEST_CHILD(token_worker) {
  auto id = trn::launch::identity_from_environment();
  std::ifstream admin_in(args.at(0)), own_in(env_or("TRN_TOKEN_FILE", "/nonexistent"));
  std::string admin, own;
  std::getline(admin_in, admin);
  std::getline(own_in, own);
  std::string line = "rank=" + std::to_string(id.rank) + " tls_ca=" + (id.tls_ca.empty() ? "-" : "set") +
                     " tls_cert=" + (id.tls_cert.empty() ? "-" : "set") + " token=" +
                     (own.empty()    ? "none"
                      : own == admin ? "admin"
                                     : "job");
  try {
    trn::control::CoordinatorClient client(trn::control::options_from_environment());
    auto store = client.store(id.job_id, id.generation);
    store->set("rank/" + std::to_string(id.rank), "here");
    const int peer = (id.rank + 1) % id.world_size;
    line += " store=" +
            store->get("rank/" + std::to_string(peer), trn::Deadline::after(std::chrono::seconds(20)));
    client.barrier(id.job_id, id.generation, "token_worker", id.rank, id.world_size,
                   trn::Deadline::after(std::chrono::seconds(20)));
    line += " barrier=ok";
    trn::coordinator::v1::GetStatusRequest req;
    req.set_job_id(args.at(1));
    trn::coordinator::v1::GetStatusResponse resp;
    try {
      client.impl().call(&trn::coordinator::v1::Coordinator::Stub::GetStatus, req, &resp,
                         trn::Deadline::after(std::chrono::seconds(10)), "status");
      line += " other_job=served";
    } catch (const trn::Error& e) {
      line +=
          std::string(" other_job=") +
          (std::string(e.what()).find("may act on that job only") != std::string::npos ? "denied" : "error");
    }
  } catch (const trn::Error& e) {
    line += std::string(" failed=") + e.what();
  }
  say(line);
  return 0;
}

// Creates the file args[0] (to prove it ran).
TRN_TEST_CHILD(touch) {
  std::ofstream(args.at(0)) << "ran\n";
  return 0;
}

namespace trn::test::launch {

std::vector<std::string> trnrun_argv(const std::vector<std::string>& options, const std::string& child,
                                     const std::vector<std::string>& args) {
  std::vector<std::string> argv = {bin("trnrun")};
  argv.insert(argv.end(), options.begin(), options.end());
  argv.insert(argv.end(), {"--", self_exe(), "--trn-child", child});
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

std::map<int, std::map<std::string, std::string>> env_reports(const std::string& output) {
  std::map<int, std::map<std::string, std::string>> reports;
  std::istringstream in(output);
  std::string line;
  std::regex prefix(R"(^\[rank (\d+)\] (rank=.*)$)");
  while (std::getline(in, line)) {
    std::smatch m;
    if (!std::regex_match(line, m, prefix)) continue;
    std::map<std::string, std::string> kv;
    std::istringstream fields(m[2].str());
    std::string field;
    while (fields >> field) {
      auto eq = field.find('=');
      if (eq != std::string::npos) kv[field.substr(0, eq)] = field.substr(eq + 1);
    }
    reports[std::stoi(m[1].str())] = kv;
  }
  return reports;
}

std::vector<pid_t> numbers_after(const std::string& output, const std::string& key) {
  std::vector<pid_t> out;
  std::regex re("\\b" + key + "=(\\d+)");
  for (auto it = std::sregex_iterator(output.begin(), output.end(), re); it != std::sregex_iterator(); ++it)
    out.push_back(static_cast<pid_t>(std::stol((*it)[1].str())));
  return out;
}

Coordinator::Coordinator() {
  std::string port_file = dir.path() + "/port";
  process = std::make_unique<Process>(
      ProcSpec{{bin("trn-coordinator"), "--listen", "127.0.0.1:0", "--port-file", port_file}, {}});
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < deadline && process->running()) {
    std::ifstream in(port_file);
    std::string text;
    if (std::getline(in, text) && !text.empty()) {
      address = "127.0.0.1:" + text.substr(text.rfind(':') + 1);
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  throw std::runtime_error("trn-coordinator did not report its port: " + process->output_so_far());
}

bool gone(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content;
  std::getline(stat, content);
  auto close = content.rfind(')');
  return close != std::string::npos && close + 2 < content.size() && content[close + 2] == 'Z';
}

}  // namespace trn::test::launch
