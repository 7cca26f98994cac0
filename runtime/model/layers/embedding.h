// The first stage's embedding and the last stage's head (layers/README.md). Embedding: the
// vocabulary-parallel token embedding (layers.h), plus learned positions when the family has them
// (GPT-2's wpe). Head: the final norm, the logits over this rank's vocabulary rows of the LM head
// (its own tensor or the tied embedding), and the vocabulary-parallel cross-entropy.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "runtime/model/layers.h"
#include "runtime/model/layers/norm.h"
#include "runtime/model/stage.h"

namespace trn::model {

struct Embedding {
  bool positions = false;  // learned positions, ctx x d_model, at pos
  size_t pos = 0;
  int C = 0;

  // out (N,C) = wte[tok] (+ wpe[position]) for tokens (B,T), a token's position in its sequence
  // (Placement::position under context parallelism); wte rows outside this rank's slice add 0.
  // Under sequence parallelism only this rank's rows (SeqRows, at their place in out) are whole.
  template <typename T>
  void forward(const ParamLayout& lay, const WeightView<T>& p, const int32_t* tok, T* out, int B, int Tn,
               tp::Region& tp) const {
    const SeqRows r(lay, B, Tn);
    embed_tokens(lay, p, tok, out, r.N, tp);
    if (!positions) return;
    const Placement& place = lay.placement();
    const T* wpe = p.f32(pos, size_t(Tn) * place.cp * C);  // every position of a sequence
    for (size_t n = r.first; n < r.first + r.local; ++n) {
      T* o = out + n * C;
      const T* pe = wpe + size_t(place.position(int(n % size_t(Tn)), Tn)) * C;
      for (int i = 0; i < C; ++i) o[i] += pe[i];
    }
  }

  // dwte (local rows) (, dwpe) += from dout (B,T,C), all N rows (the stage gathers them under
  // sequence parallelism).
  template <typename T>
  void backward(const ParamLayout& lay, const GradView<T>& g, const T* dout, const int32_t* tok, int B,
                int Tn) const {
    embed_tokens_backward(lay, g, dout, tok, size_t(B) * Tn);
    if (!positions) return;
    const Placement& place = lay.placement();
    T* dwpe = g.at(pos, size_t(Tn) * place.cp * C);
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < Tn; ++t) {
        const T* d = dout + (size_t(b) * Tn + t) * C;
        T* pe = dwpe + size_t(place.position(t, Tn)) * C;
        for (int k = 0; k < C; ++k) pe[k] += d[k];
      }
  }
};

struct Head {
  Norm norm;  // the final norm
  size_t w = 0;  // the LM head's weight (vocab rows of this rank x C)

  template <typename T>
  struct Acts {
    SavedInput<T> x;  // the LM head's input
    typename Norm::template Acts<T> stats;
    std::vector<T> probs, losses;
    std::vector<int32_t> targets;
  };
  template <class P, class A, class Fn>
  void buffers(A& a, const ParamLayout& lay, int B, int Tn, Fn&& fn) const {
    const SeqRows r(lay, B, Tn);
    const size_t N = r.N;
    P::reserve(a.x, N * norm.C, fn);
    norm.buffers(a.stats, r.local, fn);
    fn(a.probs, N * size_t(lay.local_vocab()));
    fn(a.losses, N);
    fn(a.targets, N);
  }

  // The final norm, then the logits over this rank's vocabulary rows; returns the sum of the token
  // losses against targets (targets null: logits only, left unnormalised in a.probs).
  template <class P, typename T>
  double forward(const P& pol, const ParamLayout& lay, const WeightView<T>& p, const T* in, const int32_t* targets,
                 Acts<T>& a, BackwardScratch<T>& s, int B, int Tn, tp::Region& tp) const {
    const int C = norm.C, N = B * Tn;
    const int Vl = static_cast<int>(lay.local_vocab());
    T* logits = a.probs.data();
    T* x = pol.output(a.x, s.dtmp.data());
    norm.forward(x, a.stats, in, p, SeqRows(lay, B, Tn), tp);
    pol.lmhead_forward(logits, pol.keep(a.x, x, size_t(N) * C), pol.weight(w), N, C, Vl);
    if (!targets) return 0.0;
    return vocab_parallel_loss(lay, logits, targets, a.targets.data(), a.losses.data(), N, tp);
  }

  // dres (this rank's rows) = the gradient of in of loss_scale * the sum of token losses.
  template <class P, typename T>
  void backward(const P& pol, const ParamLayout& lay, const WeightView<T>& p, const GradView<T>& g, const T* in,
                Acts<T>& a, T loss_scale, T* dres, BackwardScratch<T>& s, int B, int Tn, tp::Region& tp) const {
    const int C = norm.C, N = B * Tn;
    const int Vl = static_cast<int>(lay.local_vocab());
    T* dl = a.probs.data();  // probabilities become dlogits in place
    vocab_parallel_loss_backward(lay, dl, a.targets.data(), loss_scale, N);
    T* dtmp = s.dtmp.data();
    // dlogits are spent after the head's products.
    pol.lmhead_backward(dtmp, g.at(w), OutGrad<T>::spent(dl), pol.saved(a.x), pol.weight(w), N, C, Vl);
    // The head is column-parallel over the vocabulary.
    const SeqRows r(lay, B, Tn);
    const T* dln = reduce_rows(r, tp, dtmp, size_t(C));
    std::fill(dres, dres + r.local * C, T(0));
    norm.backward(dres, dln, in, a.stats, p, g, r, tp, s.dnorm);
  }
};

}  // namespace trn::model
