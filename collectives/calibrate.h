// Agreeing on the cost model's parameters (collectives/cost_model.h). Every rank must pick the
// same all-reduce algorithm for the same call, so the parameters are made identical on all
// ranks of a world: each rank proposes its own (from its transport, or measured), and all take
// the element-wise maximum.
//
// Measuring (CommOptions::measure) times a few barriers (alpha), a 1 MiB exchange with the ring
// neighbours (beta) and a 1 MiB reduction (gamma) at construction: among each host's ranks for
// the intra-host parameters, and among the first rank of every host for the inter-host ones
// (one rank per host, so the figure is the host link's, not a share of it). It is off by default: a
// measurement varies from run to run, and so would the algorithm choice and the bits of
// floating-point results, while the default keeps runs bit-reproducible.
#pragma once

#include <vector>

#include "collectives/cost_model.h"

namespace trn {
namespace algo {
class Context;
}

// Runs on the communicator's thread as one collective operation; returns the agreed parameters.
// host_of names each member's host; ranks that disagree on the layout it gives fail with a
// usage error (every rank must make the same choices).
CostModel agree_on_params(algo::Context& c, CostModel proposal, bool measure, const std::vector<int>& host_of);

}  // namespace trn
