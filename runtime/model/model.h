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
#include <string>
#include <vector>

#include "collectives/core/aligned.h"
#include "runtime/model/config.h"
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
};

class LocalModel {
 public:
  virtual ~LocalModel() = default;
  LocalModel(const LocalModel&) = delete;
  LocalModel& operator=(const LocalModel&) = delete;

  const ParamLayout& layout() const { return layout_; }
  size_t num_params() const { return layout_.total(); }
  // Mutable access may change the weights: the bf16 copy is rebuilt before the next forward.
  float* params() {
    bf16_stale_ = true;
    return params_.data();
  }
  const float* params() const { return params_.data(); }
  float* grads() { return grads_.data(); }
  const float* grads() const { return grads_.data(); }
  // The compute threads (they also run the optimizer's loops).
  ThreadPool& pool() { return pool_; }
  int threads() const { return pool_.size(); }

  // Counter-based initialisation from a seed (init_params): every layout starts from the same
  // model, each shard holding its slice of it.
  void init(uint64_t seed);
  void zero_grad();

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
  // micro-batches, as after_sync does.
  virtual double evaluate(const StepBatches& batches) = 0;

  // Activations, scratch and message buffers the model allocated, in bytes.
  virtual size_t activation_bytes() const = 0;
  // Bytes of the bf16 weight copy (0 under fp32).
  size_t bf16_weight_bytes() const { return bf16_.bytes(); }
  // How the model is laid out over pipeline stages, for the log: "pp 1", "pp 4 1f1b x 2 chunks".
  virtual std::string describe() const = 0;
  // The share of its steps' time this rank waited for a neighbouring pipeline stage (the
  // measured bubble); 0 for a model without pipeline stages.
  virtual double pipeline_wait_share() const { return 0.0; }

 protected:
  LocalModel(const Config& c, const Placement& placement, int threads);
  // The whole-buffer view of the parameters for a forward: the fp32 master and, under
  // Precision::kBf16, the bf16 copy, rebuilt first when it is stale (the compute threads split
  // the work).
  WeightView<float> weights_for_forward();
  // The whole-buffer view of grads().
  GradView<float> grad_view() { return GradView<float>::whole(grads_.data(), grads_.size()); }

 private:
  ParamLayout layout_;
  ThreadPool pool_;
  AlignedVector<float> params_, grads_;  // 64-byte aligned: gradients cross the wire
  Bf16Weights bf16_;                     // of layout_; empty under fp32
  bool bf16_stale_ = true;
};

}  // namespace trn::model
