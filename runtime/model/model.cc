#include "runtime/model/model.h"

#include <algorithm>
#include <utility>

#include "collectives/core/error.h"

namespace trn::model {
namespace {

// Frees v's memory: `v = {}` would pick the initializer-list assignment, which keeps the
// capacity (and the resident pages).
template <class V>
void release(V& v) {
  V().swap(v);
}

}  // namespace

LocalModel::LocalModel(const Config& c, const Placement& placement, int threads)
    : layout_(c, placement), pool_(std::max(threads, 1)), bf16_(layout_) {
  // The gradient buffer comes with the first zero_grad (or grads()): under ZeRO-3 the whole
  // weights are gone by then, and the two never peak together.
  params_.assign(layout_.total(), 0.0f);
}

float* LocalModel::grads() {
  if (!grads_compact_ && grads_.empty()) grads_.assign(layout_.total(), 0.0f);
  return grads_compact_ ? owned_grads_.data() : grads_.data();
}

size_t LocalModel::bf16_weight_bytes() const {
  if (sharded_ || layout_.config().precision != Precision::kBf16) return 0;
  return layout_.total() * (kernels::bf16_path() == kernels::Bf16Path::kEmulated ? sizeof(float) : sizeof(kernels::bf16));
}

void LocalModel::init(uint64_t seed) {
  if (!sharded_) return init_params(layout_, seed, params());
  // Counter-based per element: the whole buffer's values, of which the shard keeps its own.
  AlignedVector<float> whole(layout_.total());
  init_params(layout_, seed, whole.data());
  sharded_->keep_owned(whole.data());
}

void LocalModel::use_grad_window(const optim::ZeroPlan& plan, size_t owned_elements) {
  TRN_CHECK(!window_);
  window_ = std::make_unique<GradWindow>(layout_, plan);
  owned_grads_.assign(owned_elements, 0.0f);
  release(grads_);
  grads_compact_ = true;
  grads_clear_ = false;
}

void LocalModel::zero_grad() {
  if (window_) return window_->begin();  // the reduce-scatter overwrites every owned element
  if (grads_compact_) {
    grads_compact_ = false;
    release(owned_grads_);
  }
  if (grads_.empty()) return grads_.assign(layout_.total(), 0.0f);
  if (std::exchange(grads_clear_, false)) return;
  std::fill(grads_.begin(), grads_.end(), 0.0f);
}

void LocalModel::keep_owned_grads(const std::vector<optim::Range>& owned) {
  if (window_) return;  // the sync wrote the shard itself
  TRN_CHECK(!grads_compact_);
  size_t n = 0;
  for (const optim::Range& r : owned) n += r.size();
  owned_grads_.resize(n);
  size_t at = 0;
  for (const optim::Range& r : owned) {
    std::copy(grads_.begin() + ptrdiff_t(r.begin), grads_.begin() + ptrdiff_t(r.end), owned_grads_.begin() + ptrdiff_t(at));
    at += r.size();
  }
  release(grads_);
  grads_compact_ = true;
  grads_clear_ = false;
}

void LocalModel::shard_weights(const optim::ZeroPlan& plan, std::shared_ptr<Communicator> comm, int prefetch) {
  TRN_CHECK(!sharded_);
  sharded_ = std::make_unique<ShardedWeights>(layout_, plan, std::move(comm), threads(), prefetch);
  sharded_->keep_owned(params_.data());
  release(params_);
  bf16_.release();
  bf16_stale_ = true;
}

std::vector<float> LocalModel::whole_params() const {
  if (!sharded_) return std::vector<float>(params_.begin(), params_.end());
  std::vector<float> whole(layout_.total());
  sharded_->gather_whole(whole.data());
  return whole;
}


WeightView<float> LocalModel::weights_for_forward() {
  TRN_CHECK(!sharded_);
  const float* p = params_.data();
  if (bf16_stale_) {
    bf16_.refresh(p, &pool_);  // elementwise: the thread count does not change it
    bf16_stale_ = false;
  }
  WeightView<float> w = WeightView<float>::whole(p, layout_.total());
  if (const kernels::Bf16Src copy = bf16_.data()) w.add_bf16(0, layout_.total(), copy);
  return w;
}

}  // namespace trn::model
