// AdamW with PyTorch semantics (torch.optim.AdamW): decoupled weight decay applied only to
// 2-D tensors, bias correction, eps added to the corrected second moment's square root. Also the
// global gradient norm (with clipping as torch.nn.utils.clip_grad_norm_) and the learning-rate
// schedule (linear warm-up, then constant or cosine decay to min_lr).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/model/config.h"
#include "runtime/optim/zero.h"
#include "runtime/util/thread_pool.h"

namespace trn::optim {

struct AdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;
};

class AdamW {
 public:
  // State for the whole buffer.
  AdamW(const model::ParamLayout& layout, AdamWConfig cfg);
  // State for the elements of `owned` only (ascending, disjoint ranges of the buffer; ZeRO-1),
  // kept one range after another: m()[0] is element owned[0].begin.
  AdamW(const model::ParamLayout& layout, AdamWConfig cfg, const std::vector<Range>& owned);
  // One update with learning rate lr of the owned elements of params (the whole buffer; grads
  // likewise); runs on pool's threads (element-wise, so the result does not depend on the thread
  // count, nor on how the buffer is partitioned).
  void step(float* params, const float* grads, float lr, ThreadPool& pool);
  int64_t steps_taken() const { return t_; }
  const std::vector<float>& m() const { return m_; }
  const std::vector<float>& v() const { return v_; }
  const std::vector<Range>& owned() const { return owned_; }
  size_t state_bytes() const { return (m_.size() + v_.size()) * sizeof(float); }
  // Restores the state a checkpoint saved: the moments (same layout) and the step count.
  std::vector<float>& mutable_m() { return m_; }
  std::vector<float>& mutable_v() { return v_; }
  void set_steps_taken(int64_t t) { t_ = t; }

 private:
  // Elements [begin, end) of the buffer with their state from m_[state]; one tensor's decay.
  struct Segment {
    size_t begin, end, state;
    bool decay;
  };
  std::vector<Range> owned_;
  std::vector<Segment> segments_;
  AdamWConfig cfg_;
  std::vector<float> m_, v_;
  int64_t t_ = 0;
};

// Sum of squares of g in double, in fixed chunks added in a fixed order: the same bits for any
// thread count.
double sum_of_squares(const float* g, size_t n, ThreadPool& pool);
// Scales g by max_norm / (norm + 1e-6) when that is below 1 (clip_grad_norm_); max_norm 0: never.
void clip_to_norm(float* g, size_t n, double norm, double max_norm, ThreadPool& pool);

struct Schedule {
  enum class Kind { kConstant, kCosine };
  Kind kind = Kind::kCosine;
  float lr = 1e-3f;
  float min_lr = 1e-4f;
  int64_t warmup = 0;
  int64_t total = 1;
  // Learning rate of 0-based step s: lr*(s+1)/warmup during warm-up, then lr (constant) or
  // min_lr + (lr - min_lr) * (1 + cos(pi * (s - warmup) / (total - warmup))) / 2 (cosine).
  float at(int64_t s) const;
};

Schedule::Kind parse_schedule(const std::string& name);  // usage error on an unknown name

}  // namespace trn::optim
