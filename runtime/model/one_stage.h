// A model of any family with all its layers in one stage (no pipeline): the whole model, or this
// rank's tensor-parallel shard of it (Placement): a LocalModel (model.h: parameters, gradients, the bf16 copy and the threads) with
// activations allocated once for a fixed (batch, seq_len).
//
// With threads > 1 the batch is split into contiguous slices of sequences, one Stage per
// compute thread (under tensor parallelism each with its own tp::Region, so thread k's
// all-reduces pair with thread k's on the other ranks), each with its own activations and
// (except thread 0) its own gradient buffer.
// Thread 0 folds the other threads' gradients into grads() tensor group by tensor group as they
// become final, in a fixed order, so results are bit-identical run to run for a given thread
// count.
//
// Gradient readiness hook (for data parallelism): forward_backward() calls
// ready(begin, end) on the calling thread each time the gradient elements [begin, end) are final
// for this step. The ranges are contiguous and increasing, start at 0 and end at num_params():
// all-reduce of a bucket may start as soon as the bucket lies below `end`, while backward goes on.
// step() runs forward_backward once per micro-batch, with the hook on the last one only.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "collectives/core/aligned.h"
#include "runtime/model/config.h"
#include "runtime/model/model.h"
#include "runtime/model/stage.h"

namespace trn::model {

class OneStageModel : public LocalModel {
 public:
  // batch: sequences per forward_backward call; seq_len <= c.ctx. Threads are capped at batch;
  // tp: one region per thread that runs (threads_for(threads, batch) of them), or empty alone.
  OneStageModel(const Config& c, int batch, int seq_len, int threads, Placement placement = {},
      std::vector<tp::Region*> tp = {});
  static int threads_for(int threads, int batch) { return std::clamp(threads, 1, std::max(batch, 1)); }
  ~OneStageModel() override;

  const Config& config() const { return layout().config(); }
  int batch() const { return B_; }
  int seq_len() const { return T_; }

  // inputs, targets are (batch, seq_len). Adds d(loss_scale * sum of token losses)/d(params)
  // into grads() and returns the mean token loss of this batch. ready may be empty.
  double forward_backward(const int32_t* inputs, const int32_t* targets, float loss_scale,
                          const GradReadyFn& ready = {});
  // Forward only; returns the mean token loss (targets null: 0, each core's logits kept).
  double forward(const int32_t* inputs, const int32_t* targets);

  // LocalModel: micro-batches of batch() sequences, the hook on the last one; returns their
  // mean token loss.
  double step(const StepBatches& batches) override;
  // LocalModel: forward() over each micro-batch; their mean token loss (or each core's logits).
  double evaluate(const StepBatches& batches) override;
  size_t activation_bytes() const override;
  MoeCounts take_moe_counts() override;
  std::string describe() const override { return "pp 1"; }

 private:
  struct alignas(64) Progress {
    std::atomic<size_t> prefix{0};
  };
  void fold_and_report(size_t begin, size_t end, const GradReadyFn& ready);
  // The weights of a forward (and backward): the whole buffer, or under ZeRO-3 a view whose
  // pieces the sharded weights gather in the pass's order (begun here).
  WeightView<float> begin_pass(bool backward);
  // fn on every compute thread; under ZeRO-3 the pass ends (or is abandoned when fn throws).
  template <class Fn>
  void run_pass(Fn&& fn);

  int B_, T_;
  std::vector<std::unique_ptr<Stage<float>>> cores_;
  std::vector<int> first_seq_;                   // first sequence of each core's slice
  std::vector<std::vector<float>> extra_grads_;  // cores 1..n-1
  std::unique_ptr<Progress[]> progress_;
  std::vector<int32_t> inputs_, targets_;  // step()'s micro-batch
};

}  // namespace trn::model
