// Whole tensors from shards: what --save writes whatever the layout (files stay the
// interoperability contract, DESIGN.md).
#pragma once

#include <memory>
#include <vector>

#include "runtime/model/config.h"
#include "runtime/parallel/grid.h"

namespace trn {
class Communicator;
}

namespace trn::parallel {

// The whole model's parameter buffer assembled from every rank of mp, the model-parallel group
// (the tp and pp ranks of one data-parallel replica; null: this rank holds everything): each
// rank writes its slices into a zero buffer, a tensor replicated over tp from tp rank 0 only and
// the tied wte from the first stage only, and a sum over mp then adds each element to zeros
// once, exactly. Under expert parallelism mp also holds the other expert ranks (ep_rank: this
// rank's), which give only their experts. Collective over mp; every member gets the result.
std::vector<float> gather_whole(const model::ParamLayout& local, const float* params, const Coords& me,
                                const std::shared_ptr<Communicator>& mp, int ep_rank = 0);

}  // namespace trn::parallel
