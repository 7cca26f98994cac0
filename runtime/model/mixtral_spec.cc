// Mixtral's specification (mixtral.h): presets, shape rules, and its tensors with their Hugging
// Face names, tensor-parallel shards and initialisation; Llama's (llama.h) but for the MLP.
#include <fmt/format.h>

#include <array>
#include <cmath>
#include <memory>
#include <string>

#include "collectives/core/error.h"
#include "runtime/model/layers/moe.h"
#include "runtime/model/mixtral.h"

namespace trn::model {
namespace {

void validate(const Config& c) {
  llama_validate(c);
  if (c.n_experts < 1 || c.n_experts > 1024)
    throw usage_error("--n-experts {} must be between 1 and 1024", c.n_experts);
  if (c.top_k < 1 || c.top_k > c.n_experts)
    throw usage_error("--top-k {} must be between 1 and --n-experts {}", c.top_k, c.n_experts);
  if (!(c.capacity_factor >= 0) || !std::isfinite(c.capacity_factor))
    throw usage_error("--capacity-factor {} must be 0 (dropless) or positive", c.capacity_factor);
  if (!(c.moe_aux_coef >= 0) || !std::isfinite(c.moe_aux_coef))
    throw usage_error("--moe-aux-coef {} must be 0 or positive", c.moe_aux_coef);
  if (!(c.moe_bias_rate >= 0) || !std::isfinite(c.moe_bias_rate))
    throw usage_error("--moe-bias-rate {} must be 0 or positive", c.moe_bias_rate);
}

size_t weight(TensorSpec& t, double std = 0.02) {
  t.init_std = std;
  t.matmul = true;
  return t.offset;
}

// The MoE layer's tensors in Hugging Face MixtralForCausalLM's names: this rank's experts (its
// expert-parallel share, each split by tp like a dense MLP: w1 and w3 by rows, w2 by columns),
// w2 then w1 and w3 adjacent (one product computes [gate | up]), then the router, replicated.
// Returns the offsets of the first expert's w2, w1 and w3 (the others follow at a fixed stride,
// mixtral_block.cc), and sets router and (Config::moe_bias) the balancing bias, DeepSeek-V3's name.
std::array<size_t, 3> add_experts(ParamLayout& lay, const std::string& n, size_t& router, size_t& bias) {
  const Config& c = lay.config();
  const int64_t C = c.d_model, r = lay.placement().tp_rank, Fl = lay.local_mlp(), F = c.ffn();
  const double proj = 0.02 / std::sqrt(2.0 * c.n_layer);
  const int first = lay.first_expert(), El = lay.local_experts();
  std::array<size_t, 3> at{};
  for (int e = first; e < first + El; ++e) {
    const std::string x = fmt::format("{}block_sparse_moe.experts.{}.", n, e);
    auto expert = [](TensorSpec& t) -> TensorSpec& {
      t.expert = true;
      return t;
    };
    const size_t w2 = weight(expert(lay.add(x + "w2.weight", {C, F}, 1, r * Fl, Fl)), proj);
    const size_t w1 = weight(expert(lay.add(x + "w1.weight", {F, C}, 0, r * Fl, Fl)));
    const size_t w3 = weight(expert(lay.add(x + "w3.weight", {F, C}, 0, r * Fl, Fl)));
    if (e == first) at = {w2, w1, w3};
  }
  router = weight(lay.add(n + "block_sparse_moe.gate.weight", {c.n_experts, C}));
  if (c.moe_bias) {  // no gradient reaches it, so the optimizer leaves it alone
    TensorSpec& b = lay.add(n + "block_sparse_moe.gate.e_score_correction_bias", {c.n_experts});
    b.init = TensorSpec::Init::kZeros;
    bias = b.offset;
  }
  return at;
}

// In the order backward finishes them (mixtral_offsets reads them back in this order): the
// experts and the router (their first expert's offsets where Llama's down, gate and up are),
// llama_add_attention's, then the router's and the bias's offsets.
void add_block(ParamLayout& lay, int l) {
  std::vector<size_t>& at = lay.blocks[l].at;
  at.clear();
  size_t router = 0, bias = 0;
  const std::array<size_t, 3> experts = add_experts(lay, fmt::format("model.layers.{}.", l), router, bias);
  at.insert(at.end(), experts.begin(), experts.end());
  llama_add_attention(lay, l, at);
  at.push_back(router);
  at.push_back(bias);
}

// By the active parameters: a token runs top_k experts' MLPs and the router.
double flops(const Config& c, int seq_len) {
  const double C = c.d_model;
  return llama_flops(c, seq_len, c.top_k * 3.0 * C * c.ffn() + C * c.n_experts);
}

Config shape(int n_layer, int n_head, int n_kv_head, int d_model, int ffn_dim, int ctx, int vocab, double theta,
             int experts, int k, bool norm_topk) {
  Config c = llama_shape(n_layer, n_head, n_kv_head, d_model, ffn_dim, ctx, vocab, theta, false);
  c.arch = "mixtral";
  c.n_experts = experts;
  c.top_k = k;
  c.moe_norm_topk = norm_topk;
  return c;
}

}  // namespace

MixtralOffsets mixtral_offsets(const ParamLayout& lay, int layer) {
  const auto& a = lay.blocks[layer].at;
  return {llama_offsets(lay, layer), a[10], a[11]};
}

const Family& mixtral_family() {
  static const Family f{
      "mixtral",
      {{"mixtral-tiny", shape(2, 4, 2, 64, 96, 128, 256, 10000.0, 4, 2, true),
        "Mixtral 2 layers, 4 heads (2 KV), d_model 64, 4 experts of ffn 96, top-2, vocab 256"},
       {"moe-small", shape(4, 8, 8, 256, 256, 256, 256, 10000.0, 16, 4, false),
        "an OLMoE-like MoE scaled down: 4 layers, 8 heads, d_model 256, 16 experts of ffn 256, top-4 without "
        "renormalisation, vocab 256"},
       {"mixtral-8x7b", shape(32, 32, 8, 4096, 14336, 32768, 32000, 1000000.0, 8, 2, true),
        "Mixtral-8x7B's shape: 32 layers, 32 heads (8 KV), d_model 4096, 8 experts of ffn 14336, top-2, vocab 32000"},
       {"olmoe-1b-7b", shape(16, 16, 16, 2048, 1024, 4096, 50304, 10000.0, 64, 8, false),
        "OLMoE-1B-7B's shape: 16 layers, 16 heads, d_model 2048, 64 experts of ffn 1024, top-8, vocab 50304 (no "
        "q/k norms)"},
       {"qwen3-30b-a3b", shape(48, 32, 4, 2048, 768, 40960, 151936, 1000000.0, 128, 8, true),
        "Qwen3-30B-A3B's shape: 48 layers, 32 heads (4 KV) of 128, d_model 2048, 128 experts of ffn 768, top-8, "
        "vocab 151936 (no q/k norms)"}},
      {"n_layer", "n_head", "n_kv_head", "d_model", "ffn_dim", "ctx", "vocab", "rope_theta", "norm_eps",
       "tie_embeddings", "n_experts", "top_k", "moe_norm_topk"},
      {"head_dim", "moe_bias"},
      &validate,
      &llama_check_tp,
      &llama_add_head,
      &add_block,
      &llama_add_embedding,
      &flops,
      &mixtral_block_counts,
      mixtral_stage_f(),
      mixtral_stage_d(),
      &make_mixtral_decoder,
      MoeMlp::kRefusals,
  };
  return f;
}

}  // namespace trn::model
