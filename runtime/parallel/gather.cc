#include "runtime/parallel/gather.h"

#include "collectives/communicator.h"
#include "collectives/core/aligned.h"
#include "collectives/core/error.h"

namespace trn::parallel {

std::vector<float> gather_tensor_parallel(const model::ParamLayout& local, const float* params,
                                          const std::shared_ptr<Communicator>& tp) {
  const model::ParamLayout full(local.config());
  std::vector<float> out(full.total(), 0.0f);
  const int n = tp ? tp->size() : 1;
  if (n != local.placement().tp)
    throw internal_error("gather: a tensor-parallel group of {} for a shard of {}", n, local.placement().tp);
  // Every shard of one layout has the same size, so one all-gather carries them all.
  AlignedVector<float> shards(local.total() * size_t(n));
  if (tp) tp->all_gather(params, shards.data(), local.total(), DataType::kF32)->wait();
  else std::copy(params, params + local.total(), shards.begin());
  for (int r = 0; r < n; ++r) {
    model::Placement p = local.placement();
    p.tp_rank = r;
    const model::ParamLayout shard(local.config(), p);
    const float* src = shards.data() + local.total() * size_t(r);
    for (const model::TensorSpec& t : shard.tensors())
      model::copy_to_global(t, src + t.offset, out.data() + full.find(t.name).offset);
  }
  return out;
}

std::vector<float> gather_whole(const model::ParamLayout& local, const float* params, const Coords& me,
                                const std::shared_ptr<Communicator>& mp) {
  const model::ParamLayout full(local.config());
  AlignedVector<float> out(full.total(), 0.0f);
  for (const model::TensorSpec& t : local.tensors()) {
    if (t.replicated() && me.tp != 0) continue;
    if (t.name == "wte.weight" && me.pp != 0) continue;
    model::copy_to_global(t, params + t.offset, out.data() + full.find(t.name).offset);
  }
  if (mp) mp->all_reduce(out.data(), out.data(), out.size(), DataType::kF32, ReduceOp::kSum)->wait();
  return std::vector<float>(out.begin(), out.end());
}

}  // namespace trn::parallel
