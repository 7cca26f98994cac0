// Causal self-attention (layers/README.md): one column-parallel q, k, v projection into rows
// [q heads | k heads | v heads], optional rotary embeddings on q and k, blockwise attention with
// each KV head shared by H / K query heads (multi-head attention is K = H), and the row-parallel
// output projection with the residual. Each tensor-parallel rank holds whole KV heads and their
// query heads.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "runtime/kernels/llama.h"
#include "runtime/model/config.h"
#include "runtime/model/layers/linear.h"
#include "runtime/model/ops.h"
#include "runtime/model/stage.h"

namespace trn::model {

// The rotary tables' scaling of c (Config::rope_factor and the rest).
inline kernels::RopeScaling rope_scaling(const Config& c) {
  return {c.rope_factor, c.rope_low_freq_factor, c.rope_high_freq_factor, c.rope_original_ctx};
}

struct Attention {
  Linear qkv;  // in: d_model; out: (H + 2K) hd
  Linear out;  // in: H hd; out: d_model
  int H = 0, K = 0, hd = 0;  // this rank's query heads, KV heads, and the head size
  bool rope = false;         // rotary position embeddings on q and k (RopeScaling of the config)
  AttentionProducts products = AttentionProducts::kFp32;

  int qkv_width() const { return (H + 2 * K) * hd; }
  int width() const { return H * hd; }
  size_t params() const { return qkv.params() + out.params(); }
  // Per token of a sequence of seq_len (causal: the products over the whole row, as the usual count).
  double flops_per_token(int seq_len) const {
    return qkv.flops_per_token() + out.flops_per_token() + 12.0 * seq_len * H * hd;
  }
  // Per token, what Bf16Compute widens for one sequence (scratch qkv32): q, k, v, and under kFp32
  // the output for backward.
  size_t widened_row() const {
    return size_t(qkv_width()) + (products == AttentionProducts::kFp32 ? size_t(width()) : 0);
  }

  // qkv and out: the attention's input (after RoPE) and output, which its backward takes for the
  // softmax's row terms; lse: the rows' log-sum-exp (B,H,T), from which backward computes the
  // probabilities again. d_out, d_qkv: the projections' output gradients, kept by an input-only
  // backward for the weight pass (zero-bubble schedules).
  template <typename T>
  struct Acts {
    SavedInput<T> qkv, out;
    std::vector<T> lse;
    std::vector<T> d_out, d_qkv;
  };
  template <class P, class A, class Fn>
  void buffers(A& a, size_t N, int B, int Tn, Fn&& fn) const {
    P::reserve(a.qkv, N * qkv_width(), fn);
    fn(a.lse, size_t(B) * H * Tn);
    P::reserve(a.out, N * width(), fn);
  }
  // RoPE's cos and sin, (Tn, hd/2) each, one after the other in s.tables.
  template <class S, class Fn>
  void scratch_buffers(int Tn, S& s, Fn&& fn) const {
    if (rope) fn(s.tables, size_t(Tn) * hd);
  }
  // The tables' row t is the stage's token t, at its position in the sequence: under context
  // parallelism the whole sequence's table is computed and the rank's positions picked from it.
  template <typename T>
  void prepare(const ParamLayout& lay, int Tn, BackwardScratch<T>& s) const {
    if (!rope) return;
    const int half = hd / 2;
    const Config& c = lay.config();
    const Placement& place = lay.placement();
    if (place.cp == 1) {
      ops::rope_table(s.tables.data(), s.tables.data() + size_t(Tn) * half, Tn, hd, c.rope_theta, rope_scaling(c));
      return;
    }
    const int whole_len = Tn * place.cp;
    std::vector<T> whole(size_t(whole_len) * hd);
    ops::rope_table(whole.data(), whole.data() + size_t(whole_len) * half, whole_len, hd, c.rope_theta,
                    rope_scaling(c));
    for (int t = 0; t < Tn; ++t) {
      const size_t at = size_t(place.position(t, Tn)) * half;
      std::copy_n(whole.data() + at, half, s.tables.data() + size_t(t) * half);
      std::copy_n(whole.data() + size_t(whole_len) * half + at, half, s.tables.data() + size_t(Tn + t) * half);
    }
  }

