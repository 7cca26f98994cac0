// A mixture-of-experts layer's routing: the router's softmax and top-k choice, the capacity
// drop, the grouping of tokens by expert, the weighted combine, the load-balancing loss and the
// router's backward. The experts' matmuls are not here: the model runs them through its
// precision policy, one product per expert over that expert's contiguous rows of the grouped
// order, never a dense pass over all tokens.
//
// Templated on the element type like the reference kernels (float in training, double in the
// finite-difference tests). Single-threaded, deterministic: ties in the top-k go to the lower
// expert index, grouped rows of an expert are in token order, every sum runs in a fixed order.
//
// Shapes: N tokens (rows), E experts, k choices per token. The rows are whole sequences of
// seq_len tokens one after another (a micro-batch), because the capacity and the balancing loss
// are per sequence: what a sequence's tokens get does not depend on which rank holds which
// sequences, so every data-parallel layout routes as one process does.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace trn::kernels::moe {

struct RouteConfig {
  int experts = 0;
  int top_k = 0;
  bool norm_topk = true;       // combine weights renormalised over the k choices (Mixtral), or the raw probabilities (OLMoE)
  double capacity_factor = 0;  // 0: dropless; else each expert takes at most ceil(f * k * seq_len / E) choices per sequence
  int seq_len = 0;
};

// One micro-batch's routing decisions.
template <typename T>
struct Routing {
  int N = 0, E = 0, k = 0;
  std::vector<int32_t> choice;  // (N,k) token n's j-th expert, by descending score
  std::vector<T> weight;        // (N,k) combine weight: the choice's probability, / norm[n] when renormalised
  std::vector<T> norm;          // (N) the sum of the k probabilities when renormalised, else 1
  std::vector<int32_t> slot;    // (N,k) the choice's row in the grouped order, -1 if the capacity dropped it
  std::vector<int32_t> offset;  // (E+1) expert e's grouped rows are [offset[e], offset[e+1])
  std::vector<int32_t> token;   // (rows) the token each grouped row copies
  std::vector<int32_t> chosen;  // (N/seq_len, E) choices per expert in each sequence, before the capacity
  int64_t dropped = 0;          // choices the capacity dropped
  int rows() const { return offset.empty() ? 0 : offset[size_t(E)]; }
  int64_t load(int e) const { return offset[size_t(e) + 1] - offset[size_t(e)]; }
};

// probs (N,E) = softmax of each row of logits, max-subtracted, summed in expert order.
template <typename T>
void softmax_rows(T* probs, const T* logits, int N, int E) {
  for (int n = 0; n < N; ++n) {
    const T* l = logits + size_t(n) * E;
    T* p = probs + size_t(n) * E;
    T m = l[0];
    for (int e = 1; e < E; ++e) m = std::max(m, l[e]);
    T s = 0;
    for (int e = 0; e < E; ++e) s += (p[e] = std::exp(l[e] - m));
    const T inv = T(1) / s;
    for (int e = 0; e < E; ++e) p[e] *= inv;
  }
}

