// The training loop: sampler -> forward/backward (micro-batches) -> gradient sync -> global norm
// clipping -> AdamW, with progress lines, metrics JSONL and the final save.
//
// In a parallel job the trainer is one rank of a ProcessGrid: it holds the tensor-parallel shard
// of its tp coordinate (tensor parallelism inside the model's pieces, over the grid's tp
// communicator, one split of it per compute thread), trains the data-parallel slice of its dp
// coordinate, and keeps everything global global: the gradient norm is over the whole model
// (replicated tensors counted once), the logged loss over the global batch, and --save writes
// the whole model gathered from the shards.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "runtime/checkpoint/checkpoint.h"
#include "runtime/data/data.h"
#include "runtime/model/gpt.h"
#include "runtime/optim/adamw.h"
#include "runtime/parallel/grid.h"
#include "runtime/pipeline_parallel/pipeline.h"
#include "runtime/tensor_parallel/region.h"
#include "runtime/train/grad_sync.h"
#include "runtime/train/options.h"

namespace trn::train {

struct StepStats {
  int64_t step = 0;  // 1-based
  double loss = 0.0;
  float lr = 0.0f;
  double grad_norm = 0.0;  // before clipping
  double tokens_per_s = 0.0;
  double elapsed_s = 0.0;  // since the first step started
  double checkpoint_blocked_s = -1.0;  // the step's wait for its checkpoint; < 0: none taken
};

class Trainer {
 public:
  // grid: this rank's place and groups (null: one process); sync: data-parallel gradient
  // averaging over grid->dp() (null when dp is 1). Both must outlive the trainer.
  Trainer(const Options& opt, const parallel::ProcessGrid* grid = nullptr, GradientSync* sync = nullptr);
  ~Trainer();

  // This rank's part of the model: parameters, gradients and their layout.
  const model::ParamLayout& layout() const { return pipe_ ? pipe_->layout() : model_->layout(); }
  float* params() { return pipe_ ? pipe_->params() : model_->params(); }
  const float* params() const { return pipe_ ? pipe_->params() : model_->params(); }
  float* grads() { return pipe_ ? pipe_->grads() : model_->grads(); }
  size_t num_params() const { return layout().total(); }
  ThreadPool& pool() { return pipe_ ? pipe_->pool() : model_->pool(); }
  // The pipeline stage, when --pp > 1 (null otherwise).
  const pipeline::PipelineModel* pipeline() const { return pipe_.get(); }
  const data::Tokens& tokens() const { return tokens_; }
  // Runs one optimizer step (the next one) and returns its figures.
  StepStats step();
  // Runs all remaining steps with logging, then saves (rank 0).
  void run();
  // On data-parallel replica 0, collective over its model-parallel group (every tp rank and
  // pipeline stage) when the model is sharded; world rank 0 writes the file.
  void save(const std::string& path) const;
  // Seconds this rank's compute thread 0 spent in tensor-parallel all-reduces so far.
  double tp_seconds() const;
  double elapsed_s() const { return elapsed_s_; }  // in steps so far
  // Appends one line to --metrics-jsonl (rank 0; a no-op without the flag).
  void write_metrics_line(const std::string& json);

  // Called on every rank after each step of run() (heartbeats, progress reports).
  std::function<void(const StepStats&)> on_step;
  // Checked before each step of run(); when it returns true, run() throws Stopped (nothing is
  // saved: the final save belongs to a finished run).
  std::function<bool()> stop_requested;
  // Called by every rank's checkpoint writer once its shard is durable (see checkpoint::save).
  std::function<void(int64_t step, const std::string& path, uint64_t bytes)> report_shard;
  struct Stopped {
    int64_t steps_done;
    int64_t checkpoint_step = -1;  // the newest checkpoint this run committed (-1: none)
    std::string checkpoint_dir;    // its directory
  };

 private:
  void dump_batches(const std::string& path) const;
  void write_metrics(const StepStats& s);

  double global_grad_norm();
  // The optimizer's part of a step: clipping and AdamW on what this rank updates (everything, or
  // its ZeRO-1 shard, whose parameters are then all-gathered).
  void update(double grad_norm, float lr);
  // Snapshots this rank's state and hands it to the background saver (at most one save in
  // flight: waits for the previous one first); returns the seconds the step blocked.
  double save_checkpoint();
  // The background save, agreed by every rank over the world communicator (collective: call
  // it at the same points on every rank). wait: until no save is in flight; otherwise one look,
  // joining the saver when every rank's save is done. A save that failed on any rank throws on
  // every rank: its own error on a rank whose save failed, that error as broadcast by the
  // lowest such rank on the others (whose saves, blocked on the failed rank, are aborted).
  void check_checkpoint(bool wait);
  void wait_for_checkpoint() { check_checkpoint(true); }
  void resume_from_checkpoint();
  // Creates --checkpoint-dir, agrees on the run id (TRN_RUN_ID, else rank 0's random one) and
  // takes the directory's lock on rank 0: collective over the world.
  void open_checkpoint_dir();
  // Usage error when the model, batch and layout need more memory than this host has.
  void check_memory(int tp_rank) const;

  Options opt_;
  const parallel::ProcessGrid* grid_;
  GradientSync* sync_;
  ZeroSync* zero_ = nullptr;  // sync_ under ZeRO-1: this rank updates and keeps state for its shard only
  int dp_rank_ = 0;
  bool rank0_ = true;  // world rank 0: logs, metrics and the saved file
  std::vector<std::unique_ptr<tp::CommRegion>> regions_;  // one per compute thread under TP
  // Asynchronous checkpoints: a snapshot of params and AdamW's moments, written by saver_ over a
  // communicator of its own (so its barriers never interleave with the training loop's).
  std::shared_ptr<Communicator> ckpt_comm_;
  std::vector<float> snap_p_, snap_m_, snap_v_;
  std::thread saver_;
  std::atomic<bool> save_done_{false};  // set by saver_ when it ends (save_error_ is then final)
  std::exception_ptr save_error_;
  int64_t committed_step_ = -1;  // the newest checkpoint this run committed, written by saver_
  std::string committed_dir_;
  std::string run_id_;  // the run checkpoints are recorded under (with --checkpoint-dir)
  std::unique_ptr<checkpoint::DirLock> dir_lock_;  // rank 0's lock on --checkpoint-dir
  data::Tokens tokens_;
  std::unique_ptr<data::Sampler> sampler_;
  std::unique_ptr<model::Gpt> model_;               // --pp 1
  std::unique_ptr<pipeline::PipelineModel> pipe_;  // --pp > 1
  std::unique_ptr<optim::AdamW> adamw_;
  optim::Schedule schedule_;
  std::vector<int32_t> inputs_, targets_;
  int64_t next_step_ = 0;
  double elapsed_s_ = 0.0;
  std::FILE* metrics_ = nullptr;
};

}  // namespace trn::train
