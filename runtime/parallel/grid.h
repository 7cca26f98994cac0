// The process grid of a parallel job (DESIGN.md "Process grid"): world = dp * cp * tp * pp and
//
//   rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank
//
// so a tensor-parallel group is tp consecutive ranks (one node, the fastest links), a
// context-parallel group (one sequence's chunks) strides by tp and stays on a node when cp x tp
// fits, a data-parallel group strides by tp x cp, and the pipeline is outermost. The dp x cp ranks
// of equal (tp, pp) hold the same weights: they are the gradients' group (dp(), "replicas"),
// member dp_rank * cp + cp_rank. GridShape is pure rank arithmetic (unit-tested without a
// network); ProcessGrid makes the communicators with split().
//
//   trn::parallel::ProcessGrid grid(world_comm, {.dp = 2, .tp = 2, .pp = 1});
//   grid.tp()->all_reduce(...);     // the ranks holding the other shards of this rank's tensors
//   grid.dp()->all_reduce(...);     // the ranks holding the same shards (gradient averaging)
//   grid.cp()                       // the ranks holding the other chunks of this rank's sequences
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace trn {
class Communicator;
}

namespace trn::parallel {

struct Coords {
  int dp = 0, tp = 0, pp = 0, cp = 0;
  bool operator==(const Coords&) const = default;
};

struct GridShape {
  int dp = 1, tp = 1, pp = 1, cp = 1;

  int world() const { return dp * cp * tp * pp; }
  int rank_of(Coords c) const { return ((c.pp * dp + c.dp) * cp + c.cp) * tp + c.tp; }
  Coords coords_of(int rank) const {
    return {(rank / (tp * cp)) % dp, rank % tp, rank / (tp * cp * dp), (rank / tp) % cp};
  }
  // The ranks that hold the same weights (dp x cp) and a rank's place among them.
  int replicas() const { return dp * cp; }
  int replica(Coords c) const { return c.dp * cp + c.cp; }
  // World ranks of each group that `rank` belongs to, in group rank order. dp_group is the
  // replicas (dp x cp ranks, in replica() order); cp_group the context-parallel ranks.
  std::vector<int> tp_group(int rank) const;
  std::vector<int> dp_group(int rank) const;
  std::vector<int> cp_group(int rank) const;
  std::vector<int> pp_group(int rank) const;
  // The ranks of the first and the last pipeline stage with this rank's (dp, tp) coordinates:
  // they share the tied embedding. One rank when pp == 1; empty for a middle stage.
  std::vector<int> embedding_group(int rank) const;
  // Every tp and pp rank of this rank's replica (the ranks holding one whole model between them;
  // equal dp and cp), in rank order.
  std::vector<int> model_parallel_group(int rank) const;
  std::string describe() const;  // "dp 2 x tp 2 x pp 1", with " x cp 2" when cp > 1
};

// Throws a usage error naming the values and a layout that works when (dp, tp, pp, cp) does not fit
// a world of `world` ranks.
void check_layout(const GridShape& g, int world);

// The communicators of one rank's groups, split from the world communicator (collective over
// it: every rank constructs its grid at the same point). With a world of one, every group is
// null (the rank is alone in each).
class ProcessGrid {
 public:
  ProcessGrid(std::shared_ptr<Communicator> world, GridShape shape);

  const GridShape& shape() const { return shape_; }
  const Coords& coords() const { return coords_; }
  int rank() const { return rank_; }
  // Null when the group has one member.
  const std::shared_ptr<Communicator>& world() const { return world_; }
  const std::shared_ptr<Communicator>& tp() const { return tp_; }
  const std::shared_ptr<Communicator>& dp() const { return dp_; }
  const std::shared_ptr<Communicator>& pp() const { return pp_; }
  const std::shared_ptr<Communicator>& cp() const { return cp_; }
  const std::shared_ptr<Communicator>& embedding() const { return embedding_; }
  const std::shared_ptr<Communicator>& model_parallel() const { return mp_; }

 private:
  GridShape shape_;
  Coords coords_;
  int rank_ = 0;
  std::shared_ptr<Communicator> world_, tp_, dp_, pp_, cp_, embedding_, mp_;
};

}  // namespace trn::parallel
