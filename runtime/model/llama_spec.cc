// Llama's specification: presets, shape rules, and its tensors with their Hugging Face names,
// tensor-parallel shards and initialisation (llama.h).
#include <fmt/format.h>

#include <array>
#include <cmath>
#include <memory>
#include <string>

#include "collectives/core/error.h"
#include "runtime/model/layers/params.h"
#include "runtime/model/llama.h"

namespace trn::model {
namespace {

void validate(const Config& c) {
  const int kv = c.kv_heads();
  if (c.n_kv_head < 0 || c.n_head % kv != 0)
    throw usage_error("--n-kv-head {} must divide --n-head {}: each KV head serves a whole group of query heads",
                      c.n_kv_head, c.n_head);
  if (c.head_dim() % 2 != 0) {
    if (c.head_size > 0) throw usage_error("head_dim {}: rotary embeddings need an even head size", c.head_size);
    throw usage_error("--d-model {} / --n-head {} gives a head size of {}; rotary embeddings need an even one",
                      c.d_model, c.n_head, c.head_dim());
  }
  if (c.rope_factor != 0) {
    if (!(c.rope_factor >= 1) || !std::isfinite(c.rope_factor))
      throw usage_error("rope scaling factor {} must be at least 1", c.rope_factor);
    if (!(c.rope_high_freq_factor > c.rope_low_freq_factor) || !(c.rope_low_freq_factor > 0))
      throw usage_error("rope scaling needs high_freq_factor {} above low_freq_factor {} above 0",
                        c.rope_high_freq_factor, c.rope_low_freq_factor);
    if (c.rope_original_ctx < 1)
      throw usage_error("rope scaling's original_max_position_embeddings {} must be at least 1", c.rope_original_ctx);
  }
  if (c.ffn_dim < 0 || c.ffn_dim > (1 << 18))
    throw usage_error("--ffn-dim {} must be between 1 and {}", c.ffn_dim, 1 << 18);
  if (!(c.rope_theta > 0) || !std::isfinite(c.rope_theta))
    throw usage_error("--rope-theta {} must be a positive number", c.rope_theta);
  if (!(c.norm_eps > 0) || !(c.norm_eps < 1)) throw usage_error("--norm-eps {} must be in (0, 1)", c.norm_eps);
  if (c.arch == "llama" && (c.n_experts != 0 || c.top_k != 0))
    throw usage_error("--n-experts and --top-k are mixtral's (--arch mixtral): a llama block's MLP is dense");
}

void validate_moe(const Config& c) {
  validate(c);
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

void check_tp(const Config& c, int tp) {
  const int kv = c.kv_heads();
  if (kv % tp == 0 && c.ffn() % tp == 0) return;
  std::string fits;
  for (int t = 1; t <= kv; ++t)
    if (kv % t == 0 && c.ffn() % t == 0) fits += (fits.empty() ? "" : ", ") + std::to_string(t);
  if (kv % tp != 0)
    throw usage_error("--tp {} does not divide n_kv_head {} (n_head {}): each tensor-parallel rank holds whole KV "
                      "heads and their query heads; use --tp one of {}",
                      tp, kv, c.n_head, fits);
  throw usage_error("--tp {} does not divide ffn_dim {}: each tensor-parallel rank holds an equal slice of the MLP; "
                    "use --tp one of {}",
                    tp, c.ffn(), fits);
}

size_t ones(TensorSpec& t) {
  t.init = TensorSpec::Init::kOnes;
  return t.offset;
}
size_t weight(TensorSpec& t, double std = 0.02) {
  t.init_std = std;
  t.matmul = true;
  return t.offset;
}

// model.norm, then an untied lm_head: both are final once the head's backward ran.
void add_head(ParamLayout& lay) {
  const Config& c = lay.config();
  const int64_t C = c.d_model, rows = lay.local_vocab();
  lay.final_norm = {ones(lay.add("model.norm.weight", {C}))};
  if (!c.tie_embeddings)
    lay.head = weight(lay.add("lm_head.weight", {c.vocab, C}, 0, lay.placement().tp_rank * rows, rows));
}

// The MoE layer's tensors in Hugging Face MixtralForCausalLM's names: this rank's experts (its
// expert-parallel share, each split by tp like a dense MLP: w1 and w3 by rows, w2 by columns),
// w2 then w1 and w3 adjacent (one product computes [gate | up]), then the router, replicated.
// Returns the offsets of the first expert's w2, w1 and w3 (the others follow at a fixed stride,
// llama_offsets), and sets router and (Config::moe_bias) the balancing bias, DeepSeek-V3's name.
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

// In the order backward finishes them (llama_offsets reads them back in this order): down_proj,
// gate and up (or the experts and the router), post_attention_layernorm, o_proj, q, k and v,
// (their biases,) input_layernorm. nn.Linear weights are [out, in].
void add_block(ParamLayout& lay, int l) {
  const Config& c = lay.config();
  const int64_t C = c.d_model, hd = c.head_dim();
  const int64_t Ca = lay.local_attn(), Ckv = int64_t(lay.local_kv_heads()) * hd, Fl = lay.local_mlp();
  const int64_t F = c.ffn(), H = c.n_head, K = c.kv_heads();
  const double proj = 0.02 / std::sqrt(2.0 * c.n_layer);
  const std::string n = fmt::format("model.layers.{}.", l);
  const auto oi = Orientation::kOutIn;
  std::vector<size_t>& at = lay.blocks[l].at;
  at.clear();
  size_t router = 0, bias = 0;
  if (c.moe()) {
    const std::array<size_t, 3> experts = add_experts(lay, n, router, bias);
    at.insert(at.end(), experts.begin(), experts.end());
  } else {
    at.push_back(add_linear_weight(lay, n + "mlp.down_proj.weight", oi, F, C, Split::kRow, Fl, proj));
    at.push_back(add_linear_weight(lay, n + "mlp.gate_proj.weight", oi, C, F, Split::kColumn, Fl));
    at.push_back(add_linear_weight(lay, n + "mlp.up_proj.weight", oi, C, F, Split::kColumn, Fl));
  }
  at.push_back(add_norm(lay, NormKind::kRMSNorm, n + "post_attention_layernorm.weight", "", C).first);
  at.push_back(add_linear_weight(lay, n + "self_attn.o_proj.weight", oi, H * hd, C, Split::kRow, Ca, proj));
  // By heads: each rank's query heads and the KV heads they share.
  at.push_back(add_linear_weight(lay, n + "self_attn.q_proj.weight", oi, C, H * hd, Split::kColumn, Ca));
  at.push_back(add_linear_weight(lay, n + "self_attn.k_proj.weight", oi, C, K * hd, Split::kColumn, Ckv));
  at.push_back(add_linear_weight(lay, n + "self_attn.v_proj.weight", oi, C, K * hd, Split::kColumn, Ckv));
  // Qwen2's q, k and v biases (zeros at initialisation, as Hugging Face initialises them), by
  // heads like their weights; adjacent, so one pass adds them to the fused q, k, v rows.
  size_t qkv_bias = 0;
  if (c.qkv_bias) {
    qkv_bias = add_linear_bias(lay, n + "self_attn.q_proj.bias", H * hd, Split::kColumn, Ca);
    add_linear_bias(lay, n + "self_attn.k_proj.bias", K * hd, Split::kColumn, Ckv);
    add_linear_bias(lay, n + "self_attn.v_proj.bias", K * hd, Split::kColumn, Ckv);
  }
  at.push_back(qkv_bias);
  at.push_back(add_norm(lay, NormKind::kRMSNorm, n + "input_layernorm.weight", "", C).first);
  at.push_back(router);
  at.push_back(bias);
}

// embed_tokens; tied, a last stage holds its own copy for the head (TensorSpec::tied).
void add_embedding(ParamLayout& lay, const Chunk& k) {
  const Config& c = lay.config();
  const bool tied = c.tie_embeddings;
  if (!k.embedding && !(tied && k.head)) return;
  const int64_t rows = lay.local_vocab();
  TensorSpec& t = lay.add("model.embed_tokens.weight", {c.vocab, c.d_model}, 0, lay.placement().tp_rank * rows, rows);
  t.tied = tied;
  lay.embedding = weight(t);
  if (tied) lay.head = lay.embedding;
}

// By the active parameters: a token runs top_k experts' MLPs and the router.
double flops(const Config& c, int seq_len) {
  const double C = c.d_model, L = c.n_layer, hd = c.head_dim();
  const double attn = C * hd * (2.0 * c.n_head + 2.0 * c.kv_heads());  // q, o and k, v
  const double mlp = c.moe() ? c.top_k * 3.0 * C * c.ffn() + C * c.n_experts : 3.0 * C * c.ffn();
  const double matmul_params = L * (attn + mlp) + double(c.vocab) * C;
  return 6.0 * matmul_params + 12.0 * L * seq_len * c.n_head * hd;
}

Config moe_shape(int n_layer, int n_head, int n_kv_head, int d_model, int ffn_dim, int ctx, int vocab,
                 double theta, int experts, int k, bool norm_topk);

Config shape(int n_layer, int n_head, int n_kv_head, int d_model, int ffn_dim, int ctx, int vocab, double theta,
             bool tied) {
  Config c{n_layer, n_head, d_model, ctx, vocab};
  c.arch = "llama";
  c.n_kv_head = n_kv_head;
  c.ffn_dim = ffn_dim;
  c.rope_theta = theta;
  c.norm_eps = 1e-5;
  c.tie_embeddings = tied;
  return c;
}

Config moe_shape(int n_layer, int n_head, int n_kv_head, int d_model, int ffn_dim, int ctx, int vocab,
                 double theta, int experts, int k, bool norm_topk) {
  Config c = shape(n_layer, n_head, n_kv_head, d_model, ffn_dim, ctx, vocab, theta, false);
  c.arch = "mixtral";
  c.n_experts = experts;
  c.top_k = k;
  c.moe_norm_topk = norm_topk;
  return c;
}

std::unique_ptr<Decoder> no_decoder(const ParamLayout&, const float*) {
  throw usage_error("trn-generate does not decode mixture-of-experts models yet");
}

}  // namespace

LlamaOffsets llama_offsets(const ParamLayout& lay, int layer) {
  const ParamLayout::Block& b = lay.blocks[layer];
  const auto& a = b.at;
  return {a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], b.begin, b.end};
}

const Family& llama_family() {
  static const Family f{
      "llama",
      {{"llama-tiny", shape(2, 4, 2, 128, 384, 128, 256, 10000.0, false),
        "Llama 2 layers, 4 heads (2 KV), d_model 128, ffn 384, ctx 128, vocab 256, untied"},
       {"llama-small", shape(4, 8, 4, 256, 768, 256, 256, 10000.0, false),
        "Llama 4 layers, 8 heads (4 KV), d_model 256, ffn 768, ctx 256, vocab 256, untied"},
       {"llama-3.2-1b", shape(16, 32, 8, 2048, 8192, 131072, 128256, 500000.0, true),
        "Llama-3.2-1B's shape: 16 layers, 32 heads (8 KV), d_model 2048, ffn 8192, vocab 128256, rope theta "
        "500000, tied (no rope scaling)"},
       {"llama-3.1-8b", shape(32, 32, 8, 4096, 14336, 131072, 128256, 500000.0, false),
        "Llama-3.1-8B's shape: 32 layers, 32 heads (8 KV), d_model 4096, ffn 14336, vocab 128256, untied (no rope "
        "scaling)"},
       {"llama-3.1-70b", shape(80, 64, 8, 8192, 28672, 131072, 128256, 500000.0, false),
        "Llama-3.1-70B's shape: 80 layers, 64 heads (8 KV), d_model 8192, ffn 28672, vocab 128256, untied (no rope "
        "scaling)"}},
      {"n_layer", "n_head", "n_kv_head", "d_model", "ffn_dim", "ctx", "vocab", "rope_theta", "norm_eps",
       "tie_embeddings"},
      {"head_dim", "qkv_bias", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_ctx"},
      &validate,
      &check_tp,
      &add_head,
      &add_block,
      &add_embedding,
      &flops,
      &llama_block_counts,
      llama_stage_f(),
      llama_stage_d(),
      &make_llama_decoder,
  };
  return f;
}

}  // namespace trn::model

namespace trn::model {

// Mixtral: Llama's blocks with the MLP replaced by a mixture of SwiGLU experts (llama.h).
const Family& mixtral_family() {
  static const Family f{
      "mixtral",
      {{"mixtral-tiny", moe_shape(2, 4, 2, 64, 96, 128, 256, 10000.0, 4, 2, true),
        "Mixtral 2 layers, 4 heads (2 KV), d_model 64, 4 experts of ffn 96, top-2, vocab 256"},
       {"moe-small", moe_shape(4, 8, 8, 256, 256, 256, 256, 10000.0, 16, 4, false),
        "an OLMoE-like MoE scaled down: 4 layers, 8 heads, d_model 256, 16 experts of ffn 256, top-4 without "
        "renormalisation, vocab 256"},
       {"mixtral-8x7b", moe_shape(32, 32, 8, 4096, 14336, 32768, 32000, 1000000.0, 8, 2, true),
        "Mixtral-8x7B's shape: 32 layers, 32 heads (8 KV), d_model 4096, 8 experts of ffn 14336, top-2, vocab 32000"},
       {"olmoe-1b-7b", moe_shape(16, 16, 16, 2048, 1024, 4096, 50304, 10000.0, 64, 8, false),
        "OLMoE-1B-7B's shape: 16 layers, 16 heads, d_model 2048, 64 experts of ffn 1024, top-8, vocab 50304 (no "
        "q/k norms)"},
       {"qwen3-30b-a3b", moe_shape(48, 32, 4, 2048, 768, 40960, 151936, 1000000.0, 128, 8, true),
        "Qwen3-30B-A3B's shape: 48 layers, 32 heads (4 KV) of 128, d_model 2048, 128 experts of ffn 768, top-8, "
        "vocab 151936 (no q/k norms)"}},
      {"n_layer", "n_head", "n_kv_head", "d_model", "ffn_dim", "ctx", "vocab", "rope_theta", "norm_eps",
       "tie_embeddings", "n_experts", "top_k", "moe_norm_topk"},
      {"head_dim", "moe_bias"},
      &validate_moe,
      &check_tp,
      &add_head,
      &add_block,
      &add_embedding,
      &flops,
      &mixtral_block_counts,
      mixtral_stage_f(),
      mixtral_stage_d(),
      &no_decoder,
  };
  return f;
}

}  // namespace trn::model
