// AdamW with PyTorch semantics (torch.optim.AdamW): decoupled weight decay applied only to
// 2-D tensors, bias correction, eps added to the corrected second moment's square root. Also the
// global gradient norm (with clipping as torch.nn.utils.clip_grad_norm_) and the learning-rate
// schedule (linear warm-up, then constant or cosine decay to min_lr).
//
// As an Optimizer (optimizer.h) it clips to AdamWConfig::max_grad_norm and keeps state for the
// whole buffer; the global norm adds this rank's norm pieces (zero.h) over its NormGroup.
//
// Storage. The parameters and the gradients step() and update() take are each either whole
// (indexed by buffer offset: element i of the buffer is array[i]) or compact (the owned
// elements one range after another, the layout of m and v: element owned[0].begin is array[0]).
// Only the addressing differs: every element sees the same arithmetic, so a step over compact
// arrays leaves the same bits as one over whole arrays (ZeRO-2 keeps gradients compact, ZeRO-3
// parameters too; today every run uses whole arrays).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/model/config.h"
#include "runtime/optim/optimizer.h"
#include "runtime/optim/zero.h"
#include "runtime/util/thread_pool.h"

namespace trn {
class Communicator;
}

namespace trn::optim {

struct AdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;
  float max_grad_norm = 0.0f;  // update() clips to it (clip_to_norm); 0: never
};

// How a rank's gradients enter the global norm: the pieces its buffer is summed in
// (norm_pieces, which leaves out what another rank counts) and the group holding the rest of
// the model (the model-parallel group; null when this rank holds all of it).
struct NormGroup {
  NormPieces pieces;
  std::shared_ptr<Communicator> comm;
};

class AdamW : public Optimizer {
 public:
  // State for the whole buffer, which alone is the whole model.
  AdamW(const model::ParamLayout& layout, AdamWConfig cfg);
  // State for the whole buffer; the norm over `norm`'s group.
  AdamW(const model::ParamLayout& layout, AdamWConfig cfg, NormGroup norm);
  // State for the elements of `owned` only (ascending, disjoint ranges of the buffer; ZeRO-1),
  // kept one range after another: m()[0] is element owned[0].begin.
  AdamW(const model::ParamLayout& layout, AdamWConfig cfg, const std::vector<Range>& owned);
  // One update with learning rate lr of the owned elements of params (the whole buffer; grads
  // likewise); runs on pool's threads (element-wise, so the result does not depend on the thread
  // count, nor on how the buffer is partitioned).
  void step(float* params, const float* grads, float lr, ThreadPool& pool);
  const std::vector<Range>& owned() const { return owned_; }
  // How step() and update() address params and grads (default: both whole).
  void set_storage(Storage params, Storage grads) {
    params_storage_ = params;
    grads_storage_ = grads;
  }
  Storage params_storage() const { return params_storage_; }
  Storage grads_storage() const { return grads_storage_; }

  // Optimizer. grad_norm sums the whole buffer's pieces (an AdamW over owned ranges leaves the
  // norm to its caller: train::ZeroAdamW); update is step() on the owned elements' gradients
  // scaled by clip_scale (the values clip_to_norm would leave, bit for bit), in one pass; over
  // the whole buffer (whole gradients) that pass also writes each gradient back as 0 once read,
  // so the buffer needs no separate zeroing pass before the next backward (clears_grads).
  double grad_norm(const float* grads, ThreadPool& pool) override;
  void update(float* params, float* grads, double grad_norm, float lr, ThreadPool& pool) override;
  bool clears_grads() const override { return whole_ && grads_storage_ == Storage::kWhole; }
  const std::vector<Range>* shard() const override { return whole_ ? nullptr : &owned_; }
  const std::vector<float>& m() const override { return m_; }
  const std::vector<float>& v() const override { return v_; }
  std::vector<float>& mutable_m() override { return m_; }
  std::vector<float>& mutable_v() override { return v_; }
  int64_t steps_taken() const override { return t_; }
  void set_steps_taken(int64_t t) override { t_ = t; }
  size_t state_bytes() const override { return (m_.size() + v_.size()) * sizeof(float); }
  std::string describe() const override;

 private:
  // Elements [begin, end) of the buffer with their state from m_[state]; one tensor's decay.
  // step() with each gradient multiplied by grad_scale first; clear: each gradient is written
  // back as 0 once read (grads is then written, so not const).
  void step_scaled(float* params, float* grads, bool clear, float grad_scale, float lr, ThreadPool& pool);
  struct Segment {
    size_t begin, end, state;
    bool decay;
  };
  std::vector<Range> owned_;
  bool whole_ = true;  // owned_ is the whole buffer
  size_t n_ = 0;       // the buffer's size
  NormGroup norm_;
  std::vector<Segment> segments_;
  AdamWConfig cfg_;
  std::vector<float> m_, v_;
  int64_t t_ = 0;
  Storage params_storage_ = Storage::kWhole, grads_storage_ = Storage::kWhole;
};

// Sum of squares of g in double, in fixed chunks added in a fixed order: the same bits for any
// thread count.
double sum_of_squares(const float* g, size_t n, ThreadPool& pool);
// out[i]: the sum of squares of g[ranges[i].begin, ranges[i].end), one sequential loop in double
// per range. Eight ranges' loops run interleaved: their running sums are independent, so this
// changes no bit, and it hides the latency of each addition, which bounds a single loop.
void range_squares(const float* g, const Range* ranges, size_t count, double* out);
// Each piece's sum of squares (range_squares, as sum_of_squares's chunks; 0 for a piece not
// counted), the pieces spread over pool's threads.
std::vector<double> piece_sums(const NormPieces& pieces, const float* g, ThreadPool& pool);
// sqrt of pieces.combine(sums), summed over the group's comm first when there is one.
double global_norm(const NormGroup& group, const std::vector<double>& sums);
// The factor clip_grad_norm_ scales gradients by: max_norm / (norm + 1e-6) in float when that is
// below 1, else 1 (max_norm 0: never clips, 1).
float clip_scale(double norm, double max_norm);
// Scales g by clip_scale(norm, max_norm) when that is not 1.
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
