#include "runtime/parallel/grid.h"

#include <fmt/format.h>

#include "collectives/communicator.h"
#include "collectives/core/error.h"

namespace trn::parallel {

std::vector<int> GridShape::tp_group(int rank) const {
  Coords c = coords_of(rank);
  std::vector<int> out;
  for (c.tp = 0; c.tp < tp; ++c.tp) out.push_back(rank_of(c));
  return out;
}

std::vector<int> GridShape::dp_group(int rank) const {
  Coords c = coords_of(rank);
  std::vector<int> out;
  for (c.dp = 0; c.dp < dp; ++c.dp) out.push_back(rank_of(c));
  return out;
}

std::vector<int> GridShape::pp_group(int rank) const {
  Coords c = coords_of(rank);
  std::vector<int> out;
  for (c.pp = 0; c.pp < pp; ++c.pp) out.push_back(rank_of(c));
  return out;
}

std::vector<int> GridShape::embedding_group(int rank) const {
  Coords c = coords_of(rank);
  if (c.pp != 0 && c.pp != pp - 1) return {};
  c.pp = 0;
  std::vector<int> out{rank_of(c)};
  if (pp > 1) {
    c.pp = pp - 1;
    out.push_back(rank_of(c));
  }
  return out;
}

std::vector<int> GridShape::model_parallel_group(int rank) const {
  const int d = coords_of(rank).dp;
  std::vector<int> out;
  for (int r = 0; r < world(); ++r)
    if (coords_of(r).dp == d) out.push_back(r);
  return out;
}

std::string GridShape::describe() const { return fmt::format("dp {} x tp {} x pp {}", dp, tp, pp); }

void check_layout(const GridShape& g, int world) {
  if (g.dp < 1 || g.tp < 1 || g.pp < 1)
    throw usage_error("--dp {} --tp {} --pp {}: every size must be at least 1", g.dp, g.tp, g.pp);
  if (g.world() == world) return;
  // Suggest keeping tp and pp when they divide the world, else pure data parallelism.
  std::string fix;
  if (world % (g.tp * g.pp) == 0)
    fix = fmt::format("--dp {} --tp {} --pp {}", world / (g.tp * g.pp), g.tp, g.pp);
  else
    fix = fmt::format("--dp {} --tp 1 --pp 1", world);
  throw usage_error("--dp {} --tp {} --pp {} needs {} workers but the job has {}; use {} for {} "
                    "worker{}, or launch {} workers (trnrun --nproc-per-node {}, mpirun -np {})",
                    g.dp, g.tp, g.pp, g.world(), world, fix, world, world == 1 ? "" : "s", g.world(),
                    g.world(), g.world());
}

ProcessGrid::ProcessGrid(std::shared_ptr<Communicator> world, GridShape shape)
    : shape_(shape), world_(std::move(world)) {
  const int n = world_ ? world_->size() : 1;
  check_layout(shape_, n);
  rank_ = world_ ? world_->rank() : 0;
  coords_ = shape_.coords_of(rank_);
  if (!world_) return;
  // Every rank splits in the same order. A group of one gets no communicator (color -1 would
  // still join the split; the result is simply dropped).
  auto group = [&](const std::vector<int>& members, int color) -> std::shared_ptr<Communicator> {
    auto c = world_->split(members.empty() ? -1 : color, rank_);
    return members.size() > 1 ? c : nullptr;
  };
  const Coords& c = coords_;
  tp_ = group(shape_.tp_group(rank_), c.pp * shape_.dp + c.dp);
  dp_ = group(shape_.dp_group(rank_), c.pp * shape_.tp + c.tp);
  pp_ = group(shape_.pp_group(rank_), c.dp * shape_.tp + c.tp);
  embedding_ = group(shape_.embedding_group(rank_), c.dp * shape_.tp + c.tp);
  mp_ = group(shape_.model_parallel_group(rank_), c.dp);
}

}  // namespace trn::parallel
