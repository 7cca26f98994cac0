// The trainer's checkpoints (runtime/checkpoint has the format): the --checkpoint-dir's run id
// and lock, resuming (--resume, and a restarted generation's own run), and asynchronous saves:
// a snapshot of the parameters and AdamW's moments this rank keeps (optim::Optimizer::shard()),
// written by a background thread over a communicator of its own (so its barriers never
// interleave with the training loop's) while training goes on. At most one save is in flight.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "runtime/checkpoint/checkpoint.h"
#include "runtime/model/model.h"
#include "runtime/optim/optimizer.h"
#include "runtime/parallel/grid.h"
#include "runtime/train/options.h"

namespace trn::train {

class Checkpointer {
 public:
  // With --checkpoint-dir: creates it, agrees on the run id (TRN_RUN_ID, else rank 0's random
  // one) and takes the directory's lock on rank 0: collective over the world (grid null: alone).
  Checkpointer(const Options& opt, const parallel::ProcessGrid* grid);
  // Only an error leaves a save in flight here: it is aborted rather than left to wait out its
  // deadline for ranks that are leaving too.
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Loads the checkpoint --resume (or a restart) chooses into the model's parameters and the
  // optimizer's state; returns the step to continue from (0: a fresh start). Collective over the
  // world: rank 0 chooses, every rank loads its choice.
  int64_t resume(model::LocalModel& model, optim::Optimizer& optimizer);
  // Instead of resume() when the state came from elsewhere (in-memory snapshots): returns step.
  // Collective over the world like resume().
  int64_t resumed_at(int64_t step);
  // Snapshots the state after `step` steps and hands it to the background saver (waiting for the
  // previous save first); returns the seconds the caller blocked.
  double save(int64_t step, const model::LocalModel& model, const optim::Optimizer& optimizer,
              const checkpoint::ReportFn& report);
  // The background save, agreed by every rank over the world communicator (collective: call it
  // at the same points on every rank). wait: until no save is in flight; otherwise one look,
  // joining the saver when every rank's save is done. A save that failed on any rank throws on
  // every rank: its own error on a rank whose save failed, that error as broadcast by the lowest
  // such rank on the others (whose saves, blocked on the failed rank, are aborted).
  void check(bool wait);
  void wait() { check(true); }

  int64_t committed_step() const { return committed_step_; }  // -1: none committed by this run
  const std::string& committed_dir() const { return committed_dir_; }

 private:
  int64_t load_chosen(model::LocalModel& model, optim::Optimizer& optimizer);

  Options opt_;
  const parallel::ProcessGrid* grid_;
  bool rank0_;
  std::string run_id_;  // the run checkpoints are recorded under (with --checkpoint-dir)
  std::unique_ptr<checkpoint::DirLock> dir_lock_;  // rank 0's lock on --checkpoint-dir
  std::shared_ptr<Communicator> comm_;             // the saver's
  std::vector<float> snap_p_, snap_m_, snap_v_;
  std::thread saver_;
  std::atomic<bool> save_done_{false};  // set by saver_ when it ends (save_error_ is then final)
  std::exception_ptr save_error_;
  int64_t committed_step_ = -1;  // the newest checkpoint this run committed, written by saver_
  std::string committed_dir_;
};

}  // namespace trn::train
