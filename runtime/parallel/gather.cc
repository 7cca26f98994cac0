#include "runtime/parallel/gather.h"

#include "collectives/communicator.h"
#include "collectives/core/aligned.h"
#include "collectives/core/error.h"

namespace trn::parallel {

std::vector<float> gather_whole(const model::ParamLayout& local, const float* params, const Coords& me,
                                const std::shared_ptr<Communicator>& mp, int ep_rank) {
  const model::ParamLayout full(local.config());
  AlignedVector<float> out(full.total(), 0.0f);
  for (const model::TensorSpec& t : local.tensors()) {
    if (t.replicated() && me.tp != 0) continue;
    if (t.tied && me.pp != 0) continue;
    if (!t.expert && ep_rank != 0) continue;
    model::copy_to_global(t, params + t.offset, out.data() + full.find(t.name).offset);
  }
  if (mp) mp->all_reduce(out.data(), out.data(), out.size(), DataType::kF32, ReduceOp::kSum)->wait();
  return std::vector<float>(out.begin(), out.end());
}

}  // namespace trn::parallel
