// The MoE layer's flags (layers/moe.h), its own option group: the shape of its experts
// (--n-experts, --top-k, --moe-norm-topk: Config fields of a family with MoE blocks, listed in
// its Family::fields) and how it trains (--capacity-factor, --moe-aux-coef, --moe-balance,
// --moe-bias-rate). trn-train's options (runtime/train/options.cc) list them in its model group
// and apply them after the preset (or --init file), so they are parsed, shown in --help and
// checked here, by the layer, not by the options.
#pragma once

#include <string>
#include <vector>

#include "collectives/core/flags.h"
#include "runtime/model/config.h"

namespace trn::model {

struct MoeFlags {
  int n_experts = 0, top_k = 0, norm_topk = -1;  // 0 and -1: the preset's (or the --init model's)
  // The layer's training settings (not shape: an --init file's model takes them too).
  double capacity_factor = 0, aux_coef = -1;  // -1: 0.01, or 0 under --moe-balance bias
  double bias_rate = 0.15;
  std::string balance = "aux";

  // The rows of a flags::Table (in `group`) that set these members.
  std::vector<flags::Flag> table(const char* group);
  // Sets c's MoE fields from the flags. from_file: c is an --init file's model, whose balancing
  // (moe_bias, a tensor of the model) wins over --moe-balance. A usage error for --n-experts or
  // --top-k on a family whose blocks have no experts (no "n_experts" in its Family::fields).
  void apply(Config& c, bool from_file) const;
};

}  // namespace trn::model
