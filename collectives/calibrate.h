// Agreeing on the cost model's parameters (collectives/cost_model.h). Every rank must pick the
// same all-reduce algorithm for the same call, so the parameters are made identical on all
// ranks of a world: each rank proposes its own (from its transport, or measured), and all take
// the element-wise maximum.
//
// Measuring (CommOptions::measure) times a few barriers (alpha), a 1 MiB exchange with the ring
// neighbours (beta) and a 1 MiB reduction (gamma) at construction. It is off by default: a
// measurement varies from run to run, and so would the algorithm choice and the bits of
// floating-point results, while the default keeps runs bit-reproducible.
#pragma once

#include "collectives/cost_model.h"

namespace trn {
namespace algo {
class Context;
}

// Runs on the communicator's thread as one collective operation; returns the agreed parameters.
CostParams agree_on_params(algo::Context& c, CostParams proposal, bool measure);

}  // namespace trn
