// What a rank trains: its part of the model, behind one interface that the one-process model
// (model::OneStageModel, a tensor-parallel shard of every block) and a pipeline stage
// (pipeline::PipelineModel, a range of blocks) both implement, so the trainer, the optimizer, the
// gradient sync and checkpoints never ask which one runs.
//
// LocalModel owns what both hold alike: the layout, the fp32 parameters (the master copy the
// optimizer updates), the gradients (same layout), the bf16 copy of the matmul weights under
// Precision::kBf16, and the compute threads. Mutable access to the parameters marks the bf16
// copy stale; the next forward rebuilds it (weights_for_forward), so it is always a pure
// function of the master whatever changed it (an optimizer step, a load, an init).
//
// A training step on a rank, in this order (train::Trainer::step):
//   zero_grad(); loss = step(batches) (every micro-batch's forward and backward; batches.ready
//   sees each prefix of the gradient buffer as it becomes final, so a data-parallel sync can
//   overlap backward); the gradient sync's finish(); loss = after_sync(loss, averaged): what the
//   model's own groups must still sum once the data-parallel mean is in (the pipeline: the tied
//   embedding's gradient over the embedding group, the loss from the last stage).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "collectives/core/aligned.h"
#include "runtime/model/config.h"
#include "runtime/model/grad_window.h"
#include "runtime/model/sharded.h"
#include "runtime/model/stage.h"
#include "runtime/model/views.h"
#include "runtime/optim/zero.h"
#include "runtime/util/thread_pool.h"

namespace trn::model {

// Gradient elements [begin, end) are final for this step (contiguous, increasing ranges from 0
// to the buffer's size; see OneStageModel::forward_backward).
using GradReadyFn = std::function<void(size_t begin, size_t end)>;

// The initialisation the layout's specs give, from a seed (runtime/model/init.cc).
void init_params(const ParamLayout& layout, uint64_t seed, float* params);

// One step's micro-batches on this rank.
struct StepBatches {
  int micro_batches = 1;
  float loss_scale = 1.0f;  // gradients are of loss_scale * (sum of token losses)
  // Writes micro-batch mb's inputs and targets, each (sequences per micro-batch, seq_len).
  std::function<void(int mb, int32_t* inputs, int32_t* targets)> fill;
  GradReadyFn ready;  // may be empty; called during the step's last backward(s) only
  // evaluate() only, may be empty: the last stage's forwards run without targets (the loss is
  // then 0) and hand each micro-batch's logits on, before the next forward reuses them: the
  // `sequences` sequences from `first_seq` of micro-batch mb, (sequences x seq_len) rows of this
  // rank's vocabulary slice (Stage::logits). Not called on other pipeline stages.
  std::function<void(int mb, int first_seq, int sequences, const float* logits)> logits;
};

class LocalModel {
 public:
  virtual ~LocalModel() = default;
  LocalModel(const LocalModel&) = delete;
  LocalModel& operator=(const LocalModel&) = delete;

  const ParamLayout& layout() const { return layout_; }
  size_t num_params() const { return layout_.total(); }
  // The fp32 master: the whole buffer, or under ZeRO-3 (shard_weights) this rank's compact
  // shard (param_storage() says which; param_storage_size() elements). Mutable access may
  // change the weights: the bf16 copy is rebuilt before the next forward.
  float* params() {
    bf16_stale_ = true;
    return sharded_ ? sharded_->master() : params_.data();
  }
  const float* params() const { return sharded_ ? sharded_->master() : params_.data(); }
  optim::Storage param_storage() const { return sharded_ ? optim::Storage::kCompact : optim::Storage::kWhole; }
  size_t param_storage_size() const { return sharded_ ? sharded_->master_size() : params_.size(); }
  // The gradients: during a step the whole buffer; after keep_owned_grads (ZeRO-2 and 3) until
  // the next zero_grad, the compact shard of the data-parallel mean (grad_storage() says which).
  float* grads();  // allocates the whole buffer, zeroed, when none is held
  const float* grads() const { return grads_compact_ ? owned_grads_.data() : grads_.data(); }
  optim::Storage grad_storage() const { return grads_compact_ ? optim::Storage::kCompact : optim::Storage::kWhole; }
  // The compute threads (they also run the optimizer's loops).
  ThreadPool& pool() { return pool_; }
  int threads() const { return pool_.size(); }

  // Counter-based initialisation from a seed (init_params): every layout starts from the same
  // model, each shard holding its slice of it.
  void init(uint64_t seed);
  // Allocates the whole gradient buffer if keep_owned_grads released it, and zeroes it (nothing
  // to write after grads_cleared).
  void zero_grad();
  // The caller has left every element of the whole gradient buffer at 0 since the last backward
  // (the optimizer's update, Optimizer::clears_grads): the next zero_grad skips its fill.
  void grads_cleared() { grads_clear_ = !grads_compact_ && !window_ && !grads_.empty(); }

