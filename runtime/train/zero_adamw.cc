#include "runtime/train/zero_adamw.h"

#include <fmt/format.h>

#include "collectives/core/error.h"

namespace trn::train {

ZeroAdamW::ZeroAdamW(const model::ParamLayout& layout, optim::AdamWConfig cfg, ZeroSync& sync,
                     std::shared_ptr<Communicator> model_parallel, int stage)
    : optim::AdamW(layout, cfg, sync.owned()), sync_(sync), norm_{sync.pieces(), std::move(model_parallel)}, stage_(stage) {
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
  return fmt::format("{}; ZeRO-{} over {} data-parallel ranks{}{}", optim::AdamW::describe(), stage_, sync_.size(),
                     sync_.replicas() > 1 ? fmt::format(", replicated over {} shard groups", sync_.replicas()) : "",
                     stage_ == 3   ? " (gradients and fp32 weights sharded too)"
                     : stage_ == 2 ? " (gradients sharded too)"
                                   : "");
}

}  // namespace trn::train
