// Mixtral's incremental decoder (decode.h): Llama's (llama_decode.cc) with the MoE layer for the
// MLP. Each new row is routed as training routes it (runtime/kernels/moe.h: the router's softmax,
// the top-k by probability times exp(bias) when the model has the balancing bias, the weights
// renormalised or not), grouped by expert, run through each chosen expert's SwiGLU and combined
// with the routing weights. Dropless: the capacity (--capacity-factor) is a training setting over
// whole sequences, which a decode step does not have.
#include <memory>
#include <vector>

#include "runtime/kernels/kernels.h"
#include "runtime/kernels/llama.h"
#include "runtime/kernels/moe.h"
#include "runtime/model/decode.h"
#include "runtime/model/mixtral.h"

namespace trn::model {
namespace {

class MoeDecodeMlp {
 public:
  MoeDecodeMlp(const ParamLayout& lay, const float* p) : p_(p), c_(lay.config()) {
    for (int l = 0; l < c_.n_layer; ++l) off_.push_back(mixtral_offsets(lay, l));
  }

  // y (n x C) = the MoE layer `l` of ln (n x C).
  void operator()(int l, const float* ln, int n, float* y) {
    namespace moe = kernels::moe;
    const int C = c_.d_model, F = c_.ffn(), E = c_.n_experts, k = c_.top_k;
    const MixtralOffsets& o = off_[size_t(l)];
    const size_t stride = 3 * size_t(C) * size_t(F);  // mixtral_spec.cc add_experts: w2, w1, w3
    logits_.resize(size_t(n) * E);
    probs_.resize(size_t(n) * E);
    kernels::linear_forward(logits_.data(), ln, p_ + o.router, n, C, E);
    moe::softmax_rows(probs_.data(), logits_.data(), n, E);
    moe::route(route_, probs_.data(), o.moe_bias ? p_ + o.moe_bias : nullptr, n,
               {E, k, c_.moe_norm_topk, 0.0, n});
    const int G = route_.rows();
    xs_.resize(size_t(G) * C);
    hs_.resize(size_t(G) * 2 * F);
    act_.resize(size_t(G) * F);
    ys_.resize(size_t(G) * C);
    moe::gather(xs_.data(), ln, route_, C);
    for (int e = 0; e < E; ++e) {
      const int from = route_.offset[size_t(e)], rows = route_.offset[size_t(e) + 1] - from;
      if (rows == 0) continue;
      kernels::linear_forward(hs_.data() + size_t(from) * 2 * F, xs_.data() + size_t(from) * C,
                              p_ + o.llama.gate + e * stride, rows, C, 2 * F);
      kernels::swiglu_forward(act_.data() + size_t(from) * F, hs_.data() + size_t(from) * 2 * F, rows, F);
      kernels::linear_forward(ys_.data() + size_t(from) * C, act_.data() + size_t(from) * F,
                              p_ + o.llama.down + e * stride, rows, F, C);
    }
    moe::combine(y, ys_.data(), route_, C);
  }

 private:
  const float* p_;
  const Config c_;
  std::vector<MixtralOffsets> off_;
  kernels::moe::Routing<float> route_;
  std::vector<float> logits_, probs_, xs_, hs_, act_, ys_;
};

}  // namespace

std::unique_ptr<Decoder> make_mixtral_decoder(const ParamLayout& layout, const float* params) {
  auto mlp = std::make_shared<MoeDecodeMlp>(layout, params);
  return make_llama_decoder(layout, params,
                            [mlp](int l, const float* ln, int n, float* y) { (*mlp)(l, ln, n, y); });
}

}  // namespace trn::model
