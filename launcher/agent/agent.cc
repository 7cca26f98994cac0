#include "launcher/agent/agent.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <random>
#include <thread>

#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "collectives/core/settings.h"
#include "launcher/agent/heartbeat_relay.h"
#include "launcher/agent/plan.h"
#include "launcher/agent/worker_group.h"

namespace trn::launch {
namespace {

constexpr auto kDrainTimeout = std::chrono::seconds(5);
// How long the other workers get to exit on their own after one made a usage error.
constexpr auto kUsageErrorWindow = std::chrono::seconds(3);

std::string hostname() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

// A folder only this user can enter: $TMPDIR/trnrun-<pid>-XXXXXX, which remove_stale_run_dirs
// clears once this trnrun is gone.
std::string make_private_dir() {
  std::error_code ec;
  std::string tmpl =
      (std::filesystem::temp_directory_path(ec) / fmt::format("trnrun-{}-XXXXXX", getpid())).string();
  if (ec || !::mkdtemp(tmpl.data()))
    throw usage_error("cannot make a private folder in {}: {}; set TMPDIR to a writable folder",
                      std::filesystem::path(tmpl).parent_path().string(),
                      ec ? ec.message() : std::strerror(errno));
  return tmpl;
}

// Writes a secret as path, readable by this user only (a temporary file renamed over it).
void write_secret(const std::string& path, const std::string& secret) {
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
  bool ok = fd >= 0 && ::fchmod(fd, 0600) == 0 &&
            ::write(fd, secret.data(), secret.size()) == static_cast<ssize_t>(secret.size());
  int e = errno;
  if (fd >= 0) ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    if (ok) e = errno;
    ::unlink(tmp.c_str());
    throw internal_error("cannot write the job token to {}: {}", path, std::strerror(e));
  }
}

}  // namespace

// Sends node_heartbeat every TRN_HEARTBEAT_INTERVAL from its own thread (so a slow call never
// delays reacting to a worker's exit or a signal), carrying the heartbeats the workers handed
// the relay since the last one. An abort reply is passed on to the workers and reported once.
// When the coordinator stays unreachable for TRN_TIMEOUT the workers are told to abort, as a
// worker heartbeating directly would decide for itself.
class Agent::Heartbeat {
 public:
  Heartbeat(Agent& agent, int64_t generation, int node_rank)
      : agent_(agent), generation_(generation), node_rank_(node_rank) {
    thread_ = std::thread([this] { loop(); });
  }
  ~Heartbeat() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  void loop() {
    Duration interval = settings::get_seconds("TRN_HEARTBEAT_INTERVAL");
    HeartbeatRelay* relay = agent_.relay_.get();
    bool failing = false, told_unreachable = false;
    auto last_ok = Clock::now();
    std::unique_lock lock(mu_);
    while (!cv_.wait_for(lock, interval, [&] { return stop_; })) {
      lock.unlock();
      try {
        std::vector<control::ForwardedHeartbeat> ranks;
        if (relay) {
          relay->resend_resume();  // survivors of an in-place recovery not heard in this generation yet
          ranks = relay->take();
        }
        auto reply = agent_.control_.node_heartbeat(agent_.options_.job_id, generation_, node_rank_, ranks,
                                                    agent_.host_);
        if (failing) log::info(log::Subsys::kLaunch, "coordinator reachable again");
        failing = false;
        last_ok = Clock::now();
        if (reply.abort) {
          std::string reason = reply.reason.empty() ? "no reason given" : reply.reason;
          if (relay) relay->tell_abort(reason, reply.generation);
          {
            std::lock_guard moved(agent_.moved_mu_);
            agent_.moved_reason_ = reply.stopped ? reason
                                                 : fmt::format("generation {} -> {}: {}", generation_,
                                                               reply.generation, reason);
          }
          agent_.stopped_by_user_ = reply.stopped;
          agent_.generation_moved_ = true;
          agent_.signals_.notify();
          return;
        }
      } catch (const Error& e) {
        if (!failing) log::warn(log::Subsys::kLaunch, "node heartbeat failed: {}", e.what());
        failing = true;
        auto down = Clock::now() - last_ok;
        if (relay && !told_unreachable && down > default_timeout()) {
          told_unreachable = true;
          std::string why = fmt::format("coordinator unreachable for {:.0f} s: {}",
                                        std::chrono::duration<double>(down).count(), e.what());
          relay->tell_abort(why, generation_);
          if (agent_.in_place()) {
            // Workers kept in place would wait for a resume that no generation will bring: the
            // agent stops them and re-joins, as --recovery restart does.
            {
              std::lock_guard moved(agent_.moved_mu_);
              agent_.moved_reason_ = why;
            }
            agent_.unreachable_ = true;
            agent_.generation_moved_ = true;
            agent_.signals_.notify();
            return;
          }
        }
      }
      lock.lock();
    }
  }