  // res (this rank's rows) = residual + out(attention(rope(qkv(x)))), x all N rows as the policy
  // multiplies them. q, k, v are computed in dbig and the output in dtmp where the policy keeps
  // neither in place.
  template <class P, typename T>
  void forward(const P& pol, Acts<T>& a, typename P::Operand x, T* res, const T* residual, const WeightView<T>& p,
               BackwardScratch<T>& s, const SeqRows& r, int B, int Tn, tp::Region& tp) const {
    const int N = B * Tn;
    T* y = pol.output(a.qkv, s.dbig.data());
    qkv.forward(pol, y, x, p, N);  // column-parallel: this rank's heads
    if (rope) ops::rope_forward(y, B, Tn, qkv_width(), H + K, hd, cos(s), sin(s, Tn));
    const auto q = pol.keep(a.qkv, y, size_t(N) * qkv_width());
    y = pol.output(a.out, s.dtmp.data());
    pol.attention_forward(y, a.lse.data(), q, B, Tn, H, K, hd, products);
    const auto o = pol.keep(a.out, y, size_t(N) * width());
    row_parallel_forward(pol, out, res, o, p, residual, r, s, tp);
  }

  // From the output gradient d of the row-parallel projection (dres's rows, as OutGrad), into
  // dx (N x d_model, dtmp): the input gradient, partial over the tensor-parallel ranks (the
  // caller sums it). done_out(offset): called between the output projection and the attention,
  // with the first offset not yet final. g: the weights' gradients, null in an input-only pass,
  // which keeps the output gradients (keep) for backward_weights.
  template <class P, typename T, class Done>
  void backward(const P& pol, Acts<T>& a, const GradView<T>* g, OutGrad<T> d, T* dx, typename P::Operand x,
                BackwardScratch<T>& s, int B, int Tn, bool keep, Done&& done_out) const {
    const int N = B * Tn;
    T* dbig = s.dbig.data();
    if (keep) a.d_out.assign(d.d, d.d + size_t(N) * out.out);
    out.backward(pol, dx, g, d, pol.saved(a.out), pol.weight(out.w), N);
    done_out(qkv.w);
    pol.attention_backward(dbig, dx, pol.saved(a.qkv), pol.saved(a.out), a.lse.data(), B, Tn, H, K, hd, products);
    if (rope) ops::rope_backward(dbig, B, Tn, qkv_width(), H + K, hd, cos(s), sin(s, Tn));
    if (keep) a.d_qkv.assign(dbig, dbig + size_t(N) * qkv_width());
    qkv.backward(pol, dx, g, OutGrad<T>::spent(dbig), x, pol.weight(qkv.w), N);
  }

  // The two projections' weight gradients from the kept output gradients (zero-bubble weight pass).
  template <class P, typename T>
  void backward_weights(const P& pol, const Acts<T>& a, const GradView<T>& g, typename P::Operand x, int N) const {
    const typename P::Operand no_w{};
    T* none = nullptr;
    out.backward(pol, none, &g, OutGrad<T>::kept(a.d_out.data()), pol.saved(a.out), no_w, N);
    qkv.backward(pol, none, &g, OutGrad<T>::kept(a.d_qkv.data()), x, no_w, N);
  }

 private:
  template <typename T>
  static const T* cos(const BackwardScratch<T>& s) {
    return s.tables.data();
  }
  template <typename T>
  const T* sin(const BackwardScratch<T>& s, int Tn) const {
    return s.tables.data() + size_t(Tn) * (hd / 2);
  }
};

}  // namespace trn::model
