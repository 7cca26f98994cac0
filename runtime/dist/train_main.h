// trn-train's body: one process, or one data-parallel worker of a job launched by trnrun,
// mpirun or srun (DESIGN.md layer 5). Joins the world, checks that the layout matches it,
// trains with bucketed gradient all-reduce overlapping backward, reports progress to the
// coordinator, and at the end checks that every rank holds bit-identical weights.
#pragma once

#include "runtime/train/options.h"

namespace trn::dist {

int train_main(const train::Options& opt);

}  // namespace trn::dist