  Agent& agent_;
  int64_t generation_;
  int node_rank_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

Agent::Agent(LaunchOptions options, ControlPlane& control, std::string coordinator, SignalWatcher& signals,
             const std::string& run_dir)
    : options_(std::move(options)),
      control_(control),
      coordinator_(std::move(coordinator)),
      signals_(signals),
      host_(hostname()) {
  // The coordinator ranks nodes by node id (byte order): a --node-rank hint leads the id, so
  // hinted nodes get their rank (and come before unhinted ones, which sort after '~').
  std::string agent = fmt::format("{}:{}", host_, getpid());
  node_id_ = options_.node_rank_hint >= 0 ? fmt::format("{:06d}/{}", options_.node_rank_hint, agent) : "~/" + agent;
  if (!options_.log_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(options_.log_dir, ec);
    if (ec) throw usage_error("--log-dir {}: cannot create it: {}", options_.log_dir, ec.message());
    if (::access(options_.log_dir.c_str(), W_OK | X_OK) != 0)
      throw usage_error("--log-dir {} is not writable by this user; pick another directory", options_.log_dir);
  }
  if (run_dir.empty()) own_dir_ = make_private_dir();
  run_dir_ = run_dir.empty() ? own_dir_ : run_dir;
  try {
    relay_ = std::make_unique<HeartbeatRelay>(options_.job_id, run_dir_);
  } catch (const Error& e) {
    log::warn(log::Subsys::kLaunch, "{}; the workers will heartbeat the coordinator directly{}", e.what(),
              options_.recovery == Recovery::kInPlace
                  ? ", and --recovery in-place cannot reach them: failures restart every worker"
                  : "");
  }
}

std::string describe_failures(const std::vector<WorkerExit>& failed) {
  std::string out;
  for (size_t i = 0; i < failed.size(); ++i) {
    const auto& e = failed[i];
    if (i > 0) out += i + 1 == failed.size() ? " and " : ", ";
    out += fmt::format("rank {} (local rank {}, pid {}) {}", e.rank, e.local_rank, e.pid, e.describe());
  }
  return out;
}

Duration hung_worker_silence(Duration heartbeat_interval) {
  return std::max<Duration>(3 * heartbeat_interval, std::chrono::seconds(2));
}

bool Agent::in_place() const { return options_.recovery == Recovery::kInPlace && relay_ != nullptr; }

Agent::~Agent() {
  relay_.reset();  // its socket may live in own_dir_
  std::error_code ec;
  if (!own_dir_.empty()) std::filesystem::remove_all(own_dir_, ec);
}

std::string Agent::job_token_file() {
  if (joined_.job_token.empty()) return "";
  const std::string path = run_dir_ + "/" + kJobTokenFile;
  if (joined_.job_token != written_token_) {
    write_secret(path, joined_.job_token + "\n");
    written_token_ = joined_.job_token;
  }
  return path;
}

void Agent::transition(AgentEvent event, std::optional<Recovery> recovery) {
  AgentState next = next_state(state_, event, restarts_used_, options_.max_restarts,
                               recovery.value_or(in_place() ? Recovery::kInPlace : Recovery::kRestart));
  log::debug(log::Subsys::kLaunch, "agent: {} --{}--> {}", to_string(state_), to_string(event), to_string(next));
  state_ = next;
}

bool Agent::join() {
  control::JoinRequest request;
  request.job_id = options_.job_id;
  request.node_id = node_id_;
  request.host = host_;
  request.nproc_per_node = options_.nproc_per_node;
  request.min_nodes = options_.min_nodes;
  request.max_nodes = options_.max_nodes;
  request.deadline = Deadline::after(options_.join_timeout);
  if (restarts_used_ == 0) {
    // Joining a running elastic job waits for its next round, which is legitimate (it grows, or
    // keeps this node as a spare) but must not look like a hang; so does replacing a silent
    // member of a fixed-size job. A running fixed-size job whose members all heartbeat refuses
    // the join at once, with its own message.
    auto job = control_.peek_job(options_.job_id);
    if (job && job->state == "running" && job->min_nodes == job->max_nodes && job->member_silent) {
      log::warn(log::Subsys::kLaunch,
                "job {} is already running generation {} on all its {} nodes, one of them silent: this node waits, "
                "up to {:.0f} s (--join-timeout), to replace it once the coordinator's heartbeat timeout ends "
                "that generation",
                options_.job_id, job->generation, job->nodes,
                std::chrono::duration<double>(options_.join_timeout).count());
    } else if (job && job->state == "running" && job->min_nodes < job->max_nodes) {
      double wait_s = std::chrono::duration<double>(options_.join_timeout).count();
      if (job->nodes < job->max_nodes)
        log::warn(log::Subsys::kLaunch,
                  "job {} is already running generation {} on {} of at most {} nodes: this node joins it, which "
                  "restarts its workers in a new generation; waiting up to {:.0f} s (--join-timeout) for that "
                  "rendezvous",
                  options_.job_id, job->generation, job->nodes, job->max_nodes, wait_s);
      else
        log::warn(log::Subsys::kLaunch,
                  "job {} is already running generation {} on all {} of its at most {} nodes: this node waits as "
                  "a spare, up to {:.0f} s (--join-timeout), for a rendezvous that a failure would start",
                  options_.job_id, job->generation, job->nodes, job->max_nodes, wait_s);
    }
  }
  // The call runs on its own thread so that a signal during a long rendezvous ends trnrun at once.
  auto result = std::make_shared<std::promise<control::JoinResult>>();
  auto future = result->get_future();
  std::thread call([this, request, result] {
    try {
      result->set_value(control_.join(request));
    } catch (...) {
      result->set_exception(std::current_exception());
    }
    signals_.notify();
  });
  while (future.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
    if (signals_.first_signal() || !(lost_ = gone()).empty()) {
      call.detach();
      abandoned_call_ = true;
      return false;
    }
    signals_.wait(options_.monitor_interval);
  }
  call.join();
  joined_ = future.get();  // a rendezvous error ends the job here
  generation_ = joined_.generation;
  log::set_generation(generation_);
  if (joined_.run_id.empty()) {
    if (fallback_run_id_.empty()) {
      std::random_device rd;
      fallback_run_id_ = fmt::format("{:016x}", (static_cast<uint64_t>(rd()) << 32) ^ rd());
    }
    joined_.run_id = fallback_run_id_;
  }
  if (options_.node_rank_hint >= 0 && joined_.node_rank != options_.node_rank_hint)
    log::warn(log::Subsys::kLaunch, "asked for node rank {}, the coordinator assigned {}", options_.node_rank_hint,
              joined_.node_rank);
  log::info(log::Subsys::kLaunch, "joined job {} generation {}: node {} of {}, ranks {}..{} of {}", options_.job_id,
            generation_, joined_.node_rank, joined_.nnodes, joined_.rank_offset,
            joined_.rank_offset + options_.nproc_per_node - 1, joined_.world_size);
  return true;
}

AgentResult Agent::interrupted(size_t workers) {
  int sig = signals_.first_signal();
  transition(AgentEvent::kInterrupted);
  return {128 + sig, fmt::format("interrupted by {}; stopped {} worker{}", signal_name(sig), workers,
                                 workers == 1 ? "" : "s")};
}

AgentResult Agent::coordinator_lost(const std::string& why, size_t workers) {
  transition(AgentEvent::kInterrupted);
  return {1, fmt::format("{} in generation {}; stopped {} worker{}: the job cannot go on without its "
                         "coordinator (run it again to resume from its last checkpoint)",
                         why, generation_, workers, workers == 1 ? "" : "s")};
}

AgentResult Agent::cannot_start(const std::string& why) {
  try {
    control_.report_failure(options_.job_id, generation_, joined_.rank_offset, why, /*give_up=*/true);
  } catch (const Error& e) {
    log::warn(log::Subsys::kLaunch, "could not report the failure to the coordinator: {}", e.what());
  }
  account_.reset();
  transition(AgentEvent::kWorkerUsageError);
  return {2, why};
}

AgentResult Agent::run() {
  while (true) {
    if (state_ == AgentState::kJoining) {
      if (signals_.first_signal()) return interrupted(0);
      if (!join()) return lost_.empty() ? interrupted(0) : coordinator_lost(lost_, 0);
      AgentResult r = supervise();
      if (state_ != AgentState::kRestarting) return r;
      ++restarts_used_;
      transition(AgentEvent::kRestarted);
    }
  }
}

void Agent::stop_workers(WorkerGroup& group, std::unique_ptr<Heartbeat>& heartbeat, int sig) {
  heartbeat.reset();
  group.stop(sig, options_.grace_period, [this] { return signals_.count() >= 2; });
  pump_.drain(Deadline::after(kDrainTimeout));
}

// A usage error is the command's, so the other workers of the command usually meet it too, a
// moment later: they were started together and make the same checks, but one reaches them first
// (on a loaded host the start-up up to the fabric's checks takes about a second). A SIGTERM at
// once would cut the others off before they print their own line; so they get up to
// kUsageErrorWindow (never more than --grace-period) to exit by themselves, and only those still
// running then are stopped. A signal to trnrun ends the wait at once. Their exits are not
// reported: the first usage error is the job's.
void Agent::await_usage_errors(WorkerGroup& group) {
  const Deadline deadline = Deadline::after(std::min<Duration>(kUsageErrorWindow, options_.grace_period));
  while (group.running() > 0 && !deadline.expired() && signals_.first_signal() == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    for (const auto& e : group.reap()) {
      log::debug(log::Subsys::kLaunch, "rank {} (pid {}) {}", e.rank, e.pid, e.describe());
      if (relay_) relay_->exited(e.rank);
    }
  }
}

// Tells the relay which process runs each rank and since when, so that a worker silent since
// then is reported as such (HeartbeatRelay::take).
void Agent::name_processes(const WorkerGroup& group) {
  if (!relay_) return;
  for (const auto& w : group.workers())
    if (w.running) relay_->started(w.rank, w.pid, w.started);
}

AgentResult Agent::supervise() {
  generation_moved_ = false;
  stopped_by_user_ = false;
  unreachable_ = false;
  if (relay_) relay_->expect(generation_, joined_.rank_offset, options_.nproc_per_node);
  auto specs =
      plan_workers(options_, joined_, coordinator_, relay_ ? relay_->socket_path() : "", job_token_file());
  std::unique_ptr<WorkerGroup> group;
  try {
    group = std::make_unique<WorkerGroup>(specs, pump_);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kUsage) throw;
    return cannot_start(e.what());
  }
  name_processes(*group);
  transition(AgentEvent::kJoined);
  const size_t started = specs.size();
  auto heartbeat = std::make_unique<Heartbeat>(*this, generation_, joined_.node_rank);
  auto tell_coordinator = [&](int rank, const std::string& reason, bool give_up) {
    try {
      control_.report_failure(options_.job_id, generation_, rank, reason, give_up);
    } catch (const Error& e) {
      log::warn(log::Subsys::kLaunch, "could not report the failure to the coordinator: {}", e.what());
    }
  };

