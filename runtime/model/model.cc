#include "runtime/model/model.h"

#include <algorithm>

namespace trn::model {

LocalModel::LocalModel(const Config& c, const Placement& placement, int threads)
    : layout_(c, placement), pool_(std::max(threads, 1)), bf16_(layout_) {
  params_.assign(layout_.total(), 0.0f);
  grads_.assign(layout_.total(), 0.0f);
}

void LocalModel::init(uint64_t seed) { init_params(layout_, seed, params()); }

void LocalModel::zero_grad() { std::fill(grads_.begin(), grads_.end(), 0.0f); }

WeightView<float> LocalModel::weights_for_forward() {
  if (bf16_stale_) {
    bf16_.refresh(params_.data(), &pool_);  // elementwise: the thread count does not change it
    bf16_stale_ = false;
  }
  WeightView<float> w = WeightView<float>::whole(params_.data(), params_.size());
  if (const kernels::Bf16Src copy = bf16_.data()) w.add_bf16(0, params_.size(), copy);
  return w;
}

}  // namespace trn::model