// Routes N tokens given their router probabilities (N,E). The choice ranks the probabilities
// times exp(bias) (bias (E): DeepSeek-V3's balancing bias; null for none): the bias moves which
// experts are chosen, never the weights, which are the probabilities of the chosen. Ranking
// p * exp(b) is ranking logit + b (the softmax keeps each row's order), so the bias acts on the
// logits. Added to the probabilities instead, it could not tell apart the experts a token gives
// probabilities near 0 (all but a few once the router sharpens): one bias step then moves the
// same experts in or out for every token at once, and moe-small's loads swung from step to step
// (bench/results/2026-12-07-moe-balance-bias.md).
template <typename T>
void route(Routing<T>& r, const T* probs, const std::type_identity_t<T>* bias, int N,
           const RouteConfig& c) {
  const int E = c.experts, k = c.top_k, S = c.seq_len;
  r.N = N;
  r.E = E;
  r.k = k;
  r.choice.assign(size_t(N) * k, 0);
  r.weight.assign(size_t(N) * k, T(0));
  r.norm.assign(size_t(N), T(1));
  r.slot.assign(size_t(N) * k, 0);
  r.chosen.assign(size_t(N / S) * E, 0);
  r.dropped = 0;
  std::vector<T> score(static_cast<size_t>(E)), factor(static_cast<size_t>(E), T(1));
  if (bias)
    for (int e = 0; e < E; ++e) factor[size_t(e)] = std::exp(bias[e]);
  for (int n = 0; n < N; ++n) {
    const T* p = probs + size_t(n) * E;
    for (int e = 0; e < E; ++e) score[size_t(e)] = p[e] * factor[size_t(e)];
    int32_t* ch = r.choice.data() + size_t(n) * k;
    for (int j = 0; j < k; ++j) {  // k scans: k is small (2-8) and E at most a few hundred
      int best = -1;
      for (int e = 0; e < E; ++e) {
        if (std::find(ch, ch + j, e) != ch + j) continue;
        if (best < 0 || score[size_t(e)] > score[size_t(best)]) best = e;
      }
      ch[j] = best;
      ++r.chosen[size_t(n / S) * E + best];
    }
    T sum = 0;
    for (int j = 0; j < k; ++j) sum += p[ch[j]];
    if (c.norm_topk) r.norm[size_t(n)] = sum;
    for (int j = 0; j < k; ++j) r.weight[size_t(n) * k + j] = p[ch[j]] / r.norm[size_t(n)];
  }
  // The capacity, per sequence: first choices before second choices, each in token order.
  if (c.capacity_factor > 0) {
    const int cap = int(std::ceil(c.capacity_factor * k * S / E));
    std::vector<int> taken(static_cast<size_t>(E));
    for (int s0 = 0; s0 < N; s0 += S) {
      std::fill(taken.begin(), taken.end(), 0);
      for (int j = 0; j < k; ++j)
        for (int n = s0; n < s0 + S; ++n) {
          const size_t i = size_t(n) * k + j;
          if (taken[size_t(r.choice[i])] < cap) {
            ++taken[size_t(r.choice[i])];
          } else {
            r.slot[i] = -1;
            ++r.dropped;
          }
        }
    }
  }
  // Group the kept choices by expert (a counting sort, stable in token order).
  r.offset.assign(size_t(E) + 1, 0);
  for (size_t i = 0; i < r.slot.size(); ++i)
    if (r.slot[i] >= 0) ++r.offset[size_t(r.choice[i]) + 1];
  for (int e = 0; e < E; ++e) r.offset[size_t(e) + 1] += r.offset[size_t(e)];
  std::vector<int32_t> next(r.offset.begin(), r.offset.end() - 1);
  r.token.assign(size_t(r.rows()), 0);
  for (int n = 0; n < N; ++n)
    for (int j = 0; j < k; ++j) {
      const size_t i = size_t(n) * k + j;
      if (r.slot[i] < 0) continue;
      const int32_t row = next[size_t(r.choice[i])]++;
      r.slot[i] = row;
      r.token[size_t(row)] = n;
    }
}

// xs (rows, C): each grouped row a copy of its token's row of x (N, C).
template <typename T>
void gather(T* xs, const T* x, const Routing<T>& r, int C) {
  for (int row = 0; row < r.rows(); ++row)
    std::copy_n(x + size_t(r.token[size_t(row)]) * C, C, xs + size_t(row) * C);
}

// dx (N, C) += each grouped row's gradient, at its token.
template <typename T>
void scatter_add(T* dx, const T* dxs, const Routing<T>& r, int C) {
  for (int row = 0; row < r.rows(); ++row) {
    T* d = dx + size_t(r.token[size_t(row)]) * C;
    const T* g = dxs + size_t(row) * C;
    for (int i = 0; i < C; ++i) d[i] += g[i];
  }
}

// out (N, C) = sum over token n's kept choices j (in order) of weight[n,j] * ys[slot[n,j]];
// a token whose choices were all dropped gets zeros (its residual passes alone).
template <typename T>
void combine(T* out, const T* ys, const Routing<T>& r, int C) {
  for (int n = 0; n < r.N; ++n) {
    T* o = out + size_t(n) * C;
    std::fill(o, o + C, T(0));
    for (int j = 0; j < r.k; ++j) {
      const size_t i = size_t(n) * r.k + j;
      if (r.slot[i] < 0) continue;
      const T w = r.weight[i];
      const T* y = ys + size_t(r.slot[i]) * C;
      for (int c = 0; c < C; ++c) o[c] += w * y[c];
    }
  }
}

// combine's backward from dout (N, C): dys (rows, C) = weight * dout at each grouped row, and
// dweight (N,k) = dout[n] . ys[slot] (0 for a dropped choice). Under tensor parallelism ys holds
// partial sums, so dweight does too and is summed over the tp ranks before router_backward.
template <typename T>
void combine_backward(T* dys, T* dweight, const T* dout, const T* ys, const Routing<T>& r, int C) {
  for (int n = 0; n < r.N; ++n) {
    const T* d = dout + size_t(n) * C;
    for (int j = 0; j < r.k; ++j) {
      const size_t i = size_t(n) * r.k + j;
      dweight[i] = T(0);
      if (r.slot[i] < 0) continue;
      const T* y = ys + size_t(r.slot[i]) * C;
      T* dy = dys + size_t(r.slot[i]) * C;
      const T w = r.weight[i];
      T dot = 0;
      for (int c = 0; c < C; ++c) {
        dy[c] = w * d[c];
        dot += d[c] * y[c];
      }
      dweight[i] = dot;
    }
  }
}