  while (true) {
    signals_.wait(options_.monitor_interval);
    if (int sig = signals_.first_signal()) {
      log::info(log::Subsys::kLaunch, "received {}; forwarding it to {} workers", signal_name(sig), group->running());
      // A user stop, not a failure: said before the workers go (so that peers failing for lack
      // of them are not taken for the cause), on its own thread (an unreachable coordinator
      // never delays stopping them).
      auto told = std::async(std::launch::async, [&, reason = fmt::format("node {} interrupted by {}",
                                                                          joined_.node_rank, signal_name(sig))] {
        try {
          control_.report_stop(options_.job_id, generation_, joined_.rank_offset, reason);
        } catch (const Error& e) {
          log::warn(log::Subsys::kLaunch, "could not tell the coordinator that the job was stopped: {}", e.what());
        }
      });
      stop_workers(*group, heartbeat, sig);
      told.wait();
      return interrupted(started);
    }
    if (std::string why = gone(); !why.empty()) {
      stop_workers(*group, heartbeat, SIGTERM);
      return coordinator_lost(why, started);
    }
    std::vector<WorkerExit> exits = group->reap();
    for (const auto& e : exits) {
      log::debug(log::Subsys::kLaunch, "rank {} (pid {}) {}", e.rank, e.pid, e.describe());
      if (relay_) relay_->exited(e.rank);
    }
    try {
      settle_recovery(*group, exits);
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kUsage) throw;
      stop_workers(*group, heartbeat, SIGTERM);
      return cannot_start(e.what());
    }
    // Every failure of the batch is named (workers killed together are reaped together); the
    // first is the one the coordinator is told of, a usage error (exit 2) first of all, since a
    // restart would fail the same way.
    std::vector<WorkerExit> failed;
    for (const auto& e : exits)
      if (e.failed()) failed.push_back(e);
    auto usage_error_exit = [](const WorkerExit& e) { return e.signal == 0 && e.exit_code == 2; };
    std::stable_partition(failed.begin(), failed.end(), usage_error_exit);
    if (!failed.empty()) {
      settle_recovery(*group, exits, /*force=*/true);
      const WorkerExit* failure = &failed.front();
      std::string reason = describe_failures(failed);
      bool usage = usage_error_exit(*failure);
      AgentEvent event = usage ? AgentEvent::kWorkerUsageError : AgentEvent::kWorkerFailed;
      bool last = usage || restarts_used_ >= options_.max_restarts;
      tell_coordinator(failure->rank, reason, last);
      if (!last && in_place()) {
        // The report ended the generation; the survivors hear it from here at once rather than
        // from their collectives timing out, and are kept.
        relay_->tell_abort(fmt::format("generation {} ended: {}", generation_, reason), generation_ + 1);
        transition(event);
        if (auto end = recover_in_place(group, heartbeat, reason)) return *end;
        continue;
      }
      if (usage) await_usage_errors(*group);
      stop_workers(*group, heartbeat, SIGTERM);
      transition(event);
      if (usage)
        return {2, fmt::format("{} in generation {}: a usage error, so the workers are not restarted; fix the "
                               "command",
                               reason, generation_)};
      if (state_ == AgentState::kRestarting) {
        log::warn(log::Subsys::kLaunch, "{}; restarting the workers in a new generation (restart {} of {})",
                  reason, restarts_used_ + 1, options_.max_restarts);
        return {};
      }
      return {failure->status(), fmt::format("{} in generation {}; no restarts left (--max-restarts {})", reason,
                                             generation_, options_.max_restarts)};
    }
    if (group->running() == 0) {
      settle_recovery(*group, exits, /*force=*/true);
      heartbeat.reset();
      pump_.drain(Deadline::after(kDrainTimeout));
      try {
        control_.finish(options_.job_id, generation_, joined_.node_rank);
      } catch (const Error& e) {
        log::warn(log::Subsys::kLaunch, "could not tell the coordinator that the job finished: {}", e.what());
      }
      transition(AgentEvent::kAllSucceeded);
      log::info(log::Subsys::kLaunch, "all {} workers exited 0", started);
      return {};
    }
    if (generation_moved_) {
      settle_recovery(*group, exits, /*force=*/true);
      std::string reason;
      {
        std::lock_guard lock(moved_mu_);
        reason = moved_reason_;
      }
      if (!stopped_by_user_ && !unreachable_ && in_place() && restarts_used_ < options_.max_restarts) {
        // The heartbeat thread already told the workers to abort.
        transition(AgentEvent::kGenerationMoved);
        if (auto end = recover_in_place(group, heartbeat, fmt::format("the job moved on ({})", reason))) return *end;
        continue;
      }
      stop_workers(*group, heartbeat, SIGTERM);
      if (stopped_by_user_) {
        transition(AgentEvent::kInterrupted);
        return {1, fmt::format("{}; stopped {} worker{} on this node too", reason, started, started == 1 ? "" : "s")};
      }
      transition(AgentEvent::kGenerationMoved, unreachable_ ? std::optional(Recovery::kRestart) : std::nullopt);
      if (state_ == AgentState::kRestarting) {
        log::warn(log::Subsys::kLaunch, "{}; restarting the workers (restart {} of {})",
                  unreachable_ ? reason : fmt::format("the job moved on ({})", reason), restarts_used_ + 1,
                  options_.max_restarts);
        return {};
      }
      return {1, fmt::format("the job moved on without this node ({}); no restarts left (--max-restarts {})",
                             reason, options_.max_restarts)};
    }
  }
}

