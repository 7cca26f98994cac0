#include "runtime/dist/world.h"

#include "collectives/bootstrap/file_store.h"
#include "collectives/bootstrap/mpi_bootstrap.h"
#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "collectives/core/settings.h"
#include "collectives/fabric/fabric.h"
#include "launcher/client/coordinator_client.h"

namespace trn::dist {

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

  if (id.world_size > 1) {
    fabric::Options fo = fabric::Options::from_environment();
    w->transport_ = w->mpi_ ? w->mpi_->connect(fo) : fabric::connect(*w->store_, id.rank, id.world_size, fo);
    w->comm_ = std::make_shared<Communicator>(w->transport_);
    log::info(log::Subsys::kInit, "rank {} of {} (node {}, local rank {}) connected via {} over {}", id.rank,
              id.world_size, id.node_rank, id.local_rank, w->bootstrap_, w->transport_->describe());
  }

  if (w->client_) {
    std::weak_ptr<Communicator> comm = w->comm_;
    w->heartbeat_ = std::make_unique<control::Heartbeater>(
        *w->client_, id.job_id, id.generation, id.rank, [comm](const std::string& reason) {
          log::warn(log::Subsys::kCoord, "coordinator says stop: {}", reason);
          if (auto c = comm.lock()) c->abort("job generation moved on: " + reason);
        });
  }
  return w;
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

void World::report_validation(double val_loss) {
  if (heartbeat_) heartbeat_->set_val_loss(val_loss);
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
