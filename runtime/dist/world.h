// A worker's place in a distributed job: who it is (trnrun, mpirun, srun or a lone process),
// the bootstrap store it met the others through, the fabric and the world communicator, and,
// under trnrun, its coordinator connection with a heartbeat.
//
//   auto world = trn::dist::World::from_environment();
//   world->comm()->all_reduce(...);                 // null when the world has one rank
//   world->report_progress(step, loss, tokens_per_s);
//
// Bootstrap, by what the environment offers: TRN_COORDINATOR (the coordinator's per-job,
// per-generation store), else an MPI launcher (addresses exchanged by MPI_Allgather), else
// TRN_STORE_DIR (a shared directory). When the coordinator's heartbeat reply says the job's
// generation moved on, the world communicator is aborted: every pending and later collective
// fails at once, the worker exits non-zero and trnrun restarts it in the new generation.
//
// In-place recovery (trnrun --recovery in-place sets TRN_RECOVERY=in-place): the worker does not
// exit. After a failure it calls rejoin(), which waits for its agent's word that the node joined
// the next generation (the resume datagram, agent_channel.h), then tears down this generation's
// fabric and builds the next one's in this process, with the same rank.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "collectives/bootstrap/store.h"
#include "collectives/core/error.h"
#include "collectives/communicator.h"
#include "launcher/agent/worker_env.h"
#include "launcher/client/coordinator_client.h"

namespace trn::mpi {
class Bootstrap;
}
namespace trn::control {
class CoordinatorClient;
class Heartbeater;
}  // namespace trn::control

namespace trn::dist {

// A failure of the generation rather than of this worker: a peer lost, a deadline, an abort.
bool recoverable(const Error& e);

class World {
 public:
  static std::unique_ptr<World> from_environment();
  ~World();
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  const launch::WorkerIdentity& identity() const { return id_; }
  int rank() const { return id_.rank; }
  int size() const { return id_.world_size; }
  // "coordinator HOST:PORT", "mpirun", "store dir D" or "single process".
  const std::string& bootstrap() const { return bootstrap_; }

  // The world communicator; null when size() == 1.
  const std::shared_ptr<Communicator>& comm() const { return comm_; }

  // This rank's place in the process grid, sent with every heartbeat from now on (trnctl status
  // shows it); a no-op without a coordinator.
  void set_coordinates(int dp_rank, int tp_rank, int pp_rank);
  // A checkpoint shard of `step` is durable (ReportShard: the coordinator commits the step once
  // every rank of the generation reported; trnctl checkpoints lists it). A no-op without a
  // coordinator; a failure to report is a warning, never a failed save.
  void report_shard(int64_t step, const std::string& path, uint64_t bytes);
  // Progress for the coordinator's heartbeat (trnctl status); a no-op without a coordinator.
  void report_progress(int64_t step, double loss, double tokens_per_s);
  // The newest validation loss, sent with every heartbeat from now on (trnctl status VAL_LOSS,
  // the coordinator's trn_job_val_loss); a no-op without a coordinator.
  void report_validation(double val_loss);
  // The MoE figures of the newest step (mixture-of-experts models), sent with rank 0's every
  // heartbeat from now on (the coordinator's trn_job_moe_*); the figures are global, so the other
  // ranks send none and node heartbeats stay small. At most control::kMaxMoeLayers layers go (a
  // deeper model's first ones, with one warning). A no-op without a coordinator.
  void report_moe(const control::MoeReport& report);
  // True when this worker recovers in place (TRN_RECOVERY=in-place and a trnrun agent to hear).
  bool recovers_in_place() const { return in_place_; }
  // Fails every operation of this generation's communicators at once (a peer is gone).
  void abort(const std::string& reason);
  // True once the coordinator (or the agent for it) said this generation is over.
  bool told_to_stop() const { return told_to_stop_; }
  // Waits (up to TRN_TIMEOUT) for the agent's resume into a later generation, then rebuilds the
  // store, fabric and world communicator in it, with the rank and world size the resume gives
  // (an elastic job's new generation may renumber) (again, should that generation end before every
  // rank connected). Every communicator split from the old world must be released first.
  // Throws a remote error when no resume comes.
  void rejoin();
  int64_t generation() const { return id_.generation; }

  // The job's in-place recoveries as rank 0 counts them, sent with every heartbeat from now on
  // (trnctl status, trnctl watch, the coordinator's trn_job_recoveries_total...); a no-op
  // without a coordinator.
  void report_recovery(const control::RecoveryReport& report);
  // Tells the coordinator this worker is failing (a new generation starts at once rather than
  // after a missed heartbeat); a no-op without a coordinator. Never throws.
  void report_failure(const std::string& reason);

 private:
  World() = default;
  void connect();          // the fabric and world communicator of id_.generation
  void next_generation();  // waits for the resume, drops this generation's fabric, moves to the next
  void on_resume(const control::Resume& r);

  launch::WorkerIdentity id_;
  std::string bootstrap_;
  // Destroyed bottom-up: the heartbeat stops before the communicator it may abort, the
  // communicator before the transport, and MPI finalises last.
  std::unique_ptr<mpi::Bootstrap> mpi_;
  std::unique_ptr<control::CoordinatorClient> client_;
  std::unique_ptr<Store> store_;
  std::shared_ptr<PointToPoint> transport_;
  std::shared_ptr<Communicator> comm_;
  std::unique_ptr<control::Heartbeater> heartbeat_;
  bool in_place_ = false;
  std::atomic<bool> told_to_stop_{false};
  std::mutex mu_;  // guards comm_ against the heartbeat thread's abort, and resumed_
  std::condition_variable resumed_cv_;
  control::Resume resumed_{-1};  // the newest generation the agent said this node joined, and our place
};

}  // namespace trn::dist
