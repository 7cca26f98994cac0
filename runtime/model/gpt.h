// The GPT-2 model trn trains, or this rank's part of it (Placement: a tensor-parallel shard of a
// range of blocks): parameters in one contiguous float buffer, gradients in another (same
// layout, see ParamLayout), activations allocated once for a fixed (batch, seq_len).
//
// With threads > 1 the batch is split into contiguous slices of sequences, one Stage per
// compute thread (under tensor parallelism each with its own tp::Region, so thread k's
// all-reduces pair with thread k's on the other ranks), each with its own activations and (except thread 0) its own gradient buffer.
// Thread 0 folds the other threads' gradients into grads() tensor group by tensor group as they
// become final, in a fixed order, so results are bit-identical run to run for a given thread
// count.
//
// Gradient readiness hook (for data parallelism): forward_backward() calls
// ready(begin, end) on the calling thread each time the gradient elements [begin, end) are final
// for this step. The ranges are contiguous and increasing, start at 0 and end at num_params():
// all-reduce of a bucket may start as soon as the bucket lies below `end`, while backward goes on.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "collectives/core/aligned.h"
#include "runtime/model/config.h"
#include "runtime/model/stage.h"
#include "runtime/util/thread_pool.h"

namespace trn::model {

using GradReadyFn = std::function<void(size_t begin, size_t end)>;

// GPT-2 initialization of this layout's tensors from a seed (Gpt::init).
void init_params(const ParamLayout& layout, uint64_t seed, float* params);

class Gpt {
 public:
  // batch: sequences per forward_backward call; seq_len <= c.ctx. Threads are capped at batch;
  // tp: one region per thread that runs (threads_for(threads, batch) of them), or empty alone.
  Gpt(const Config& c, int batch, int seq_len, int threads, Placement placement = {},
      std::vector<tp::Region*> tp = {});
  static int threads_for(int threads, int batch) { return std::clamp(threads, 1, std::max(batch, 1)); }
  ~Gpt();

  const Config& config() const { return c_; }
  const ParamLayout& layout() const { return layout_; }
  int batch() const { return B_; }
  int seq_len() const { return T_; }
  int threads() const { return pool_.size(); }
  ThreadPool& pool() { return pool_; }
  size_t num_params() const { return layout_.total(); }
  // Mutable access may change the weights: under Precision::kBf16 the next forward rebuilds the
  // bf16 copy from them first (so an optimizer step, a load or an init is always seen).
  float* params() {
    bf16_stale_ = true;
    return params_.data();
  }
  const float* params() const { return params_.data(); }
  float* grads() { return grads_.data(); }
  const float* grads() const { return grads_.data(); }

  // GPT-2 initialization from a seed: every element is a pure function of (seed, tensor name,
  // global element index), so any layout and thread count starts from the same model, each
  // shard holding exactly its slice of the one-process initialisation. Padding rows are zero.
  void init(uint64_t seed);
  void zero_grad();

  // inputs, targets are (batch, seq_len). Adds d(loss_scale * sum of token losses)/d(params)
  // into grads() and returns the mean token loss of this batch. ready may be empty.
  double forward_backward(const int32_t* inputs, const int32_t* targets, float loss_scale,
                          const GradReadyFn& ready = {});
  // Forward only; returns the mean token loss.
  double forward(const int32_t* inputs, const int32_t* targets);

  size_t activation_bytes() const;
  // Bytes of the bf16 weight copy (0 under fp32).
  size_t bf16_weight_bytes() const { return bf16_.bytes(); }

 private:
  void refresh_bf16();
  struct alignas(64) Progress {
    std::atomic<size_t> prefix{0};
  };
  void fold_and_report(size_t begin, size_t end, const GradReadyFn& ready);

  Config c_;
  ParamLayout layout_;
  int B_, T_;
  ThreadPool pool_;
  AlignedVector<float> params_, grads_;  // 64-byte aligned: gradients cross the wire
  std::vector<std::unique_ptr<Stage<float>>> cores_;
  std::vector<int> first_seq_;                   // first sequence of each core's slice
  std::vector<std::vector<float>> extra_grads_;  // cores 1..n-1
  std::unique_ptr<Progress[]> progress_;
  Bf16Weights bf16_;  // shared by every core; empty under fp32
  bool bf16_stale_ = true;
};

}  // namespace trn::model