std::optional<AgentResult> Agent::recover_in_place(std::unique_ptr<WorkerGroup>& group,
                                                   std::unique_ptr<Heartbeat>& heartbeat, const std::string& cause) {
  const auto detected = Clock::now();
  const size_t started = static_cast<size_t>(options_.nproc_per_node);
  auto seconds = [](Duration d) { return std::chrono::duration<double>(d).count(); };
  // The ended generation's node heartbeats stop; the relay goes on hearing the workers, which
  // heartbeat in the old generation until they resume.
  heartbeat.reset();
  const int restart = restarts_used_ + 1;
  log::info(log::Subsys::kLaunch, "{}; recovering in place (restart {} of {}): re-joining, {} worker{} still running",
            cause, restart, options_.max_restarts, group->running(), group->running() == 1 ? "" : "s");

  // A worker that is not heartbeating (stopped, hung, or its heartbeat thread dead) could not
  // hear the resume, and would make the next generation wait for it until the coordinator's
  // heartbeat timeout: it is killed and started anew like a dead one.
  const Duration hung_after = hung_worker_silence(settings::get_seconds("TRN_HEARTBEAT_INTERVAL"));
  for (const auto& w : group->workers()) {
    if (!w.running) continue;
    Duration quiet = detected - w.started;
    if (auto silent = relay_->silent_for(w.rank)) quiet = std::min(quiet, *silent);
    if (quiet <= hung_after) continue;
    log::warn(log::Subsys::kLaunch,
              "rank {} (local rank {}, pid {}) has not heartbeated for {:.1f} s (more than {:.1f} s): it cannot "
              "recover in place, so it is killed (SIGKILL) and started anew",
              w.rank, w.local_rank, w.pid, seconds(quiet), seconds(hung_after));
    group->kill(w.local_rank);
  }

  ++restarts_used_;
  const control::JoinResult before = joined_;
  try {
    if (!join()) {
      int sig = signals_.first_signal();
      stop_workers(*group, heartbeat, sig ? sig : SIGTERM);
      return lost_.empty() ? interrupted(started) : coordinator_lost(lost_, started);
    }
  } catch (const Error&) {
    stop_workers(*group, heartbeat, SIGTERM);
    throw;
  }
  const auto rejoined = Clock::now();
  generation_moved_ = false;
  stopped_by_user_ = false;
  unreachable_ = false;
  const std::string socket = relay_->socket_path();

  const bool moved = joined_.rank_offset != before.rank_offset || joined_.world_size != before.world_size ||
                     joined_.node_rank != before.node_rank;
  if (moved) {
    // An elastic job's new generation has other nodes: the survivors go on in place with the
    // ranks of this node's new place (their resume says which), and the model's data-parallel
    // size follows the world; a worker that cannot take the new layout exits and is replaced.
    log::warn(log::Subsys::kLaunch,
              "after re-joining, this node is node {} with ranks {}..{} of {} (was node {}, ranks {}..{} of {}): its "
              "workers go on in place with the new ranks",
              joined_.node_rank, joined_.rank_offset, joined_.rank_offset + options_.nproc_per_node - 1,
              joined_.world_size, before.node_rank, before.rank_offset,
              before.rank_offset + options_.nproc_per_node - 1, before.world_size);
    group->renumber(joined_.rank_offset);
  }

  relay_->expect(generation_, joined_.rank_offset, options_.nproc_per_node);
  // Workers that ended while the node re-joined belong to no generation: they start anew in this
  // one with the dead, using no further restart; unless one made a usage error.
  for (const auto& e : group->reap()) {
    relay_->exited(e.rank);
    if (e.signal == 0 && e.exit_code == 2) {
      std::string reason = fmt::format("rank {} (local rank {}, pid {}) {}", e.rank, e.local_rank, e.pid,
                                       e.describe());
      try {
        control_.report_failure(options_.job_id, generation_, e.rank, reason, /*give_up=*/true);
      } catch (const Error& err) {
        log::warn(log::Subsys::kLaunch, "could not report the failure to the coordinator: {}", err.what());
      }
      stop_workers(*group, heartbeat, SIGTERM);
      transition(AgentEvent::kWorkerUsageError);
      return AgentResult{2, fmt::format("{} in generation {}: a usage error, so the workers are not restarted; "
                                        "fix the command",
                                        reason, generation_)};
    }
    log::warn(log::Subsys::kLaunch, "rank {} (local rank {}, pid {}) {} while this node re-joined; it starts anew",
              e.rank, e.local_rank, e.pid, e.describe());
  }

  std::vector<int> survivors;
  std::vector<int> dead;  // local ranks
  for (const auto& w : group->workers()) {
    if (w.running) survivors.push_back(w.rank);
    else dead.push_back(w.local_rank);
  }
  relay_->tell_resume(generation_, survivors, joined_.world_size, joined_.node_rank);
  auto specs = plan_workers(options_, joined_, coordinator_, socket, job_token_file());
  for (int local : dead) {
    try {
      group->replace(specs.at(static_cast<size_t>(local)));
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kUsage) throw;
      stop_workers(*group, heartbeat, SIGTERM);
      return cannot_start(e.what());
    }
  }
  name_processes(*group);
  transition(AgentEvent::kJoined);
  heartbeat = std::make_unique<Heartbeat>(*this, generation_, joined_.node_rank);
  // The account waits for the survivors to resume: one killed with the others may not have
  // been reaped yet (a large process takes a while to die), and it is replaced, not kept.
  account_ = std::make_unique<RecoveryAccount>();
  account_->cause = cause;
  account_->restart = restart;
  account_->kept = std::set<int>(survivors.begin(), survivors.end());
  account_->replaced = dead.size();
  account_->detected = detected;
  account_->rejoined = rejoined;
  account_->replaced_at = Clock::now();
  account_->settle_by = Clock::now() + hung_after;
  account_->specs = std::move(specs);
  std::vector<WorkerExit> none;
  settle_recovery(*group, none);
  return std::nullopt;
}

