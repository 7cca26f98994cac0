#include "runtime/model/layers/moe_flags.h"

#include <fmt/format.h>

#include <algorithm>

#include "collectives/core/error.h"
#include "runtime/model/family.h"

namespace trn::model {

std::vector<flags::Flag> MoeFlags::table(const char* group) {
  using flags::Range;
  return {
      {"--n-experts", &n_experts, "experts per MoE layer (mixtral)", group, "E", "preset", Range::kPositive},
      {"--top-k", &top_k, "experts each token is routed to, at most --n-experts (mixtral)", group, "K", "preset",
       Range::kPositive},
      {"--moe-norm-topk", &norm_topk,
       "1: renormalise the top-k router weights to sum to 1 (Mixtral); 0: the raw probabilities (OLMoE)", group,
       "0|1", "preset", Range::kAny, 0, 0, "0|1"},
      {"--capacity-factor", &capacity_factor,
       "each expert takes at most ceil(F k seq_len / E) tokens per sequence, first choices first; the rest keep "
       "their residual (mixtral; 0: dropless)",
       group, "F", "0", Range::kNonNegative},
      {"--moe-aux-coef", &aux_coef,
       "coefficient of the per-sequence load-balancing loss added to the cross-entropy (mixtral)", group, "C",
       "0.01; 0 with --moe-balance bias", Range::kNonNegative},
      {"--moe-balance", &balance,
       "aux: the balancing loss; bias: DeepSeek-V3's per-expert bias on the router's logits for the choice, "
       "moved toward balance after each step (--moe-bias-rate), kept in the model (mixtral; an --init model's "
       "own setting wins)",
       group, "aux|bias", "aux", Range::kAny, 0, 0, "aux|bias"},
      {"--moe-bias-rate", &bias_rate,
       "--moe-balance bias: after each step every expert's bias moves by R x (mean load - its load) / mean load "
       "(mixtral)",
       group, "R", "0.15", Range::kNonNegative},
  };
}

void MoeFlags::apply(Config& c, bool from_file) const {
  if (n_experts || top_k) {
    const std::vector<std::string>& fields = family(c.arch).fields;
    if (std::find(fields.begin(), fields.end(), "n_experts") == fields.end()) {
      std::vector<std::string> with;
      for (const Family* f : families())
        if (std::find(f->fields.begin(), f->fields.end(), "n_experts") != f->fields.end()) with.push_back(f->name);
      throw usage_error("--n-experts and --top-k are {}'s (--arch {}): a {} block's MLP is dense",
                        fmt::join(with, " or "), fmt::join(with, " or --arch "), c.arch);
    }
  }
  if (n_experts) c.n_experts = n_experts;
  if (top_k) c.top_k = top_k;
  if (norm_topk >= 0) c.moe_norm_topk = norm_topk == 1;
  if (!from_file) c.moe_bias = balance == "bias";
  c.capacity_factor = capacity_factor;
  c.moe_bias_rate = bias_rate;
  c.moe_aux_coef = aux_coef >= 0 ? aux_coef : c.moe_bias ? 0.0 : 0.01;
}

}  // namespace trn::model
