// Whole tensors from shards: what --save writes whatever the layout (files stay the
// interoperability contract, DESIGN.md).
#pragma once

#include <memory>
#include <vector>

#include "runtime/model/config.h"

namespace trn {
class Communicator;
}

namespace trn::parallel {

// The whole model's parameter buffer (ParamLayout(config) order) assembled from the tensor-
// parallel shards `local` of every rank of tp (null: this rank holds the whole model). Collective
// over tp; every member gets the result.
std::vector<float> gather_tensor_parallel(const model::ParamLayout& local, const float* params,
                                          const std::shared_ptr<Communicator>& tp);

}  // namespace trn::parallel
