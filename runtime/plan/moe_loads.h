// A mixture of experts' measured routing, for the planner's expert-parallel terms.
//
// On balanced routing an expert-parallel rank runs as many expert rows as with the experts whole
// (N x k for its N tokens). Routing is not balanced: a layer's busiest ep rank runs more, the
// others wait for it inside the exchange that returns its rows, and it keeps more rows (its
// grouped activations and scratch grow to the largest count seen; runtime/model/layers/moe.h).
// The loads come from a run's metrics (trn-train --metrics-moe-loads): each step's kept choices
// per expert of every layer over the global batch. They do not depend on the layout (any layout
// trains as one process does), so one run with the experts whole gives the busiest rank of every
// ep: rank r holds experts [r E / ep, (r + 1) E / ep) (MoeMlp::first).
#pragma once

#include <array>
#include <map>
#include <string>
#include <vector>

namespace trn::plan {

struct MoeLoads {
  std::string source;  // the file read ("" : none, routing taken as balanced)
  // steps[s][l][e]: step s's kept choices of expert e in layer l.
  std::vector<std::vector<std::vector<double>>> steps;

  // The busiest ep rank's rows over the mean rank's (1: balanced, at most ep), for a layer of a
  // step. time: the mean over steps and layers (every layer's exchange waits for its busiest
  // rank). peak: per layer the largest over the steps, then the mean over layers (each layer's
  // rows keep the largest count seen).
  double busiest(int ep, bool peak) const;
  // The largest over the layers and the steps: what a buffer one stage shares between its
  // layers grows to.
  double busiest_anywhere(int ep) const;
  bool empty() const { return steps.empty(); }

  // The "moe_loads" of path's metrics lines, for n_layer layers of n_experts: a usage error that
  // names the file when it has none or their shape differs.
  static MoeLoads read(const std::string& path, int n_layer, int n_experts);

 private:
  // read()'s answers for every ep dividing the experts (a search asks for each layout):
  // ep -> {time, peak, anywhere}.
  std::map<int, std::array<double, 3>> known_;
  std::array<double, 3> compute(int ep) const;
  std::array<double, 3> answers(int ep) const;  // known_'s, else computed
};

}  // namespace trn::plan