// The load-balancing loss of each sequence (Switch / Mixtral form, per sequence so that it does
// not depend on the layout): aux = E * sum_e f_e * P_e, where f_e is the share of the sequence's
// k * seq_len choices that went to expert e (before the capacity) and P_e its mean probability.
// Writes aux (N / seq_len) and returns their sum. f_e is a count, so only P_e has a gradient:
// d aux / d probs[t, e] = E * f_e / seq_len for every token t of the sequence (aux_backward).
template <typename T>
T aux_forward(T* aux, const T* probs, const Routing<T>& r, int seq_len) {
  const int E = r.E, S = seq_len;
  T total = 0;
  std::vector<T> mean(static_cast<size_t>(E));
  for (int s = 0; s < r.N / S; ++s) {
    std::fill(mean.begin(), mean.end(), T(0));
    for (int t = 0; t < S; ++t) {
      const T* p = probs + (size_t(s) * S + t) * E;
      for (int e = 0; e < E; ++e) mean[size_t(e)] += p[e];
    }
    T a = 0;
    for (int e = 0; e < E; ++e) {
      const T f = T(r.chosen[size_t(s) * E + e]) / T(r.k * S);
      a += f * (mean[size_t(e)] / T(S));
    }
    aux[s] = T(E) * a;
    total += aux[s];
  }
  return total;
}

// The router's backward: dlogits (N,E) (overwritten) from dweight (N,k), combine_backward's, and
// the balancing loss's scale aux_scale (d total loss / d aux of each sequence: the coefficient
// over the step's sequences; 0 without the loss). Through the renormalisation w_j = p_j / S:
// dL/dp_j = (dw_j - sum_i dw_i w_i) / S; then through the softmax: dl = p * (dp - sum p dp).
template <typename T>
void router_backward(T* dlogits, const T* dweight, const T* probs, const Routing<T>& r, bool norm_topk, int seq_len,
                     T aux_scale) {
  const int E = r.E, k = r.k;
  std::vector<T> dp(static_cast<size_t>(E));
  for (int n = 0; n < r.N; ++n) {
    const T* p = probs + size_t(n) * E;
    const size_t s = size_t(n / seq_len);
    for (int e = 0; e < E; ++e)
      dp[size_t(e)] = aux_scale * T(E) * (T(r.chosen[s * E + e]) / T(k * seq_len)) / T(seq_len);
    const T* dw = dweight + size_t(n) * k;
    const T* w = r.weight.data() + size_t(n) * k;
    const int32_t* ch = r.choice.data() + size_t(n) * k;
    T dot = 0;
    if (norm_topk)
      for (int j = 0; j < k; ++j) dot += dw[j] * w[j];
    for (int j = 0; j < k; ++j) dp[size_t(ch[j])] += (dw[j] - dot) / r.norm[size_t(n)];
    T pdp = 0;
    for (int e = 0; e < E; ++e) pdp += p[e] * dp[size_t(e)];
    T* dl = dlogits + size_t(n) * E;
    for (int e = 0; e < E; ++e) dl[e] = p[e] * (dp[size_t(e)] - pdp);
  }
}

// DeepSeek-V3's balancing without a loss: after a step, each expert's bias moves toward balance
// by rate times its relative shortfall from the mean of the step's global loads, (mean - load) /
// mean: up for an expert below the mean, down above, unchanged at it. The steps sum to zero, so the
// biases keep their mean. DeepSeek-V3 moves each bias by a fixed rate * sign(mean - load), a step
// of one size however far the load is from the mean: one small enough to hold the balance without
// overshooting is too slow to undo the router's early collapse (on moe-small 1e-3 left a layer at
// 2.5x the mean over steps 100-300; 1e-2 overshot, the loads swinging between steps). A step in
// proportion to the shortfall is large far from balance and small near it. No loads: no step.
inline void update_bias(float* bias, const int64_t* loads, int E, float rate) {
  int64_t total = 0;
  for (int e = 0; e < E; ++e) total += loads[e];
  if (total <= 0) return;
  const double mean = double(total) / E;
  for (int e = 0; e < E; ++e) bias[e] += float(double(rate) * (mean - double(loads[e])) / mean);
}

}  // namespace trn::kernels::moe
