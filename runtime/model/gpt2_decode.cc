// GPT-2's incremental decoder (decode.h): learned positions, LayerNorm, fused c_attn with
// biases, the cache holding each layer's k and v rows (ctx, C), a GELU MLP, the tied head.
#include <algorithm>
#include <memory>
#include <vector>

#include "collectives/core/error.h"
#include "runtime/kernels/kernels.h"
#include "runtime/kernels/ref.h"
#include "runtime/model/decode.h"
#include "runtime/model/gpt2.h"

namespace trn::model {
namespace {

class Gpt2Decoder final : public Decoder {
 public:
  Gpt2Decoder(const ParamLayout& lay, const float* p) : lay_(lay), p_(p), c_(lay.config()) {
    if (!lay.whole()) throw internal_error("the GPT-2 decoder needs the whole model");
    const size_t C = c_.d_model, T = c_.ctx;
    for (int l = 0; l < c_.n_layer; ++l) off_.push_back(gpt2_offsets(lay, l));
    k_.assign(c_.n_layer, std::vector<float>(T * C));
    v_.assign(c_.n_layer, std::vector<float>(T * C));
  }

  int position() const override { return pos_; }
  void reset() override { pos_ = 0; }

  void append(const int32_t* tok, int n, float* logits) override {
    const int C = c_.d_model, H = c_.n_head, hd = c_.head_dim();
    if (n < 1 || pos_ + n > c_.ctx) throw internal_error("GPT-2 decoder: {} tokens at position {} of ctx {}", n, pos_, c_.ctx);
    grow(n);
    // x (n,C) = wte[tok] + wpe[position]
    const float* wte = p_ + lay_.embedding;
    const float* wpe = p_ + lay_.extra[0];
    for (int i = 0; i < n; ++i) {
      const float* e = wte + size_t(tok[i]) * C;
      const float* q = wpe + size_t(pos_ + i) * C;
      float* xi = x_.data() + size_t(i) * C;
      for (int d = 0; d < C; ++d) xi[d] = e[d] + q[d];
    }
    for (int l = 0; l < c_.n_layer; ++l) {
      const Gpt2Offsets& o = off_[l];
      kernels::ref::layernorm_forward(ln_.data(), mean_.data(), rstd_.data(), x_.data(), p_ + o.ln1_w, p_ + o.ln1_b, n, C);
      kernels::matmul_forward(qkv_.data(), ln_.data(), p_ + o.attn_w, p_ + o.attn_b, n, C, 3 * C);  // rows [q | k | v]
      for (int i = 0; i < n; ++i) {
        const float* r = qkv_.data() + size_t(i) * 3 * C;
        std::copy(r + C, r + 2 * C, k_[l].data() + size_t(pos_ + i) * C);
        std::copy(r + 2 * C, r + 3 * C, v_[l].data() + size_t(pos_ + i) * C);
      }
      kernels::attention_forward_rows(att_.data(), C, nullptr, 0, qkv_.data(), 3 * C, k_[l].data(), v_[l].data(), C,
                                      pos_, n, H, H, hd);
      kernels::matmul_forward(y_.data(), att_.data(), p_ + o.attnproj_w, p_ + o.attnproj_b, n, C, C);
      for (size_t i = 0; i < size_t(n) * C; ++i) x_[i] += y_[i];
      kernels::ref::layernorm_forward(ln_.data(), mean_.data(), rstd_.data(), x_.data(), p_ + o.ln2_w, p_ + o.ln2_b, n, C);
      kernels::matmul_forward(fc_.data(), ln_.data(), p_ + o.fc_w, p_ + o.fc_b, n, C, 4 * C);
      kernels::gelu_forward(gelu_.data(), fc_.data(), size_t(n) * 4 * C);
      kernels::matmul_forward(y_.data(), gelu_.data(), p_ + o.fcproj_w, p_ + o.fcproj_b, n, 4 * C, C);
      for (size_t i = 0; i < size_t(n) * C; ++i) x_[i] += y_[i];
    }
    // Only the last row's logits are needed: ln_f and the tied head on it alone.
    const float* last = x_.data() + size_t(n - 1) * C;
    kernels::ref::layernorm_forward(ln_.data(), mean_.data(), rstd_.data(), last, p_ + lay_.final_norm[0],
                                    p_ + lay_.final_norm[1], 1, C);
    kernels::lmhead_forward(logits, ln_.data(), p_ + lay_.head, 1, C, c_.vocab);
    pos_ += n;
  }

 private:
  // Scratch for n rows.
  void grow(int n) {
    if (size_t(n) <= rows_) return;
    rows_ = n;
    const size_t C = c_.d_model;
    x_.resize(rows_ * C);
    ln_.resize(rows_ * C);
    mean_.resize(rows_);
    rstd_.resize(rows_);
    qkv_.resize(rows_ * 3 * C);
    att_.resize(rows_ * C);
    y_.resize(rows_ * C);
    fc_.resize(rows_ * 4 * C);
    gelu_.resize(rows_ * 4 * C);
  }

  const ParamLayout& lay_;
  const float* p_;
  const Config c_;
  std::vector<Gpt2Offsets> off_;
  std::vector<std::vector<float>> k_, v_;  // per layer (ctx, C)
  int pos_ = 0;
  size_t rows_ = 0;
  std::vector<float> x_, ln_, mean_, rstd_, qkv_, att_, y_, fc_, gelu_;
};

}  // namespace

std::unique_ptr<Decoder> make_gpt2_decoder(const ParamLayout& layout, const float* params) {
  return std::make_unique<Gpt2Decoder>(layout, params);
}

}  // namespace trn::model
