#include "runtime/dist/world.h"

#include <algorithm>
#include <cstdlib>

#include "collectives/bootstrap/file_store.h"
#include "collectives/bootstrap/mpi_bootstrap.h"
#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "collectives/core/settings.h"
#include "collectives/fabric/fabric.h"
#include "launcher/client/agent_channel.h"
#include "launcher/client/coordinator_client.h"

namespace trn::dist {

bool recoverable(const Error& e) {
  return e.kind() == ErrorKind::kRemote || e.kind() == ErrorKind::kTimeout || e.kind() == ErrorKind::kAborted;
}

std::unique_ptr<World> World::from_environment() {
  std::unique_ptr<World> w(new World());
  w->id_ = launch::identity_from_environment();
  const auto& id = w->id_;
  log::set_rank(id.rank);
  log::set_generation(id.generation);

  if (!id.coordinator.empty()) {
    w->client_ = std::make_unique<control::CoordinatorClient>(control::options_from_environment());
    w->store_ = w->client_->store(id.job_id, id.generation);
    w->bootstrap_ = "coordinator " + id.coordinator;
  } else if (id.source == launch::IdentitySource::kOpenMpi || mpi::launched_by_mpirun()) {
    w->mpi_ = std::make_unique<mpi::Bootstrap>();
    if (w->mpi_->rank() != id.rank || w->mpi_->size() != id.world_size)
      throw usage_error("MPI says rank {} of {}, the environment says rank {} of {}; unset TRN_RANK "
                        "and TRN_WORLD_SIZE when launching with mpirun",
                        w->mpi_->rank(), w->mpi_->size(), id.rank, id.world_size);
    w->bootstrap_ = "mpirun";
  } else if (id.world_size > 1) {
    if (!settings::is_set("TRN_STORE_DIR"))
      throw usage_error("rank {} of {} has no way to find its peers: launch with trnrun (or mpirun), "
                        "or set TRN_STORE_DIR to a directory every rank can see",
                        id.rank, id.world_size);
    w->store_ = FileStore::from_environment();
    w->bootstrap_ = "store dir " + settings::get("TRN_STORE_DIR");
  } else {
    w->bootstrap_ = "single process";
  }

  if (w->client_) {
    // The heartbeat starts before the fabric connects: a long connect is still a live worker,
    // and an in-place worker hears its resume even when its first generation ends meanwhile.
    const char* recovery = std::getenv("TRN_RECOVERY");
    const char* agent = std::getenv(control::kAgentSocketEnv);
    w->in_place_ = recovery && std::string(recovery) == "in-place" && agent && *agent;
    World* self = w.get();
    std::function<void(const control::Resume&)> resume;
    if (w->in_place_) resume = [self](const control::Resume& r) { self->on_resume(r); };
    w->heartbeat_ = std::make_unique<control::Heartbeater>(
        *w->client_, id.job_id, id.generation, id.rank,
        [self](const std::string& reason) {
          log::warn(log::Subsys::kCoord, "coordinator says stop: {}", reason);
          self->told_to_stop_ = true;
          self->abort("job generation moved on: " + reason);
        },
        resume);
  }
  try {
    w->connect();
  } catch (const Error& e) {
    if (!w->in_place_ || !recoverable(e)) throw;
    log::warn(log::Subsys::kInit, "generation {} ended while connecting ({}); waiting for the next one",
              w->id_.generation, e.what());
    w->rejoin();
  }
  return w;
}

void World::connect() {
  const auto& id = id_;
  if (id.world_size <= 1) return;
  fabric::Options fo = fabric::Options::from_environment();
  fo.prefix = "fabric/g" + std::to_string(id.generation);
  auto transport = mpi_ ? mpi_->connect(fo) : fabric::connect(*store_, id.rank, id.world_size, fo);
  auto comm = std::make_shared<Communicator>(transport);
  {
    std::lock_guard lock(mu_);
    transport_ = std::move(transport);
    comm_ = std::move(comm);
  }
  log::info(log::Subsys::kInit, "rank {} of {} (node {}, local rank {}) connected via {} over {}", id.rank,
            id.world_size, id.node_rank, id.local_rank, bootstrap_, transport_->describe());
}

void World::abort(const std::string& reason) {
  std::shared_ptr<Communicator> c;
  {
    std::lock_guard lock(mu_);
    c = comm_;
  }
  if (c && !c->aborted()) c->abort(reason);
}

void World::on_resume(const control::Resume& r) {
  {
    std::lock_guard lock(mu_);
    if (r.generation > resumed_.generation) resumed_ = r;
  }
  resumed_cv_.notify_all();
}

void World::rejoin() {
  if (!in_place_) throw internal_error("rejoin() without in-place recovery");
  while (true) {
    next_generation();
    try {
      connect();
      return;
    } catch (const Error& e) {
      // The generation ended again before every rank connected (another failure): the next one.
      if (!recoverable(e)) throw;
      log::warn(log::Subsys::kInit, "generation {} ended while connecting ({}); waiting for the next one",
                id_.generation, e.what());
    }
  }
}

void World::next_generation() {
  const Duration timeout = settings::get_seconds("TRN_TIMEOUT");
  control::Resume next;
  {
    std::unique_lock lock(mu_);
    if (!resumed_cv_.wait_for(lock, timeout, [&] { return resumed_.generation > id_.generation; }))
      throw remote_error("rank {}: no word from the trnrun agent of a new generation within {:.0f} s (TRN_TIMEOUT) "
                         "after generation {} failed",
                         id_.rank, std::chrono::duration<double>(timeout).count(), id_.generation);
    next = resumed_;
  }
  const int64_t generation = next.generation;
  abort("recovering in generation " + std::to_string(generation));
  {
    // The old generation's fabric goes before the new one's is built (its endpoint, its threads).
    std::lock_guard lock(mu_);
    if (comm_ && comm_.use_count() > 1)
      log::warn(log::Subsys::kInit, "generation {}'s world communicator is still referenced while recovering",
                id_.generation);
    comm_.reset();
    transport_.reset();
  }
  store_.reset();
  id_.generation = generation;
  if (next.world_size > 0 && (next.rank != id_.rank || next.world_size != id_.world_size)) {
    log::warn(log::Subsys::kInit, "rank {} of {} goes on as rank {} of {} (node {}) in generation {}", id_.rank,
              id_.world_size, next.rank, next.world_size, next.node_rank, generation);
    id_.rank = next.rank;
    id_.world_size = next.world_size;
    id_.node_rank = next.node_rank;
    log::set_rank(id_.rank);
  }
  told_to_stop_ = false;
  log::set_generation(generation);
  heartbeat_->set_generation(generation, id_.rank);
  store_ = client_->store(id_.job_id, generation);
}

World::~World() = default;

void World::report_shard(int64_t step, const std::string& path, uint64_t bytes) {
  if (!client_) return;
  try {
    control::ShardReport r;
    r.step = step;
    r.rank = id_.rank;
    r.path = path;
    r.bytes = bytes;
    client_->report_shard(id_.job_id, id_.generation, r);
  } catch (const std::exception& e) {
    log::warn(log::Subsys::kTrain, "could not report checkpoint step {} to the coordinator: {}", step, e.what());
  }
}

void World::set_coordinates(int dp_rank, int tp_rank, int pp_rank) {
  if (heartbeat_) heartbeat_->set_coordinates(dp_rank, tp_rank, pp_rank);
}

void World::report_progress(int64_t step, double loss, double tokens_per_s) {
  if (heartbeat_) heartbeat_->update(step, loss, tokens_per_s);
}

void World::report_recovery(const control::RecoveryReport& report) {
  if (heartbeat_) heartbeat_->set_recovery(report);
}

void World::report_validation(double val_loss) {
  if (heartbeat_) heartbeat_->set_val_loss(val_loss);
}

void World::report_moe(const control::MoeReport& report) {
  if (!heartbeat_) return;
  if (id_.rank != 0) {
    heartbeat_->set_moe(std::nullopt);  // a rank renumbered away from 0 stops sending its figures
    return;
  }
  static bool warned = false;
  if (report.max_mean.size() > control::kMaxMoeLayers && !warned) {
    log::warn(log::Subsys::kCoord, "the model has {} MoE layers; the coordinator gets the first {} (/metrics)",
              report.max_mean.size(), control::kMaxMoeLayers);
    warned = true;
  }
  heartbeat_->set_moe(report);  // moe_to_proto sends the first kMaxMoeLayers
}

void World::report_failure(const std::string& reason) {
  if (!client_) return;
  try {
    // A failing worker is often one cut off from the coordinator as well as its peers: it gives
    // up after 10 s rather than the client's 30, and exits; its trnrun reports the exit too.
    client_->report_failure(id_.job_id, id_.generation, id_.rank, reason, false, std::chrono::seconds(10));
  } catch (const std::exception& e) {
    log::warn(log::Subsys::kCoord, "could not report the failure to the coordinator: {}", e.what());
  }
}

}  // namespace trn::dist
