// The layer library (runtime/model/layers): a linear layer computes the same product and
// gradients in either weight orientation; the TensorSpecs a layer adds split the right dimension
// for its orientation; the families report their blocks' counts and their shapes' flags from their
// fields, so the planner and calibration need no family names.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "runtime/model/family.h"
#include "runtime/model/gpt2.h"
#include "runtime/model/layers/block.h"
#include "runtime/model/layers/params.h"

using namespace trn;
using namespace trn::model;

namespace {

// The [in, out] weight w as [out, in].
std::vector<double> transposed(const std::vector<double>& w, int in, int out) {
  std::vector<double> t(w.size());
  for (int i = 0; i < in; ++i)
    for (int o = 0; o < out; ++o) t[size_t(o) * in + i] = w[size_t(i) * out + o];
  return t;
}

}  // namespace

TEST_CASE("a Linear layer computes the same product and gradients in either weight orientation") {
  const int N = 5, in = 4, out = 3;
  // Buffer: weight [in*out], bias [out].
  std::vector<double> a(in * out + out), b;
  for (size_t i = 0; i < a.size(); ++i) a[i] = std::sin(0.7 * double(i) + 0.3);
  b = transposed(std::vector<double>(a.begin(), a.begin() + in * out), in, out);
  b.insert(b.end(), a.begin() + in * out, a.end());
  std::vector<double> x(N * in), d(N * out);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::cos(0.37 * double(i));
  for (size_t i = 0; i < d.size(); ++i) d[i] = std::sin(1.1 * double(i) + 0.5);

  struct Result {
    std::vector<double> y, dx, g;
  };
  auto run = [&](Orientation o, const std::vector<double>& params) {
    const WeightView<double> w = WeightView<double>::whole(params.data(), params.size());
    Result r{std::vector<double>(N * out), std::vector<double>(N * in), std::vector<double>(params.size(), 0.0)};
    const GradView<double> g = GradView<double>::whole(r.g.data(), r.g.size());
    BackwardScratch<double> s;
    const FullPrecision<double> pol(w, s);
    const Linear lin{o, 0, size_t(in * out), true, in, out};
    lin.forward(pol, r.y.data(), x.data(), w, N);
    lin.backward(pol, r.dx.data(), &g, OutGrad<double>::kept(d.data()), x.data(), pol.weight(0), N);
    return r;
  };
  const Result io = run(Orientation::kInOut, a), oi = run(Orientation::kOutIn, b);
  for (int i = 0; i < N * out; ++i) CHECK(io.y[i] == Approx(oi.y[i]).epsilon(1e-12));
  for (int i = 0; i < N * in; ++i) CHECK(io.dx[i] == Approx(oi.dx[i]).epsilon(1e-12));
  const std::vector<double> dw_oi = transposed(std::vector<double>(io.g.begin(), io.g.begin() + in * out), in, out);
  for (int i = 0; i < in * out; ++i) CHECK(dw_oi[i] == Approx(oi.g[i]).epsilon(1e-12));
  for (int i = 0; i < out; ++i) CHECK(io.g[in * out + i] == Approx(oi.g[in * out + i]).epsilon(1e-12));
}

TEST_CASE("a layer's TensorSpecs split the dimension its orientation and split name") {
  Config c = preset("llama-tiny");
  Placement p;
  p.tp = 2;
  p.tp_rank = 1;
  ParamLayout lay(c, p);
  const size_t before = lay.tensors().size();
  add_linear_weight(lay, "col_io", Orientation::kInOut, 8, 6, Split::kColumn, 3);
  add_linear_weight(lay, "row_io", Orientation::kInOut, 8, 6, Split::kRow, 4);
  add_linear_weight(lay, "col_oi", Orientation::kOutIn, 8, 6, Split::kColumn, 3);
  add_linear_weight(lay, "row_oi", Orientation::kOutIn, 8, 6, Split::kRow, 4, 0.5);
  add_linear_bias(lay, "bias_col", 6, Split::kColumn, 3);
  add_linear_bias(lay, "bias_row", 6, Split::kRow);
  add_norm(lay, NormKind::kLayerNorm, "ln.weight", "ln.bias", 8);
  add_norm(lay, NormKind::kRMSNorm, "rms.weight", "", 8);
  const auto& t = lay.tensors();
  REQUIRE(t.size() == before + 9);
  auto at = [&](size_t i) -> const TensorSpec& { return t[before + i]; };
  CHECK(at(0).global_shape == std::vector<int64_t>{8, 6});
  CHECK(at(0).shard_dim == 1);
  CHECK(at(0).shard_offset == 3);
  CHECK(at(1).shard_dim == 0);
  CHECK(at(1).shape == std::vector<int64_t>{4, 6});
  CHECK(at(2).global_shape == std::vector<int64_t>{6, 8});
  CHECK(at(2).shard_dim == 0);
  CHECK(at(3).shard_dim == 1);
  CHECK(at(3).shape == std::vector<int64_t>{6, 4});
  CHECK(at(3).init_std == 0.5);
  for (size_t i = 0; i < 4; ++i) CHECK(at(i).matmul);
  CHECK(at(4).shard_dim == 0);
  CHECK(at(4).init == TensorSpec::Init::kZeros);
  CHECK(at(5).replicated());
  CHECK(at(6).init == TensorSpec::Init::kOnes);
  CHECK(at(7).name == "ln.bias");
  CHECK(at(8).name == "rms.weight");
  CHECK_FALSE(at(8).matmul);
}