void Agent::settle_recovery(WorkerGroup& group, std::vector<WorkerExit>& exits, bool force) {
  if (!account_) return;
  RecoveryAccount& a = *account_;
  auto resumed = [pending = relay_->resume_pending()](int rank) {
    return std::find(pending.begin(), pending.end(), rank) == pending.end();
  };
  bool replaced = false;
  for (auto it = exits.begin(); it != exits.end();) {
    const WorkerExit& e = *it;
    // A usage error (exit 2) ends the job as ever; exit 0 is no death.
    const bool usage = e.signal == 0 && e.exit_code == 2;
    if (!e.failed() || usage || !a.kept.count(e.rank) || resumed(e.rank)) {
      ++it;
      continue;
    }
    log::warn(log::Subsys::kLaunch,
              "rank {} (local rank {}, pid {}) {} before it resumed in generation {}: it took no part in it, so it "
              "starts anew in it (no further restart)",
              e.rank, e.local_rank, e.pid, e.describe(), generation_);
    a.kept.erase(e.rank);
    group.replace(a.specs.at(static_cast<size_t>(e.local_rank)));
    ++a.replaced;
    a.replaced_at = Clock::now();
    replaced = true;
    it = exits.erase(it);
  }
  if (replaced) name_processes(group);
  const bool all_resumed = std::all_of(a.kept.begin(), a.kept.end(), resumed);
  if (!force && !all_resumed && Clock::now() < a.settle_by) return;
  auto seconds = [](Duration d) { return std::chrono::duration<double>(d).count(); };
  const size_t kept = a.kept.size();
  log::warn(log::Subsys::kLaunch,
            "{}; recovering in place in generation {}: {} worker{} keep{} running, {} restarted (restart {} of {}); "
            "re-joined {:.3f} s after the failure was detected{}",
            a.cause, generation_, kept, kept == 1 ? "" : "s", kept == 1 ? "s" : "", a.replaced, a.restart,
            options_.max_restarts, seconds(a.rejoined - a.detected),
            a.replaced == 0 ? std::string()
                            : fmt::format(", replacement{} started after {:.3f} s", a.replaced == 1 ? "" : "s",
                                          seconds(a.replaced_at - a.detected)));
  account_.reset();
}

}  // namespace trn::launch
