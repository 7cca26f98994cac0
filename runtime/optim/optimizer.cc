#include "runtime/optim/optimizer.h"

namespace trn::optim {

std::vector<float> Optimizer::kept_params(const float* params, size_t n) const {
  const std::vector<Range>* kept = shard();
  if (!kept) return std::vector<float>(params, params + n);
  std::vector<float> out;
  for (const Range& r : *kept) out.insert(out.end(), params + r.begin, params + r.end);
  return out;
}

}  // namespace trn::optim
