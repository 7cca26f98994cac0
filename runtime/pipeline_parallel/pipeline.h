// One rank's part of a pipeline-parallel model and the executor that runs a schedule over it.
//
// The n_layer blocks are cut into P * V contiguous virtual stages of equal size; this rank
// (stage s) holds chunks c = 0..V-1, chunk c being virtual stage c * P + s (schedule.h), with
// the embedding on virtual stage 0 and the final LayerNorm and tied LM head on the last. All
// chunks' parameters and gradients live in one buffer (ParamLayout with several chunks), so the
// optimizer, data-parallel buckets and checkpoints see one range as without pipelining.
//
// It is a model::LocalModel (model.h), which owns that buffer, the gradients and the bf16 copy.
//
// A step runs the schedule's action list: every receive of the step is posted first (into one
// buffer per micro-batch and chunk, in the order the sending rank will send), so transfers
// overlap compute; a forward or backward then waits only for its own message. Activations and
// their gradients travel on the pp communicator (the ranks of one (dp, tp) position), so under
// tensor parallelism each TP rank exchanges with its peer of the same tp rank. Tokens are not
// sent: the first and the last stage each draw their micro-batch from the sampler (a pure
// function of the step).
//
// The step's list has a REDUCE_GRAD after each chunk's last B (zb: last W), where the rest of
// the chunk's range goes to the gradient sync (batches.ready).
//
// ZeRO-3 (LocalModel::shard_weights): the step runs with_sharding's list (lookahead: the
// sharded weights' prefetch). UNSHARD(c) issues the gathers of chunk c's range of the buffer
// (whole buckets) without waiting, the chunk's F and B wait for them (the wait counts as the
// gathers' exposed time) and read that range's view (under bf16 with its bf16 form), and
// RESHARD(c) frees it; the whole buffer is never gathered for a step. The data-parallel replicas
// of a stage run one list, so they issue their gathers in one order.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "collectives/core/aligned.h"
#include "runtime/model/config.h"
#include "runtime/model/model.h"
#include "runtime/model/stage.h"
#include "runtime/pipeline_parallel/schedule.h"

namespace trn {
class Communicator;
class Work;
}

namespace trn::pipeline {

// The chunks of `stage` when c.n_layer is cut into shape.P * shape.V equal virtual stages;
// usage error naming the values when they do not divide n_layer.
std::vector<model::Chunk> chunks_of(const model::Config& c, const Shape& shape, int stage);

class PipelineModel : public model::LocalModel {
 public:
  // mb_batch sequences of seq_len tokens per micro-batch; threads run the optimizer's loops and
  // the matmuls (OpenBLAS); tp: this rank's tensor-parallel region (null: none); embedding: the
  // group of the first and the last stage (null elsewhere), which sums the tied wte's gradient;
  // cp, cp_rank: the context-parallel chunks of each sequence this rank computes (seq_len is its
  // tokens of each; the ring rides on tp_region); ep, ep_rank: the experts of each MoE layer this
  // rank holds (the expert group's all-to-alls ride on tp_region too).
  PipelineModel(const model::Config& c, Kind kind, Shape shape, int stage, int tp, int tp_rank, int mb_batch,
                int seq_len, int threads, tp::Region* tp_region, std::shared_ptr<Communicator> pp,
                std::shared_ptr<Communicator> embedding = nullptr, int cp = 1, int cp_rank = 0, int ep = 1,
                int ep_rank = 0);
  ~PipelineModel() override;

  size_t activation_bytes() const override;
  // Every stage's sum, all-reduced over the pipeline (each stage holds its own blocks').
  model::MoeCounts take_moe_counts() override;
  std::string describe() const override;

