// GPT-2's specification: presets, shape rules, and its tensors with their Hugging Face names,
// tensor-parallel shards and initialisation (gpt2.h).
#include <fmt/format.h>

#include <cmath>
#include <string>

#include "collectives/core/error.h"
#include "runtime/model/gpt2.h"
#include "runtime/model/layers/params.h"

namespace trn::model {
namespace {

void validate(const Config& c) {
  if (c.head_size != 0 || c.qkv_bias || c.rope_factor != 0)
    throw usage_error("GPT-2 has no explicit head_dim, q/k/v biases of their own or rotary embeddings: those are "
                      "Llama-family fields (--arch llama)");
  if (c.n_kv_head != 0 && c.n_kv_head != c.n_head)
    throw usage_error("--n-kv-head {}: GPT-2's attention has as many k and v heads as heads ({}); grouped-query "
                      "attention needs --arch llama",
                      c.n_kv_head, c.n_head);
  if (c.ffn_dim != 0 && c.ffn_dim != 4 * c.d_model)
    throw usage_error("--ffn-dim {}: GPT-2's MLP is 4 x d_model ({}) wide", c.ffn_dim, 4 * c.d_model);
  if (!c.tie_embeddings) throw usage_error("--tie-embeddings 0: GPT-2's LM head is always the token embedding");
}

void check_tp(const Config& c, int tp) {
  if (c.n_head % tp == 0) return;
  std::string fits;
  for (int t = 1; t <= c.n_head; ++t)
    if (c.n_head % t == 0) fits += (fits.empty() ? "" : ", ") + std::to_string(t);
  throw usage_error("--tp {} does not divide n_head {} (d_model {}): each tensor-parallel rank "
                    "holds whole attention heads; use --tp one of {}",
                    tp, c.n_head, c.d_model, fits);
}

// Initialisation: LayerNorm weights 1, biases 0, the residual projections (c_proj) N(0, 0.02 /
// sqrt(2 n_layer)), every other weight N(0, 0.02).
size_t ones(TensorSpec& t) {
  t.init = TensorSpec::Init::kOnes;
  return t.offset;
}
size_t zeros(TensorSpec& t) {
  t.init = TensorSpec::Init::kZeros;
  return t.offset;
}
size_t weight(TensorSpec& t, double std = 0.02) {
  t.init_std = std;
  t.matmul = true;
  return t.offset;
}

void add_head(ParamLayout& lay) {
  const int64_t C = lay.config().d_model;
  lay.final_norm = {ones(lay.add("ln_f.weight", {C})), zeros(lay.add("ln_f.bias", {C}))};
}

// In the order backward finishes them: mlp.c_proj, mlp.c_fc, ln_2, attn.c_proj, attn.c_attn,
// ln_1 (gpt2_offsets reads them back in this order). Conv1D weights are [in, out].
void add_block(ParamLayout& lay, int l) {
  const Config& c = lay.config();
  const int64_t C = c.d_model, Ca = lay.local_attn(), Cm = lay.local_mlp();
  const double proj = 0.02 / std::sqrt(2.0 * c.n_layer);
  const std::string n = fmt::format("h.{}.", l);
  const auto io = Orientation::kInOut;
  std::vector<size_t>& at = lay.blocks[l].at;
  at.clear();
  at.push_back(add_linear_weight(lay, n + "mlp.c_proj.weight", io, 4 * C, C, Split::kRow, Cm, proj));
  at.push_back(add_linear_bias(lay, n + "mlp.c_proj.bias", C, Split::kRow));
  at.push_back(add_linear_weight(lay, n + "mlp.c_fc.weight", io, C, 4 * C, Split::kColumn, Cm));
  at.push_back(add_linear_bias(lay, n + "mlp.c_fc.bias", 4 * C, Split::kColumn, Cm));
  const auto ln2 = add_norm(lay, NormKind::kLayerNorm, n + "ln_2.weight", n + "ln_2.bias", C);
  at.insert(at.end(), {ln2.first, ln2.second});
  at.push_back(add_linear_weight(lay, n + "attn.c_proj.weight", io, C, C, Split::kRow, Ca, proj));
  at.push_back(add_linear_bias(lay, n + "attn.c_proj.bias", C, Split::kRow));
  // Column-parallel by heads: q, k and v each split alike.
  at.push_back(add_linear_weight(lay, n + "attn.c_attn.weight", io, C, 3 * C, Split::kColumn, Ca, 0.02, 3));
  at.push_back(add_linear_bias(lay, n + "attn.c_attn.bias", 3 * C, Split::kColumn, Ca, 3));
  const auto ln1 = add_norm(lay, NormKind::kLayerNorm, n + "ln_1.weight", n + "ln_1.bias", C);
  at.insert(at.end(), {ln1.first, ln1.second});
}

// wpe, then the tied wte last: the LM head and the embedding both add to its gradient. A last
// stage holds its own copy (TensorSpec::tied).
void add_embedding(ParamLayout& lay, const Chunk& k) {
  const Config& c = lay.config();
  const int64_t C = c.d_model, rows = lay.local_vocab();
  if (k.embedding) {
    TensorSpec& wpe = lay.add("wpe.weight", {c.ctx, C});
    wpe.init_std = 0.02;
    lay.extra = {wpe.offset};
  }
  if (k.embedding || k.head) {
    TensorSpec& wte = lay.add("wte.weight", {c.vocab, C}, 0, lay.placement().tp_rank * rows, rows);
    wte.tied = true;
    lay.embedding = lay.head = weight(wte);
  }
}

double flops(const Config& c, int seq_len) {
  const double C = c.d_model, L = c.n_layer;
  const double matmul_params = L * 12.0 * C * C + double(c.vocab) * C;
  return 6.0 * matmul_params + 12.0 * L * seq_len * C;
}

Config shape(int n_layer, int n_head, int d_model, int ctx, int vocab) { return Config{n_layer, n_head, d_model, ctx, vocab}; }

}  // namespace

Gpt2Offsets gpt2_offsets(const ParamLayout& lay, int layer) {
  const ParamLayout::Block& b = lay.blocks[layer];
  const auto& a = b.at;
  return {a[10], a[11], a[8], a[9], a[6], a[7], a[4], a[5], a[2], a[3], a[0], a[1], b.begin, b.end};
}

const Family& gpt2_family() {
  static const Family f{
      "gpt2",
      {{"tiny", shape(2, 4, 128, 128, 256), "GPT-2 2x4x128 ctx 128"},
       {"small", shape(4, 8, 256, 256, 256), "GPT-2 4x8x256 ctx 256"},
       {"gpt2", shape(12, 12, 768, 1024, 50257), "GPT-2 124M: 12x12x768 ctx 1024 vocab 50257"}},
      {"n_layer", "n_head", "d_model", "ctx", "vocab"},
      {},
      &validate,
      &check_tp,
      &add_head,
      &add_block,
      &add_embedding,
      &flops,
      &gpt2_block_counts,
      gpt2_stage_f(),
      gpt2_stage_d(),
      &make_gpt2_decoder,
  };
  return f;
}

}  // namespace trn::model
