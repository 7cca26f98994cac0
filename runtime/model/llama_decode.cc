// Llama's incremental decoder (decode.h): RMSNorm, the fused q, k, v projection with RoPE at
// each token's position, the cache holding each layer's k and v rows (ctx, n_kv_head * hd)
// shared by their groups of query heads, a SwiGLU MLP (or the caller's MLP step: Mixtral's
// experts, mixtral_decode.cc), and the untied or tied head.
#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "collectives/core/error.h"
#include "runtime/kernels/kernels.h"
#include "runtime/kernels/llama.h"
#include "runtime/model/decode.h"
#include "runtime/model/llama.h"

namespace trn::model {
namespace {

class LlamaDecoder final : public Decoder {
 public:
  LlamaDecoder(const ParamLayout& lay, const float* p, LlamaDecodeMlp mlp)
      : lay_(lay), p_(p), c_(lay.config()), mlp_step_(std::move(mlp)) {
    if (!lay.whole()) throw internal_error("the Llama decoder needs the whole model");
    const int hd = c_.head_dim();
    H_ = c_.n_head;
    K_ = c_.kv_heads();
    qkv_w_ = (H_ + 2 * K_) * hd;
    kv_w_ = K_ * hd;
    for (int l = 0; l < c_.n_layer; ++l) off_.push_back(llama_offsets(lay, l));
    k_.assign(c_.n_layer, std::vector<float>(size_t(c_.ctx) * kv_w_));
    v_.assign(c_.n_layer, std::vector<float>(size_t(c_.ctx) * kv_w_));
    cos_.resize(size_t(c_.ctx) * hd / 2);
    sin_.resize(size_t(c_.ctx) * hd / 2);
    kernels::rope_table(cos_.data(), sin_.data(), c_.ctx, hd, c_.rope_theta, rope_scaling(c_));
  }

  int position() const override { return pos_; }
  void reset() override { pos_ = 0; }

  void append(const int32_t* tok, int n, float* logits) override {
    const int C = c_.d_model, hd = c_.head_dim(), F = c_.ffn(), A = H_ * hd;
    if (n < 1 || pos_ + n > c_.ctx) throw internal_error("Llama decoder: {} tokens at position {} of ctx {}", n, pos_, c_.ctx);
    const float eps = float(c_.norm_eps);
    grow(n);
    const float* emb = p_ + lay_.embedding;
    for (int i = 0; i < n; ++i) std::copy_n(emb + size_t(tok[i]) * C, C, x_.data() + size_t(i) * C);
    // The tables from the first new position: row i of this call is position pos_ + i.
    const float* cos = cos_.data() + size_t(pos_) * hd / 2;
    const float* sin = sin_.data() + size_t(pos_) * hd / 2;
    for (int l = 0; l < c_.n_layer; ++l) {
      const LlamaOffsets& o = off_[l];
      kernels::rmsnorm_forward(ln_.data(), rstd_.data(), x_.data(), p_ + o.input_norm, n, C, eps);
      kernels::linear_forward(qkv_.data(), ln_.data(), p_ + o.q, n, C, qkv_w_);  // q, k, v adjacent: [q | k | v]
      if (c_.qkv_bias)
        for (int i = 0; i < n; ++i)
          for (int j = 0; j < qkv_w_; ++j) qkv_[size_t(i) * qkv_w_ + j] += p_[o.qkv_bias + size_t(j)];
      kernels::rope_forward(qkv_.data(), 1, n, qkv_w_, H_ + K_, hd, cos, sin);    // q and k
      for (int i = 0; i < n; ++i) {
        const float* r = qkv_.data() + size_t(i) * qkv_w_;
        std::copy_n(r + A, kv_w_, k_[l].data() + size_t(pos_ + i) * kv_w_);
        std::copy_n(r + A + kv_w_, kv_w_, v_[l].data() + size_t(pos_ + i) * kv_w_);
      }
      kernels::attention_forward_rows(att_.data(), A, nullptr, 0, qkv_.data(), qkv_w_, k_[l].data(), v_[l].data(),
                                      kv_w_, pos_, n, H_, K_, hd);
      kernels::linear_forward(y_.data(), att_.data(), p_ + o.o, n, A, C);
      for (size_t i = 0; i < size_t(n) * C; ++i) x_[i] += y_[i];
      kernels::rmsnorm_forward(ln_.data(), rstd_.data(), x_.data(), p_ + o.post_norm, n, C, eps);
      if (mlp_step_) {
        mlp_step_(l, ln_.data(), n, y_.data());
      } else {
        // gate and up adjacent: [gate | up]
        kernels::linear_forward(gu_.data(), ln_.data(), p_ + o.gate, n, C, 2 * F);
        kernels::swiglu_forward(mlp_.data(), gu_.data(), n, F);
        kernels::linear_forward(y_.data(), mlp_.data(), p_ + o.down, n, F, C);
      }
      for (size_t i = 0; i < size_t(n) * C; ++i) x_[i] += y_[i];
    }
    const float* last = x_.data() + size_t(n - 1) * C;
    kernels::rmsnorm_forward(ln_.data(), rstd_.data(), last, p_ + lay_.final_norm[0], 1, C, eps);
    kernels::lmhead_forward(logits, ln_.data(), p_ + lay_.head, 1, C, c_.vocab);
    pos_ += n;
  }

 private:
  void grow(int n) {
    if (size_t(n) <= rows_) return;
    rows_ = n;
    const size_t C = c_.d_model, F = c_.ffn(), A = size_t(H_) * c_.head_dim();
    x_.resize(rows_ * C);
    ln_.resize(rows_ * C);
    rstd_.resize(rows_);
    qkv_.resize(rows_ * qkv_w_);
    att_.resize(rows_ * A);
    y_.resize(rows_ * C);
    gu_.resize(rows_ * 2 * F);
    mlp_.resize(rows_ * F);
  }

  const ParamLayout& lay_;
  const float* p_;
  const Config c_;
  LlamaDecodeMlp mlp_step_;  // empty: Llama's SwiGLU MLP
  int H_ = 0, K_ = 0, qkv_w_ = 0, kv_w_ = 0;
  std::vector<LlamaOffsets> off_;
  std::vector<std::vector<float>> k_, v_;  // per layer (ctx, n_kv_head * hd)
  std::vector<float> cos_, sin_;           // (ctx, hd/2)
  int pos_ = 0;
  size_t rows_ = 0;
  std::vector<float> x_, ln_, rstd_, qkv_, att_, y_, gu_, mlp_;
};

}  // namespace

std::unique_ptr<Decoder> make_llama_decoder(const ParamLayout& layout, const float* params) {
  return std::make_unique<LlamaDecoder>(layout, params, nullptr);
}

std::unique_ptr<Decoder> make_llama_decoder(const ParamLayout& layout, const float* params,
                                            LlamaDecodeMlp mlp) {
  return std::make_unique<LlamaDecoder>(layout, params, std::move(mlp));
}

}  // namespace trn::model