  // Tokens of micro-batch mb: inputs and targets (mb_batch, seq_len).
  using Fill = std::function<void(int mb, int32_t* inputs, int32_t* targets)>;
  // Runs one step's forwards and backwards (batches.micro_batches is the schedule's M), adding
  // d(loss_scale * token losses)/d(params) into grads(). Returns the sum of the token losses on
  // the last stage, 0 elsewhere. batches.ready as OneStageModel's readiness hook, called as each chunk's
  // last backward finalises its gradients. A failure aborts the transport (the step's transfers
  // stop touching this model's buffers) and is rethrown.
  double step(const model::StepBatches& batches) override;
  // The tied wte: the first stage's copy took the embedding's gradient, the last stage's the
  // head's; both get the sum over the embedding group (only the averaged ranges, which both
  // stages cut alike at wte's ends). Then the loss from the last stage, as the mean token loss.
  double after_sync(double loss, const std::vector<optim::Range>* averaged) override;
  // Forward only (forward_actions: receive, forward, send per chunk and micro-batch; activation
  // slot 0 of each chunk, as nothing is kept for a backward), then the loss from the last stage
  // summed over the pp group as after_sync does (with batches.logits: the last stage hands each
  // forward's logits on, and the loss is 0). A failure aborts the transport as step's does.
  double evaluate(const model::StepBatches& batches) override;

  // Seconds this rank waited for a neighbouring stage (receives, and its sends at the end of a
  // step) and spent in steps, since construction.
  double wait_seconds() const { return wait_s_; }
  double step_seconds() const { return step_s_; }
  double pipeline_wait_share() const override { return step_s_ > 0 ? wait_s_ / step_s_ : 0.0; }

 private:
  struct Message {
    Op op;  // kRecvF or kRecvB
    int mb, chunk;
  };
  double run_step(const Fill& fill, float loss_scale, const model::GradReadyFn& ready);
  // Posts this step's receives of the neighbours' sends, in the order their lists (the
  // training schedule's, or forward_actions when forward_only) send them.
  void post_receives(bool forward_only);
  // logits: model::StepBatches::logits (empty: the last stage's forwards take the targets).
  using LogitsFn = std::function<void(int mb, int first_seq, int sequences, const float* logits)>;
  double run_forward(const Fill& fill, const LogitsFn& logits);
  void abort_step(const std::exception& e);
  void wait_for(std::shared_ptr<Work>& w, const char* what, int mb, int chunk);
  // Under ZeRO-3: UNSHARD / RESHARD of a chunk, and its view for an F or B (waits for its gather).
  void unshard(int chunk);
  void reshard(int chunk);
  const model::WeightView<float>& chunk_weights(int chunk);
  // The step's list (forward_only: the evaluation's), with_sharding's under ZeRO-3.
  const std::vector<Action>& list_for(bool forward_only);

  model::Config c_;
  Kind kind_;
  Shape shape_;
  int stage_, mb_batch_, seq_len_;
  std::shared_ptr<Communicator> pp_, embedding_;
  std::vector<std::unique_ptr<model::Stage<float>>> stages_;  // per chunk
  SlotPlan slots_;
  std::vector<Action> actions_;
  // actions_ with its REDUCE_GRADs (the step runs it), the evaluation's, and under ZeRO-3 both
  // with UNSHARD / RESHARD (built on first use: the weights are sharded after construction).
  std::vector<Action> step_actions_, forward_actions_, sharded_actions_, sharded_forward_;
  // ZeRO-3: per chunk, its range gather while unsharded (none: sharded).
  static constexpr size_t kNoGather = size_t(-1);
  std::vector<size_t> chunk_gather_;
  // Per (chunk, micro-batch): received activations / gradients and what this rank sends.
  std::vector<std::vector<AlignedVector<float>>> recv_f_, recv_b_, send_f_, send_b_;
  std::vector<std::vector<std::shared_ptr<Work>>> recv_f_work_, recv_b_work_;
  std::vector<std::shared_ptr<Work>> sends_;
  std::vector<int32_t> inputs_, targets_;
  double wait_s_ = 0.0, step_s_ = 0.0;
};

}  // namespace trn::pipeline
