#include "runtime/train/zero_adamw.h"

#include <fmt/format.h>

#include "collectives/core/error.h"

namespace trn::train {

ZeroAdamW::ZeroAdamW(const model::ParamLayout& layout, optim::AdamWConfig cfg, ZeroSync& sync,
                     std::shared_ptr<Communicator> model_parallel)
    : optim::AdamW(layout, cfg, sync.owned()), sync_(sync), norm_{sync.pieces(), std::move(model_parallel)} {
  TRN_CHECK(sync_.plan().size() == layout.total());
}

double ZeroAdamW::grad_norm(const float* grads, ThreadPool& pool) {
  // The same piece sums, added in the same order, as AdamW's: only the averaged shard is here.
  return optim::global_norm(norm_, sync_.piece_sums(grads, pool, grads_storage()));
}

void ZeroAdamW::update(float* params, float* grads, double grad_norm, float lr, ThreadPool& pool) {
  optim::AdamW::update(params, grads, grad_norm, lr, pool);
  // Compact parameters are only the owned shard: there is no whole buffer to gather into.
  if (params_storage() == optim::Storage::kWhole) sync_.gather_params(params);
}

std::string ZeroAdamW::describe() const {
  return fmt::format("{}; ZeRO-1 over {} data-parallel ranks", optim::AdamW::describe(), sync_.size());
}

}  // namespace trn::train