  // ZeRO-3: from now on this rank keeps only its compact shard of the master (plan's owned
  // slices of comm's rank; comm a communicator over the data-parallel group, for gathers only),
  // gathering each piece's weights when a forward or backward needs them (sharded.h), `prefetch`
  // pieces ahead. The whole buffer and the whole bf16 copy are freed.
  void shard_weights(const optim::ZeroPlan& plan, std::shared_ptr<Communicator> comm, int prefetch);
  const ShardedWeights* sharded() const { return sharded_.get(); }
  // ZeRO-3: the gathers' timing starts over (ShardedWeights::restart_timing); else a no-op.
  void restart_gather_timing() {
    if (sharded_) sharded_->restart_timing();
  }
  // The whole fp32 master, gathered from every data-parallel rank under ZeRO-3 (collective over
  // the data-parallel group), else a copy.
  std::vector<float> whole_params() const;
  // ZeRO-2 and 3 with one backward per step on one compute thread: the backward adds into a
  // gradient window (grad_window.h) instead of the whole buffer, and the sync reduce-scatters
  // each bucket from it into the compact shard (grads(), owned_elements floats), which this
  // model then holds for good (keep_owned_grads has nothing left to do).
  void use_grad_window(const optim::ZeroPlan& plan, size_t owned_elements);
  GradWindow* grad_window() { return window_.get(); }
  const GradWindow* grad_window() const { return window_.get(); }
  // ZeRO-2 and 3, after the gradient sync: keeps the owned ranges of the whole gradient buffer
  // (where the sync left the mean), one after another, and frees the whole buffer until the next
  // zero_grad. The optimizer then reads the compact shard.
  void keep_owned_grads(const std::vector<optim::Range>& owned);

  // Runs every micro-batch's forward and backward for this rank, adding the gradients into
  // grads(). Returns the part of the step's loss this rank knows (after_sync completes it).
  virtual double step(const StepBatches& batches) = 0;
  // After the gradient sync's finish(): what the model's own groups still sum, in that order.
  // averaged: the ranges of grads() that hold the data-parallel mean (ZeRO-1's owned slices;
  // null: all of it). Returns the mean token loss of this rank's micro-batches.
  virtual double after_sync(double loss, const std::vector<optim::Range>* averaged) {
    (void)averaged;
    return loss;
  }

  // Forward only over batches' micro-batches (loss_scale and ready unused), for validation:
  // neither the gradients nor the parameters change. Collective over the model's own groups
  // like a step (a pipeline's stages, its tp ranks); returns the mean token loss of this rank's
  // micro-batches, as after_sync does. With batches.logits, the logits instead (the forwards
  // are the same: trn-train --dump-logits).
  virtual double evaluate(const StepBatches& batches) = 0;

  // What this rank's MoE blocks reported since the last call (stage.h MoeCounts: the balancing
  // loss, the expert loads per layer), and starts a new sum. Collective over the model's own
  // groups (a pipeline sums its stages'): every rank calls it at the same point.
  virtual MoeCounts take_moe_counts() = 0;

  // Activations, scratch and message buffers the model allocated, in bytes.
  virtual size_t activation_bytes() const = 0;
  // Bytes of the whole bf16 weight copy the forwards read (0 under fp32 and under ZeRO-3, whose
  // gathered pieces carry their own bf16 form).
  size_t bf16_weight_bytes() const;
  // How the model is laid out over pipeline stages, for the log: "pp 1", "pp 4 1f1b x 2 chunks".
  virtual std::string describe() const = 0;
  // The share of its steps' time this rank waited for a neighbouring pipeline stage (the
  // measured bubble); 0 for a model without pipeline stages.
  virtual double pipeline_wait_share() const { return 0.0; }

 protected:
  LocalModel(const Config& c, const Placement& placement, int threads);
  // The whole-buffer view of the parameters for a forward: the fp32 master and, under
  // Precision::kBf16, the bf16 copy, rebuilt first when it is stale (the compute threads split
  // the work). Not under ZeRO-3, whose models gather piece by piece (sharded_weights()).
  WeightView<float> weights_for_forward();
  ShardedWeights* sharded_weights() { return sharded_.get(); }
  // The whole-buffer view of grads(), or the gradient window's.
  GradView<float> grad_view() {
    return window_ ? GradView<float>::sourced(window_.get()) : GradView<float>::whole(grads(), layout_.total());
  }

 private:
  ParamLayout layout_;
  ThreadPool pool_;
  AlignedVector<float> params_, grads_;  // 64-byte aligned: gradients cross the wire
  Bf16Weights bf16_;                     // of layout_; empty under fp32
  bool bf16_stale_ = true;
  std::unique_ptr<ShardedWeights> sharded_;  // ZeRO-3; params_ is then empty
  AlignedVector<float> owned_grads_;         // ZeRO-2 and 3: the compact gradient shard
  std::unique_ptr<GradWindow> window_;       // ZeRO-2 and 3, one backward per step
  bool grads_compact_ = false;
  bool grads_clear_ = false;  // grads_ is all 0 (grads_cleared), until the next zero_grad
};

}  // namespace trn::model
