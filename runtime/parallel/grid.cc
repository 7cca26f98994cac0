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
  for (c.dp = 0; c.dp < dp; ++c.dp)
    for (c.cp = 0; c.cp < cp; ++c.cp) out.push_back(rank_of(c));
  return out;
}

std::vector<int> GridShape::cp_group(int rank) const {
  Coords c = coords_of(rank);
  std::vector<int> out;
  for (c.cp = 0; c.cp < cp; ++c.cp) out.push_back(rank_of(c));
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
  const int d = replica(coords_of(rank));
  std::vector<int> out;
  for (int r = 0; r < world(); ++r)
    if (replica(coords_of(r)) == d) out.push_back(r);
  return out;
}

std::string GridShape::describe() const {
  return fmt::format("dp {} x tp {} x pp {}{}", dp, tp, pp, cp > 1 ? fmt::format(" x cp {}", cp) : "");
}

void check_layout(const GridShape& g, int world) {
  const std::string cp = g.cp != 1 ? fmt::format(" --cp {}", g.cp) : "";
  if (g.dp < 1 || g.tp < 1 || g.pp < 1 || g.cp < 1)
    throw usage_error("--dp {} --tp {} --pp {}{}: every size must be at least 1", g.dp, g.tp, g.pp, cp);
  if (g.world() == world) return;
  // Suggest keeping tp, pp and cp when they divide the world, else pure data parallelism.
  std::string fix;
  if (world % (g.tp * g.pp * g.cp) == 0)
    fix = fmt::format("--dp {} --tp {} --pp {}{}", world / (g.tp * g.pp * g.cp), g.tp, g.pp, cp);
  else
    fix = fmt::format("--dp {} --tp 1 --pp 1", world);
  throw usage_error("--dp {} --tp {} --pp {}{} needs {} workers but the job has {}; use {} for {} "
                    "worker{}, or launch {} workers (trnrun --nproc-per-node {}, mpirun -np {})",
                    g.dp, g.tp, g.pp, cp, g.world(), world, fix, world, world == 1 ? "" : "s", g.world(),
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
  const int replica = shape_.replica(c);
  tp_ = group(shape_.tp_group(rank_), c.pp * shape_.replicas() + replica);
  dp_ = group(shape_.dp_group(rank_), c.pp * shape_.tp + c.tp);
  pp_ = group(shape_.pp_group(rank_), replica * shape_.tp + c.tp);
  embedding_ = group(shape_.embedding_group(rank_), replica * shape_.tp + c.tp);
  mp_ = group(shape_.model_parallel_group(rank_), replica);
  // Split last, so a grid without cp makes the same communicators, in the same order, as before.
  if (shape_.cp > 1) cp_ = group(shape_.cp_group(rank_), (c.pp * shape_.dp + c.dp) * shape_.tp + c.tp);
}

}  // namespace trn::parallel
