// Heartbeater: a worker's background heartbeat thread, to its trnrun agent or to the coordinator.
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "collectives/core/settings.h"
#include "launcher/client/agent_channel.h"
#include "launcher/client/coordinator_client.h"

namespace trn::control {

struct Heartbeater::State {
  CoordinatorClient* client = nullptr;
  std::string job_id;
  int64_t generation = 0;
  std::function<void(const std::string&)> on_abort;
  std::function<void(const Resume&)> on_resume;  // empty: the first abort ends the thread
  int64_t aborted_generation = -1;         // heartbeat thread only: the generation on_abort was called for
  std::mutex mu;
  bool stop = false;  // guarded by mu; wake_fd is written once it is set
  WorkerProgress progress;
  int wake_fd = -1;
  std::unique_ptr<AgentChannel> agent;  // null: heartbeat the coordinator directly (heartbeat thread only)
  std::atomic<bool> via_agent{false};
  std::thread thread;

  int64_t current_generation() {
    std::lock_guard lock(mu);
    return generation;
  }

  // Heartbeats straight to the coordinator; returns the abort reason, or "" to go on.
  std::string direct(const WorkerProgress& p, Clock::time_point& last_ok) {
    try {
      // One try per interval (retries inside, bounded): a slow coordinator delays, never stops, us.
      auto r = client->heartbeat(job_id, current_generation(), p);
      last_ok = Clock::now();
      if (r.abort) return r.reason.empty() ? "the job's generation moved on" : r.reason;
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::kUsage) return e.what();
      if (Clock::now() - last_ok > default_timeout())
        return fmt::format("coordinator unreachable for {:.0f} s: {}",
                           std::chrono::duration<double>(Clock::now() - last_ok).count(), e.what());
      log::warn(log::Subsys::kCoord, "heartbeat failed (will retry): {}", e.what());
    }
    return "";
  }

  // Hands the heartbeat to the agent; when the agent is gone, switches to the direct path.
  void to_agent(const WorkerProgress& p) {
    switch (agent->send(job_id, current_generation(), p)) {
      case AgentChannel::Sent::kOk: return;
      case AgentChannel::Sent::kBusy:
        log::debug(log::Subsys::kCoord, "trnrun agent busy; heartbeat of step {} dropped", p.step);
        return;
      case AgentChannel::Sent::kGone:
        log::warn(log::Subsys::kCoord, "trnrun agent socket {} unreachable ({}); heartbeating the coordinator directly",
                  agent->path(), agent->error());
        agent.reset();
        via_agent = false;
        return;
    }
  }

  // Waits out the interval; returns false when told to stop, and sets abort_reason when the agent
  // said abort.
  bool wait(Duration interval, std::string& abort_reason) {
    auto until = Clock::now() + interval;
    while (true) {
      pollfd fds[2] = {{wake_fd, POLLIN, 0}, {agent ? agent->fd() : -1, POLLIN, 0}};
      auto left = std::chrono::ceil<std::chrono::milliseconds>(until - Clock::now()).count();
      int n = ::poll(fds, 2, static_cast<int>(std::max<int64_t>(0, left)));
      if (n < 0 && errno != EINTR) throw internal_error("heartbeat poll failed: {}", std::strerror(errno));
      if (n > 0 && fds[0].revents) {
        std::lock_guard lock(mu);
        if (stop) return false;
      }
      if (n > 0 && agent && fds[1].revents) {
        auto reason = agent->receive();
        if (auto r = agent->take_resume(); r && on_resume && r->generation > current_generation()) on_resume(*r);
        if (reason) {
          abort_reason = *reason;
          return true;
        }
      }
      if (Clock::now() >= until) return true;
    }
  }

  void run() {
    Duration interval = settings::get_seconds("TRN_HEARTBEAT_INTERVAL");
    if (interval <= Duration::zero()) interval = std::chrono::seconds(1);
    auto last_ok = Clock::now();
    while (true) {
      WorkerProgress p;
      {
        std::lock_guard lock(mu);
        if (stop) return;
        p = progress;
      }
      std::string abort_reason;
      if (agent) to_agent(p);
      if (!agent) abort_reason = direct(p, last_ok);
      if (abort_reason.empty() && !wait(interval, abort_reason)) return;
      if (!abort_reason.empty()) {
        const int64_t g = current_generation();
        if (aborted_generation != g) {  // once per generation
          log::warn(log::Subsys::kCoord, "heartbeat: abort: {}", abort_reason);
          on_abort(abort_reason);
          if (!on_resume) return;
          aborted_generation = g;
        }
        // In-place recovery: heartbeats go on (the agent ignores those of the ended generation)
        // while the worker waits for its resume.
        std::string again;
        if (!wait(interval, again)) return;
      }
    }
  }
};

Heartbeater::Heartbeater(CoordinatorClient& client, std::string job_id, int64_t generation, int rank,
                         std::function<void(const std::string&)> on_abort,
                         std::function<void(const Resume&)> on_resume)
    : state_(std::make_shared<State>()) {
  state_->client = &client;
  state_->job_id = std::move(job_id);
  state_->generation = generation;
  state_->on_abort = std::move(on_abort);
  state_->on_resume = std::move(on_resume);
  state_->progress.rank = rank;
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  state_->progress.host = host;
  state_->progress.pid = getpid();
  state_->wake_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (state_->wake_fd < 0) throw internal_error("eventfd for the heartbeat thread: {}", std::strerror(errno));
  if (const char* path = std::getenv(kAgentSocketEnv); path && *path) {
    try {
      state_->agent = std::make_unique<AgentChannel>(path);
      state_->via_agent = true;
      log::debug(log::Subsys::kCoord, "heartbeats go to the trnrun agent at {}", path);
    } catch (const Error& e) {
      log::warn(log::Subsys::kCoord, "{}; heartbeating the coordinator directly", e.what());
    }
  }
  state_->thread = std::thread([s = state_] { s->run(); });
}

Heartbeater::~Heartbeater() {
  {
    std::lock_guard lock(state_->mu);
    state_->stop = true;
  }
  uint64_t one = 1;
  (void)!::write(state_->wake_fd, &one, sizeof one);
  if (state_->thread.joinable()) state_->thread.join();
  ::close(state_->wake_fd);
}

void Heartbeater::set_generation(int64_t generation, int rank) {
  std::lock_guard lock(state_->mu);
  state_->generation = generation;
  state_->progress.rank = rank;
}

void Heartbeater::update(int64_t step, double loss, double tokens_per_s) {
  std::lock_guard lock(state_->mu);
  state_->progress.step = step;
  state_->progress.loss = loss;
  state_->progress.tokens_per_s = tokens_per_s;
}

void Heartbeater::set_val_loss(double val_loss) {
  std::lock_guard lock(state_->mu);
  state_->progress.val_loss = val_loss;
}

void Heartbeater::set_recovery(const RecoveryReport& r) {
  std::lock_guard lock(state_->mu);
  state_->progress.recovery = r;
}

void Heartbeater::set_moe(std::optional<MoeReport> r) {
  std::lock_guard lock(state_->mu);
  state_->progress.moe = std::move(r);
}

void Heartbeater::set_coordinates(int dp_rank, int tp_rank, int pp_rank) {
  std::lock_guard lock(state_->mu);
  state_->progress.coordinates = GridCoordinates{dp_rank, tp_rank, pp_rank};
}

bool Heartbeater::via_agent() const { return state_->via_agent; }

}  // namespace trn::control
