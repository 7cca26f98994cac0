// GPT-2's bodies (gpt2.h) as a composition of the shared layers (layers/block.h): LayerNorms with
// biases, multi-head attention (K = H) with Conv1D [in, out] weights and biases whose bf16
// products are PyTorch autocast's, a GELU MLP, learned positions, and the head tied to wte.
#include "runtime/model/gpt2.h"
#include "runtime/model/layers/block.h"
#include "runtime/model/stage_impl.h"

namespace trn::model {
namespace {

struct Gpt2Layers {
  using Mlp = GeluMlp;

  static BlockLayers<GeluMlp> block(const ParamLayout& lay, int layer) {
    return shape(lay.config(), lay.placement().tp, layer >= 0 ? gpt2_offsets(lay, layer) : Gpt2Offsets{});
  }
  static BlockLayers<GeluMlp> shape(const Config& c, int tp, const Gpt2Offsets& o = {}) {
    const int C = c.d_model, H = c.n_head / tp, Ca = H * c.head_dim(), Cm = c.ffn() / tp;
    const auto kInOut = Orientation::kInOut;
    BlockLayers<GeluMlp> b;
    b.norm1 = {NormKind::kLayerNorm, C, 1e-5f, o.ln1_w, o.ln1_b};
    b.attn.qkv = {kInOut, o.attn_w, o.attn_b, true, C, 3 * Ca};  // c_attn, column-parallel by heads
    b.attn.out = {kInOut, o.attnproj_w, o.attnproj_b, true, Ca, C};  // attn.c_proj, row-parallel
    b.attn.H = b.attn.K = H;
    b.attn.hd = Ca / H;
    b.attn.products = AttentionProducts::kBf16;
    b.norm2 = {NormKind::kLayerNorm, C, 1e-5f, o.ln2_w, o.ln2_b};
    b.mlp.fc = {kInOut, o.fc_w, o.fc_b, true, C, Cm};        // mlp.c_fc, column-parallel
    b.mlp.proj = {kInOut, o.fcproj_w, o.fcproj_b, true, Cm, C};  // mlp.c_proj, row-parallel
    b.mlp.F = Cm;
    b.end = o.end;
    return b;
  }
  static Embedding embedding(const ParamLayout& lay) { return {true, lay.extra.at(0), lay.config().d_model}; }
  static Head head(const ParamLayout& lay) {
    return {{NormKind::kLayerNorm, lay.config().d_model, 1e-5f, lay.final_norm.at(0), lay.final_norm.at(1)},
            lay.head};
  }
};

}  // namespace

BlockCounts gpt2_block_counts(const Config& c) { return ComposedBody<Gpt2Layers>::counts(c); }
StageFactory<float> gpt2_stage_f() { return stage_factory_f<ComposedBody<Gpt2Layers>>(); }
StageFactory<double> gpt2_stage_d() { return stage_factory_d<ComposedBody<Gpt2Layers>>(); }

}  // namespace trn::model
