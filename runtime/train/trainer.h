// The training loop: sampler -> the model's step (forward/backward over the micro-batches) ->
// gradient sync -> the optimizer (global norm, clipping, AdamW), with progress lines, metrics
// JSONL, checkpoint scheduling and the final save; with --val-data, a forward-only validation
// after every --eval-every steps and the last (evaluate()), between steps, touching no state.
//
// What trains comes from the builder (builder.h): this rank's part of the model
// (model::LocalModel: the one-process model or a pipeline stage, tensor-parallel inside), the
// data-parallel sync (GradientSync: all-reduce, or ZeRO-1's reduce-scatter) and the optimizer
// (optim::Optimizer: AdamW, or ZeRO-1's over the owned slices). The trainer drives them through
// their interfaces and keeps everything global global: the gradient norm is over the whole
// model, the logged loss over the global batch, and --save writes the whole model gathered from
// the shards.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/data/data.h"
#include "runtime/optim/adamw.h"
#include "runtime/parallel/grid.h"
#include "runtime/train/builder.h"
#include "runtime/train/checkpointing.h"
#include "runtime/train/metrics.h"
#include "runtime/train/options.h"

namespace trn::train {

class Trainer {
 public:
  // Where a trainer of a recovered generation gets its state instead of a checkpoint: the step
  // it restored into the model and optimizer (in-memory snapshots, snapshot.h), or nullopt to
  // resume as usual. Collective like the checkpoint resume it replaces.
  using RestoreFn = std::function<std::optional<int64_t>(model::LocalModel&, optim::Optimizer&)>;
  // grid: this rank's place and groups (null: one process); it must outlive the trainer.
  Trainer(const Options& opt, const parallel::ProcessGrid* grid = nullptr, const RestoreFn& restore = {});
  ~Trainer();

  // This rank's part of the model, its data-parallel sync (null when dp is 1) and optimizer.
  const model::LocalModel& model() const { return *parts_.model; }
  GradientSync* sync() const { return parts_.sync.get(); }
  // Expert parallelism: the replicas holding this rank's experts (null: none, or no ep).
  const std::shared_ptr<Communicator>& expert_replicas() const { return parts_.expert_replicas; }
  // Seconds the MoE layers' all-to-alls took on compute thread 0 (0 without expert parallelism).
  double ep_seconds() const;
  const optim::Optimizer& optimizer() const { return *parts_.optimizer; }
  const model::ParamLayout& layout() const { return model().layout(); }
  // The fp32 master as the model holds it (under ZeRO-3 the compact shard: model().whole_params()).
  const float* params() const { return model().params(); }
  size_t num_params() const { return layout().total(); }
  const data::Tokens& tokens() const { return tokens_; }
  // Runs one optimizer step (the next one) and returns its figures.
  StepStats step();
  // Validation: the mean token loss over --eval-batches global batches of --val-data (the
  // sampler's steps 0..K-1 from a seed of its own, so every evaluation of every layout sees the
  // same tokens), forward only: gradients, weights and optimizer state are untouched.
  // Collective over the whole grid; every rank returns the same value. Usage error without
  // --val-data.
  double evaluate();
  // MoE: the step's balancing loss and expert loads into st, from this rank's counts over its
  // `sequences` (collective over the data-parallel replicas).
  void moe_stats(StepStats& st, model::MoeCounts counts, size_t sequences);
  // --moe-balance bias: moves each held layer's expert biases toward balance by the last step's
  // global loads (every rank alike, so replicas and tp shards stay equal).
  void update_moe_bias();
  bool validates() const { return val_sampler_ != nullptr; }
  // Runs all remaining steps with logging, then saves (rank 0).
  void run();
  // On data-parallel replica 0, collective over its model-parallel group (every tp rank and
  // pipeline stage) when the model is sharded; world rank 0 writes the file. Under ZeRO-3 on
  // every rank: the data-parallel group gathers the weights first. Writes --save's file and
  // --save-hf's directory from one gather.
  void save() const;
  // Seconds this rank's compute thread 0 spent in tensor-parallel all-reduces so far.
  double tp_seconds() const;
  // Context parallelism over the run, summed over this rank's compute threads: the attention's
  // (query row, key) products per head, forward and backward (the balance counter), and the ring
  // exchange's seconds waited for (exposed) and in flight (cp::Group).
  struct CpStats {
    double products = 0, exposed_s = 0, in_flight_s = 0;
  };
  CpStats cp_stats() const;
  double elapsed_s() const { return elapsed_s_; }  // in steps so far
  int64_t next_step() const { return next_step_; }  // steps done (a resumed run counts its earlier ones)
  int64_t steps_run() const { return steps_run_; }  // steps this trainer ran
  // Appends one line to --metrics-jsonl (rank 0; a no-op without the flag).
  void write_metrics_line(const std::string& json) { metrics_.write_line(json); }

  // Called on every rank after each step of run() (heartbeats, progress reports).
  std::function<void(const StepStats&)> on_step;
  // Called on every rank after each step of run() once the step is reported, evaluated,
  // checkpointed and its metrics line written, with the state it left (in-memory snapshots).
  std::function<void(int64_t step, const model::LocalModel&, const optim::Optimizer&)> on_state;
  // Checked before each step of run() and each batch of evaluate(), at the same points on every
  // rank (it may be collective); when it returns true, they throw Stopped once a checkpoint save
  // in flight is committed (nothing more is saved: the final save belongs to a finished run).
  std::function<bool()> stop_requested;
  // Called by every rank's checkpoint writer once its shard is durable (see checkpoint::save).
  std::function<void(int64_t step, const std::string& path, uint64_t bytes)> report_shard;
  struct Stopped {
    int64_t steps_done;
    int64_t checkpoint_step = -1;  // the newest checkpoint this run committed (-1: none)
    std::string checkpoint_dir;    // its directory
  };

 private:
  void check_output_paths() const;
  void clamp_eval_batches();  // --eval-batches to what --val-data holds
  void stop_if_requested();  // throws Stopped when stop_requested says so
  void log_setup() const;
  void dump_batches(const std::string& path) const;
  // --dump-logits: one forward of the prompt through the model's layout (collective over the
  // whole grid), the vocabulary slices summed into one matrix over replica 0's model-parallel
  // group, written by world rank 0.
  void dump_logits();

  Options opt_;
  const parallel::ProcessGrid* grid_;
  int dp_rank_ = 0;
  int replica_ = 0;  // among the ranks holding the same weights (dp x cp): 0 saves
  // Context parallelism: the sampler's whole sequences, cut to this rank's chunks.
  void fill(const data::Sampler& sampler, int64_t step, int first, int count, int32_t* in, int32_t* tg);
  std::vector<int32_t> whole_in_, whole_tg_;
  bool rank0_ = true;  // world rank 0: logs, metrics and the saved file
  data::Tokens tokens_;
  std::unique_ptr<data::Sampler> sampler_;
  data::Tokens val_tokens_;                     // --val-data
  std::unique_ptr<data::Sampler> val_sampler_;  // null without --val-data
  Parts parts_;
  // After parts_: destroyed first, so a save in flight ends before the model it reads goes.
  std::unique_ptr<Checkpointer> checkpoints_;
  optim::Schedule schedule_;
  int64_t next_step_ = 0;
  int64_t steps_run_ = 0;
  double elapsed_s_ = 0.0;
  std::vector<double> moe_loads_;  // the last step's global expert loads (n_layer x (n_experts + 1))
  MetricsFile metrics_;
};

}  // namespace trn::train
