// Heartbeater: a worker's background heartbeat thread.
#include <unistd.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "collectives/core/settings.h"
#include "launcher/client/coordinator_client.h"

namespace trn::control {

struct Heartbeater::State {
  CoordinatorClient* client = nullptr;
  std::string job_id;
  int64_t generation = 0;
  std::function<void(const std::string&)> on_abort;
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  WorkerProgress progress;
  std::thread thread;

  void run() {
    Duration interval = settings::get_seconds("TRN_HEARTBEAT_INTERVAL");
    if (interval <= Duration::zero()) interval = std::chrono::seconds(1);
    Duration give_up = default_timeout();
    auto last_ok = Clock::now();
    std::unique_lock lock(mu);
    while (!stop) {
      WorkerProgress p = progress;
      lock.unlock();
      std::string abort_reason;
      try {
        // One try per interval (retries inside, bounded): a slow coordinator delays, never stops, us.
        auto r = client->heartbeat(job_id, generation, p);
        last_ok = Clock::now();
        if (r.abort) abort_reason = r.reason.empty() ? "the job's generation moved on" : r.reason;
      } catch (const Error& e) {
        if (e.kind() == ErrorKind::kUsage) abort_reason = e.what();
        else if (Clock::now() - last_ok > give_up)
          abort_reason = fmt::format("coordinator unreachable for {:.0f} s: {}",
                                     std::chrono::duration<double>(Clock::now() - last_ok).count(), e.what());
        else
          log::warn(log::Subsys::kCoord, "heartbeat failed (will retry): {}", e.what());
      }
      if (!abort_reason.empty()) {
        log::warn(log::Subsys::kCoord, "heartbeat: abort: {}", abort_reason);
        on_abort(abort_reason);
        return;
      }
      lock.lock();
      cv.wait_for(lock, interval, [&] { return stop; });
    }
  }
};

Heartbeater::Heartbeater(CoordinatorClient& client, std::string job_id, int64_t generation, int rank,
                         std::function<void(const std::string&)> on_abort)
    : state_(std::make_shared<State>()) {
  state_->client = &client;
  state_->job_id = std::move(job_id);
  state_->generation = generation;
  state_->on_abort = std::move(on_abort);
  state_->progress.rank = rank;
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  state_->progress.host = host;
  state_->progress.pid = getpid();
  state_->thread = std::thread([s = state_] { s->run(); });
}

Heartbeater::~Heartbeater() {
  {
    std::lock_guard lock(state_->mu);
    state_->stop = true;
  }
  state_->cv.notify_all();
  if (state_->thread.joinable()) state_->thread.join();
}

void Heartbeater::update(int64_t step, double loss, double tokens_per_s) {
  std::lock_guard lock(state_->mu);
  state_->progress.step = step;
  state_->progress.loss = loss;
  state_->progress.tokens_per_s = tokens_per_s;
}

void Heartbeater::set_coordinates(int dp_rank, int tp_rank, int pp_rank) {
  std::lock_guard lock(state_->mu);
  state_->progress.coordinates = GridCoordinates{dp_rank, tp_rank, pp_rank};
}

}  // namespace trn::control
