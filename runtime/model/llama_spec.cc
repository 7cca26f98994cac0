// Llama's specification: presets, shape rules, and its tensors with their Hugging Face names,
// tensor-parallel shards and initialisation (llama.h).
#include <fmt/format.h>

#include <cmath>
#include <memory>
#include <string>

#include "collectives/core/error.h"
#include "runtime/model/layers/params.h"
#include "runtime/model/llama.h"

namespace trn::model {

void llama_validate(const Config& c) {
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
}

void llama_check_tp(const Config& c, int tp) {
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

namespace {

size_t ones(TensorSpec& t) {
  t.init = TensorSpec::Init::kOnes;
  return t.offset;
}
size_t weight(TensorSpec& t, double std = 0.02) {
  t.init_std = std;
  t.matmul = true;
  return t.offset;
}

}  // namespace

// model.norm, then an untied lm_head: both are final once the head's backward ran.
void llama_add_head(ParamLayout& lay) {
  const Config& c = lay.config();
  const int64_t C = c.d_model, rows = lay.local_vocab();
  lay.final_norm = {ones(lay.add("model.norm.weight", {C}))};
  if (!c.tie_embeddings)
    lay.head = weight(lay.add("lm_head.weight", {c.vocab, C}, 0, lay.placement().tp_rank * rows, rows));
}

namespace {

// In the order backward finishes them (llama_offsets reads them back in this order): down_proj,
// gate and up, then llama_add_attention's. nn.Linear weights are [out, in].
void add_block(ParamLayout& lay, int l) {
  const Config& c = lay.config();
  const int64_t C = c.d_model, Fl = lay.local_mlp(), F = c.ffn();
  const double proj = 0.02 / std::sqrt(2.0 * c.n_layer);
  const std::string n = fmt::format("model.layers.{}.", l);
  const auto oi = Orientation::kOutIn;
  std::vector<size_t>& at = lay.blocks[l].at;
  at.clear();
  at.push_back(add_linear_weight(lay, n + "mlp.down_proj.weight", oi, F, C, Split::kRow, Fl, proj));
  at.push_back(add_linear_weight(lay, n + "mlp.gate_proj.weight", oi, C, F, Split::kColumn, Fl));
  at.push_back(add_linear_weight(lay, n + "mlp.up_proj.weight", oi, C, F, Split::kColumn, Fl));
  llama_add_attention(lay, l, at);
}

double flops(const Config& c, int seq_len) { return llama_flops(c, seq_len, 3.0 * c.d_model * c.ffn()); }

}  // namespace

// embed_tokens; tied, a last stage holds its own copy for the head (TensorSpec::tied).
void llama_add_embedding(ParamLayout& lay, const Chunk& k) {
  const Config& c = lay.config();
  const bool tied = c.tie_embeddings;
  if (!k.embedding && !(tied && k.head)) return;
  const int64_t rows = lay.local_vocab();
  TensorSpec& t = lay.add("model.embed_tokens.weight", {c.vocab, c.d_model}, 0, lay.placement().tp_rank * rows, rows);
  t.tied = tied;
  lay.embedding = weight(t);
  if (tied) lay.head = lay.embedding;
}

LlamaOffsets llama_offsets(const ParamLayout& lay, int layer) {
  const ParamLayout::Block& b = lay.blocks[layer];
  const auto& a = b.at;
  return {a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], b.begin, b.end};
}

void llama_add_attention(ParamLayout& lay, int l, std::vector<size_t>& at) {
  const Config& c = lay.config();
  const int64_t C = c.d_model, hd = c.head_dim();
  const int64_t Ca = lay.local_attn(), Ckv = int64_t(lay.local_kv_heads()) * hd;
  const int64_t H = c.n_head, K = c.kv_heads();
  const double proj = 0.02 / std::sqrt(2.0 * c.n_layer);
  const std::string n = fmt::format("model.layers.{}.", l);
  const auto oi = Orientation::kOutIn;
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
}

double llama_flops(const Config& c, int seq_len, double mlp_weights) {
  const double C = c.d_model, L = c.n_layer, hd = c.head_dim();
  const double attn = C * hd * (2.0 * c.n_head + 2.0 * c.kv_heads());  // q, o and k, v
  const double matmul_params = L * (attn + mlp_weights) + double(c.vocab) * C;
  return 6.0 * matmul_params + 12.0 * L * seq_len * c.n_head * hd;
}

Config llama_shape(int n_layer, int n_head, int n_kv_head, int d_model, int ffn_dim, int ctx, int vocab,
                   double theta, bool tied) {
  Config c{n_layer, n_head, d_model, ctx, vocab};
  c.arch = "llama";
  c.n_kv_head = n_kv_head;
  c.ffn_dim = ffn_dim;
  c.rope_theta = theta;
  c.norm_eps = 1e-5;
  c.tie_embeddings = tied;
  return c;
}

const Family& llama_family() {
  static const Family f{
      "llama",
      {{"llama-tiny", llama_shape(2, 4, 2, 128, 384, 128, 256, 10000.0, false),
        "Llama 2 layers, 4 heads (2 KV), d_model 128, ffn 384, ctx 128, vocab 256, untied"},
       {"llama-small", llama_shape(4, 8, 4, 256, 768, 256, 256, 10000.0, false),
        "Llama 4 layers, 8 heads (4 KV), d_model 256, ffn 768, ctx 256, vocab 256, untied"},
       {"llama-3.2-1b", llama_shape(16, 32, 8, 2048, 8192, 131072, 128256, 500000.0, true),
        "Llama-3.2-1B's shape: 16 layers, 32 heads (8 KV), d_model 2048, ffn 8192, vocab 128256, rope theta "
        "500000, tied (no rope scaling)"},
       {"llama-3.1-8b", llama_shape(32, 32, 8, 4096, 14336, 131072, 128256, 500000.0, false),
        "Llama-3.1-8B's shape: 32 layers, 32 heads (8 KV), d_model 4096, ffn 14336, vocab 128256, untied (no rope "
        "scaling)"},
       {"llama-3.1-70b", llama_shape(80, 64, 8, 8192, 28672, 131072, 128256, 500000.0, false),
        "Llama-3.1-70B's shape: 80 layers, 64 heads (8 KV), d_model 8192, ffn 28672, vocab 128256, untied (no rope "
        "scaling)"}},
      {"n_layer", "n_head", "n_kv_head", "d_model", "ffn_dim", "ctx", "vocab", "rope_theta", "norm_eps",
       "tie_embeddings"},
      {"head_dim", "qkv_bias", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_ctx"},
      &llama_validate,
      &llama_check_tp,
      &llama_add_head,
      &add_block,
      &llama_add_embedding,
      &flops,
      &llama_block_counts,
      llama_stage_f(),
      llama_stage_d(),
      &make_llama_decoder,
  };
  return f;
}

}  // namespace trn::model