TEST_CASE("the families report their blocks' counts and their shapes' flags from their layers and fields") {
  const Config g = preset("tiny"), l = preset("llama-tiny");
  const BlockCounts gc = family("gpt2").block_counts(g), lc = family("llama").block_counts(l);
  CHECK(gc.norm_params == 2 * size_t(g.d_model));  // LayerNorm: weight and bias
  CHECK(lc.norm_params == size_t(l.d_model));      // RMSNorm: weight
  CHECK(gc.mlp_weights == 2.0 * g.d_model * g.ffn());
  CHECK(lc.mlp_weights == 3.0 * l.d_model * l.ffn());
  CHECK(gc.mlp_activation_ops > 0);  // the GELU is computed again under selective recomputation
  CHECK(lc.mlp_activation_ops == 0);

  CHECK(g.flags() == "--arch gpt2 --n-layer 2 --n-head 4 --d-model 128 --ctx 128 --vocab 256");
  CHECK(l.flags() ==
        "--arch llama --n-layer 2 --n-head 4 --n-kv-head 2 --d-model 128 --ffn-dim 384 --ctx 128 --vocab 256 "
        "--rope-theta 10000 --norm-eps 1e-05 --tie-embeddings 0");
  Config mha = l;
  mha.n_kv_head = 0;  // resolved: as many KV heads as heads
  CHECK_THAT(mha.flags(), Catch::Contains("--n-kv-head 4"));
}

namespace {

// GPT-2's block composed here from its offsets, as gpt2_block.cc composes it.
struct Gpt2Like {
  using Mlp = GeluMlp;
  static BlockLayers<GeluMlp> shape(const Config& c, int tp, const Gpt2Offsets& o = {}) {
    const int C = c.d_model, H = c.n_head / tp, Ca = H * c.head_dim(), F = c.ffn() / tp;
    BlockLayers<GeluMlp> b;
    b.norm1 = {NormKind::kLayerNorm, C, 1e-5f, o.ln1_w, o.ln1_b};
    b.attn.qkv = {Orientation::kInOut, o.attn_w, o.attn_b, true, C, 3 * Ca};
    b.attn.out = {Orientation::kInOut, o.attnproj_w, o.attnproj_b, true, Ca, C};
    b.attn.H = b.attn.K = H;
    b.attn.hd = Ca / H;
    b.norm2 = {NormKind::kLayerNorm, C, 1e-5f, o.ln2_w, o.ln2_b};
    b.mlp.fc = {Orientation::kInOut, o.fc_w, o.fc_b, true, C, F};
    b.mlp.proj = {Orientation::kInOut, o.fcproj_w, o.fcproj_b, true, F, C};
    b.mlp.F = F;
    b.end = o.end;
    return b;
  }
  static BlockLayers<GeluMlp> block(const ParamLayout& lay, int layer) {
    return shape(lay.config(), lay.placement().tp, layer >= 0 ? gpt2_offsets(lay, layer) : Gpt2Offsets{});
  }
};

}  // namespace

TEST_CASE("a composed block reports its layout's parameters and the activation bytes its stage holds") {
  for (int tp : {1, 2}) {
    INFO("tp " << tp);
    const Config c = preset("tiny");
    Placement p;
    p.tp = tp;
    const ParamLayout lay(c, p);
    const BlockLayers<GeluMlp> b = Gpt2Like::block(lay, 1);
    CHECK(b.params() == lay.blocks[1].end - lay.blocks[1].begin);
    CHECK(b.attn.K == b.attn.H);  // multi-head attention: K = H
    CHECK(b.attn.qkv_width() == 3 * lay.local_attn());
    const int B = 2, T = 8;
    const size_t N = size_t(B) * T, C = size_t(c.d_model), Ca = size_t(lay.local_attn()), F = size_t(lay.local_mlp());
    const size_t H = size_t(lay.local_heads());
    const size_t elements = N * C + 2 * N            // ln1 and its mean and rstd
                            + N * 3 * Ca + B * H * T + N * Ca  // q, k, v; lse; the attention's output
                            + N * C                   // res2
                            + N * C + 2 * N           // ln2
                            + 2 * N * F               // the GELU's input and output
                            + N * C;                  // res3
    CHECK(ComposedBody<Gpt2Like>::block_bytes<FullPrecision<double>, double>(lay, B, T) == elements * sizeof(double));
  }
}
