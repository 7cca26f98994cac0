// The mixture-of-experts layer (the MLP of a Mixtral block; the maths in runtime/kernels/moe.h):
// a router, then each token's top-k SwiGLU experts over grouped rows, combined with the routing
// weights. It has the members of the MLP layers (layers/mlp.h), so a block composes it in an MLP's
// place (layers/block.h).
//
// Tensor parallelism: each expert is split by tp like a dense SwiGLU MLP (w1, w3 by rows, w2 by
// columns), the router is replicated and sees the same (gathered) rows on every tp rank, so every
// tp rank routes alike; the combine is linear in the experts' partial outputs and is summed once
// like a row-parallel output. The combine weights' gradients are dot products with partial
// outputs, so they are summed over tp before the router's backward, whose input gradient is added
// on tp rank 0 only (the block sums the input gradient over tp).
//
// Expert parallelism (the region's ep group, parallel::Plan::ep): a rank holds El of the E experts
// of each layer, from `first`. It routes its own tokens over all E, sends each token once to each
// expert rank holding any of its kept choices (runtime/kernels/moe_dispatch.h: the rows carry the
// combine weights and local expert indices), runs its experts over the rows it received, grouped
// by expert, and sends back each row combined over its choices; backward runs the same exchange
// in reverse, the combine weights' gradients travelling back with the input gradients. The counts
// are exchanged once per layer in forward (all_to_all_counts); backward's are the forward's
// reversed. Under tp the ep group holds the ranks of this tp rank, which send the same rows (all
// tp ranks route alike) and get back partial sums, reduced over tp as without ep.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <type_traits>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/core/error.h"
#include "runtime/kernels/bf16.h"
#include "runtime/kernels/moe.h"
#include "runtime/kernels/moe_dispatch.h"
#include "runtime/model/family.h"
#include "runtime/model/layers/linear.h"
#include "runtime/model/ops.h"
#include "runtime/model/stage.h"

namespace trn::model {

struct MoeMlp {
  Linear router;       // d_model -> E, replicated ([E, C]: block_sparse_moe.gate.weight)
  size_t down0 = 0;    // expert 0's w2 (C x F); expert e's at down0 + e * stride
  size_t gate_up0 = 0; // expert 0's w1 then w3 (2F x C, adjacent: one product gives [gate | up])
  size_t stride = 0;   // elements between one expert's tensors and the next's
  size_t bias = 0;     // the balancing bias (E), or 0 without Config::moe_bias
  int C = 0, F = 0, E = 0, k = 0;  // F: this rank's share of an expert's hidden width
  int El = 0, first = 0;           // this rank's experts: [first, first + El) (all E without ep)
  bool norm_topk = true;
  double capacity = 0;
  double aux_coef = 0;  // the balancing loss's coefficient (Config::moe_aux_coef)

  size_t params() const { return router.params() + size_t(El) * 3 * size_t(C) * F + (bias ? size_t(E) : 0); }
  // The matmul weights a token multiplies (the planner's compute): the router and k experts'.
  size_t weights() const { return router.params() + size_t(k) * 3 * size_t(C) * F; }
  // By the active parameters: a token runs the router and k experts.
  double flops_per_token() const { return router.flops_per_token() + 6.0 * k * 3 * double(C) * F; }
  static constexpr double kActivationOps = 0;  // nothing recomputed selectively
  // What the layer cannot run (a family with it passes them on: Family::refusals).
  static constexpr Refusals kRefusals = {
      "a mixture of experts",
      "the capacity and the balancing loss are per sequence, and context parallelism splits each sequence over "
      "ranks; use --cp 1",
      "the MoE layer's backward is not split into input and weight passes; use 1f1b, gpipe or interleaved"};
  // 2F: the experts' [gate | up] rows; E: the router's logits, whose gradient a bf16 policy may
  // round in its own scratch (N x the widest output).
  size_t wide() const { return std::max(2 * size_t(F), size_t(E)); }

  // route: the routing; probs (N x E) the router's probabilities; xs the experts' inputs grouped
  // by expert, hs their [gate | up] rows and ys their outputs (partial sums over tp); aux this
  // forward's balancing loss summed over its sequences; dispatch, under expert parallelism, what
  // was sent where and what this rank's experts received. Sized for every choice kept (N x k
  // rows: under ep, this rank's experts' share of a balanced load; more rows grow them), and
  // under ep for sent_rows(N) rows each way.
  template <typename T>
  struct Acts {
    kernels::moe::Routing<T> route;
    kernels::moe::Dispatch<T> dispatch;
    std::vector<T> probs, hs, ys;
    SavedInput<T> xs;
    double aux = 0;
  };
  // N rows of B sequences.
  template <class P, class A, class Fn>
  void buffers(A& a, size_t N, int B, Fn&& fn) const {
    const size_t rows = N * size_t(k);
    fn(a.probs, N * size_t(E));
    P::reserve(a.xs, rows * C, fn);
    fn(a.hs, rows * 2 * F);
    fn(a.ys, rows * C);
    // The routing (kernels::moe::Routing): per choice its expert, weight, grouped row and the
    // grouped rows' tokens; per token the norm; per sequence each expert's count.
    auto& r = a.route;
    fn(r.choice, rows);
    fn(r.weight, rows);
    fn(r.norm, N);
    fn(r.slot, rows);
    fn(r.offset, size_t(E) + 1);
    fn(r.token, rows);
    fn(r.chosen, size_t(B) * size_t(E));
    if (El == E) return;
    // The dispatch (kernels::moe::Dispatch): the rows sent, and as many received.
    auto& d = a.dispatch;
    const size_t ranks = size_t(E / El), sent = sent_rows(N);
    fn(d.send_rows, ranks);
    fn(d.sent_token, sent);
    fn(d.sent_choice, sent * k);
    fn(d.recv_rows, ranks);
    fn(d.expert, sent * k);
    fn(d.weight, sent * k);
    fn(d.offset, size_t(El) + 1);
    fn(d.pair, sent * k);
    fn(d.row, rows);
  }
  // s.extra, carved by Scratch below; the padded rows (s.pad) of an expert's balanced load,
  // N x k / El rows, under full precision in fp32; under expert parallelism the exchanges' rows
  // (s.wire): what dispatch_forward and dispatch_backward send and receive, sent_rows(N) each way.
  template <class P, class S, class Fn>
  void scratch_buffers(size_t N, S& s, Fn&& fn) const {
    const size_t rows = N * size_t(k), c = size_t(C), f = size_t(F);
    fn(s.extra, rows * (2 * c + 4 * f) + N * (size_t(E) + size_t(k) + c));
    if constexpr (kPadded<P>) {
      const size_t n = size_t(bucket(int((rows + size_t(El) - 1) / size_t(El))));
      // pad[0]: a forward's input (C or F wide); pad[1]: a backward's output gradient (2F or C);
      // pad[2]: its input (C or F); pad[3]: a product's output (2F or C, or a backward's input
      // gradient, F or C).
      fn(s.pad[0], n * std::max(c, f));
      fn(s.pad[1], n * std::max(2 * f, c));
      fn(s.pad[2], n * std::max(c, f));
      fn(s.pad[3], n * std::max(2 * f, c));
    }
    if (El == E) return;
    const size_t sent = sent_rows(N), W = size_t(kernels::moe::Dispatch<float>::dispatch_width(C, k)),
                 Wr = size_t(kernels::moe::Dispatch<float>::return_width(C, k));
    // wire[0], [1]: forward's rows out and in (W wide), backward's output gradients (C);
    // wire[2], [3]: forward's combined rows back (C), backward's input gradients back (Wr).
    fn(s.wire[0], sent * W);
    fn(s.wire[1], sent * W);
    fn(s.wire[2], sent * Wr);
    fn(s.wire[3], sent * Wr);
  }
  // The rows a rank sends under expert parallelism for N tokens: each token once to each rank
  // holding any of its kept choices, at most min(k, ranks). The count takes that bound, and as
  // many received (a balanced load: every rank sends as much as it receives).
  size_t sent_rows(size_t N) const { return N * size_t(std::min(k, E / El)); }
  template <class A>
  static auto selective(A&) {
    return std::array<std::nullptr_t, 0>{};
  }
  template <class P, typename T>
  void recompute(const P&, Acts<T>&, BackwardScratch<T>&, int) const {}

  // The balancing loss of the last forward into *aux, each expert's kept choices and the dropped
  // ones into loads (report_row: E + 1 per layer; the stage's MoeCounts, stage.h).
  static size_t report_row(const Config& c) { return size_t(c.n_experts) + 1; }
  template <typename T>
  static void note(const Acts<T>& a, double* aux, double* loads) {
    *aux += a.aux;
    for (int e = 0; e < a.route.E; ++e) loads[e] += double(a.route.load(e));
    loads[a.route.E] += double(a.route.dropped);
  }

  // res (this rank's rows) = residual + the tp sum of combine(experts(route(x))). x: the norm's
  // output as the policy multiplies it (all N rows), Tn tokens per sequence.
  template <class P, typename T>
  void forward(const P& pol, Acts<T>& a, typename P::Operand x, T* res, const T* residual, const WeightView<T>& p,
               BackwardScratch<T>& s, const SeqRows& r, int Tn, tp::Region& tp) const {
    namespace moe = kernels::moe;
    const int N = int(r.N);
    Scratch<T> m(*this, s, r.N, 0);
    router.forward(pol, m.logits, x, p, N);
    moe::softmax_rows(a.probs.data(), m.logits, N, E);
    moe::route(a.route, a.probs.data(), bias ? p.f32(bias, size_t(E)) : nullptr, N, {E, k, norm_topk, capacity, Tn});
    T* partial = r.split ? s.seq.data() : res;
    if (tp.ep_group()) {
      dispatch_forward(pol, a, x, partial, s, N, *tp.ep_group());
    } else {
      T* xs = pol.output(a.xs, m.rows_c);
      gather(xs, x, a.route);
      experts_forward(pol, a, xs, m, a.route.offset);
      moe::combine(partial, a.ys.data(), a.route, C);
    }
    const T* sums = reduce_rows(r, tp, partial, size_t(C));
    for (size_t i = 0; i < r.local * C; ++i) res[i] = sums[i] + residual[i];
    std::vector<T> per_sequence(size_t(N / Tn));
    a.aux = double(moe::aux_forward(per_sequence.data(), a.probs.data(), a.route, Tn));
  }

  // d: the output gradient (all N rows); dx (overwritten): this rank's part of the input
  // gradient (summed over tp by the block). done_out(router) once the experts' gradients are
  // final. A full backward only (parallel::check refuses zero-bubble with MoE).
  template <class P, typename T, class Done>
  void backward(const P& pol, Acts<T>& a, const GradView<T>* g, OutGrad<T> d, T* dx, typename P::Operand x,
                BackwardScratch<T>& s, int N, int Tn, tp::Region& tp, bool /*keep*/, Done&& done_out) const {
    namespace moe = kernels::moe;
    TRN_CHECK(g != nullptr);
    Scratch<T> m(*this, s, size_t(N), 0);
    if (tp.ep_group()) {
      dispatch_backward(pol, a, g, d.d, dx, m, s, N, *tp.ep_group());
      if (tp.size() > 1) tp.sum(m.dweight, size_t(N) * k);
    } else {
      moe::combine_backward(m.rows_c, m.dweight, d.d, a.ys.data(), a.route, C);
      if (tp.size() > 1) tp.sum(m.dweight, size_t(N) * k);
      experts_backward(pol, a, g, m.rows_c, m, a.route.offset, a.route.rows());
      std::fill(dx, dx + size_t(N) * C, T(0));
      moe::scatter_add(dx, m.dxs, a.route, C);
    }
    done_out(router.w);
    // d loss / d (a sequence's balancing loss): the coefficient over this rank's sequences, as
    // the loss scale is one over its tokens.
    const T aux_scale = T(aux_coef) * s.loss_scale * T(Tn);
    moe::router_backward(m.logits, m.dweight, a.probs.data(), a.route, norm_topk, Tn, aux_scale);
    router.backward(pol, m.dx_router, g, OutGrad<T>::spent(m.logits), x, pol.weight(router.w), N);
    if (tp.rank() == 0)
      for (size_t i = 0; i < size_t(N) * C; ++i) dx[i] += m.dx_router[i];
  }
  template <class P, typename T>
  void backward_weights(const P&, const Acts<T>&, const GradView<T>&, typename P::Operand, BackwardScratch<T>&,
                        int) const {
    TRN_CHECK(false && "zero-bubble's weight pass with MoE (parallel::check refuses it)");
  }

 private:
  // The layer's scratch in s.extra (scratch_buffers sizes it for N x k grouped rows; a rank whose
  // experts received more rows under expert parallelism grows it). The per-token parts come
  // first, so growing keeps them.
  template <typename T>
  struct Scratch {
    T* logits;     // N x E: the router's logits; their gradient in backward
    T* dweight;    // N x k
    T* dx_router;  // N x C
    T* rows_c;     // rows x C: the grouped inputs before a bf16 policy keeps them; dys in backward
    T* act;        // rows x F: silu(gate) * up
    T* dact;       // rows x F
    T* dhs;        // rows x 2F
    T* dxs;        // rows x C
    std::vector<T>* pad;  // s.pad: the padded rows (expert_forward, expert_backward)
    // rows: the grouped rows to hold (0: N x k).
    Scratch(const MoeMlp& l, BackwardScratch<T>& s, size_t N, size_t rows) : pad(s.pad) {
      const size_t C = size_t(l.C), F = size_t(l.F);
      rows = std::max(rows, N * size_t(l.k));
      const size_t need = N * (size_t(l.E) + size_t(l.k) + C) + rows * (2 * C + 4 * F);
      if (s.extra.size() < need) s.extra.resize(need);
      T* at = s.extra.data();
      auto take = [&](size_t n) {
        T* q = at;
        at += n;
        return q;
      };
      logits = take(N * size_t(l.E));
      dweight = take(N * size_t(l.k));
      dx_router = take(N * C);
      rows_c = take(rows * C);
      act = take(rows * F);
      dact = take(rows * F);
      dhs = take(rows * 2 * F);
      dxs = take(rows * C);
    }
  };

  // fn(local expert, first grouped row, rows) for each of this rank's experts with rows, their
  // grouped rows [offset[e], offset[e + 1]).
  template <class Fn>
  void for_each_expert(const std::vector<int32_t>& offset, Fn&& fn) const {
    for (int e = 0; e < El; ++e) {
      const int from = offset[size_t(e)], n = offset[size_t(e) + 1] - from;
      if (n > 0) fn(e, from, n);
    }
  }

  // An expert's products run over its grouped rows padded with zero rows to a multiple of
  // kRowBucket, so that their shapes come from a small set that repeats: an expert's row count
  // changes every step, and a matmul of a new shape costs the kernel library a new primitive
  // (oneDNN: descriptor, dispatch, JIT, about a millisecond), which at moe-small's sizes took as
  // long as the products themselves. The padding leaves the row-wise products (outputs, input
  // gradients) alone: each row's dot products run in the same order whatever the row count. The
  // weight gradients' sums over rows gain exact zero terms; a library may block a longer sum
  // differently, so they can differ from an unpadded product's in the last bits (measured equal
  // with oneDNN on AVX-512). Every run pads alike, so runs stay comparable with each other.
  // Row counts below kernels::kOneDnnMinRows keep their own shape (those row-wise products run
  // in OpenBLAS). Under full precision in fp32 only (the oneDNN path whose primitives these are).
  // Where the grouped buffers hold bucket(n) rows from the expert's first (`room`: every expert
  // but those within a bucket of the end), the row-wise products run in place over them: the
  // rows past the expert's own are the next experts' (read, their outputs written and then
  // overwritten when those experts run, in ascending order), which changes none of its rows'
  // values and saves copying its rows in and out. The weight gradients' sums still take zero
  // rows copied.
  static constexpr int kRowBucket = 32;
  static int bucket(int n) { return (n + kRowBucket - 1) / kRowBucket * kRowBucket; }
  // The padded rows live in the stage's scratch (BackwardScratch::pad, sized by scratch_buffers
  // for a balanced load, grown by a busier expert), so the stage's count holds them.
  template <class P>
  static constexpr bool kPadded = std::is_same_v<P, FullPrecision<float>>;
  // rows x cols from src into b, zero rows to bucket(rows).
  static float* padded(std::vector<float>& b, const float* src, int rows, int cols) {
    const size_t n = size_t(rows) * cols, all = size_t(bucket(rows)) * cols;
    if (b.size() < all) b.resize(all);
    std::copy_n(src, n, b.data());
    std::fill(b.data() + n, b.data() + all, 0.0f);
    return b.data();
  }
  static float* out_buffer(std::vector<float>& b, int rows, int cols) {
    const size_t all = size_t(bucket(rows)) * cols;
    if (b.size() < all) b.resize(all);
    return b.data();
  }
  // One expert's out (n x O) = x (n x I) w^T; pad: the four padded buffers; room: the rows x
  // and out hold from this expert's first (later experts' rows past its n).
  template <class P, typename T>
  static void expert_forward(const P& pol, std::vector<T>* pad, T* out, typename P::Operand x,
                             typename P::Operand w, int n, int room, int I, int O) {
    if constexpr (kPadded<P>) {
      if (n >= kernels::kOneDnnMinRows && n % kRowBucket != 0) {
        if (bucket(n) <= room) return pol.linear_forward(out, x, w, bucket(n), I, O);
        float* y = out_buffer(pad[3], n, O);
        pol.linear_forward(y, padded(pad[0], x, n, I), w, bucket(n), I, O);
        std::copy_n(y, size_t(n) * O, out);
        return;
      }
    }
    pol.linear_forward(out, x, w, n, I, O);
  }
  // One expert's linear backward over its n grouped rows (d: their output gradients, spent);
  // room: the rows dx holds from this expert's first.
  template <class P, typename T>
  static void expert_backward(const P& pol, std::vector<T>* pad, T* dx, T* dw, T* d, typename P::Operand x,
                              typename P::Operand w, int n, int room, int IC, int OC) {
    if constexpr (kPadded<P>) {
      if (n % kRowBucket != 0) {
        const int np = bucket(n);
        float* dp = padded(pad[1], d, n, OC);
        float* xp = padded(pad[2], x, n, IC);
        if (n < kernels::kOneDnnMinRows) {
          pol.linear_backward(dx, nullptr, OutGrad<T>::spent(d), x, w, n, IC, OC);
          pol.linear_backward(nullptr, dw, OutGrad<T>::spent(dp), xp, w, np, IC, OC);
        } else if (np <= room) {
          pol.linear_backward(dx, dw, OutGrad<T>::spent(dp), xp, w, np, IC, OC);
        } else {
          float* dxp = out_buffer(pad[3], n, IC);
          pol.linear_backward(dxp, dw, OutGrad<T>::spent(dp), xp, w, np, IC, OC);
          std::copy_n(dxp, size_t(n) * IC, dx);
        }
        return;
      }
    }
    pol.linear_backward(dx, dw, OutGrad<T>::spent(d), x, w, n, IC, OC);
  }

  // Grows the activations (and a bf16 policy's output-gradient scratch) for G grouped rows, at
  // most `widest` of one expert (more than a balanced load can reach under expert parallelism).
  template <class P, typename T>
  static void fit(Acts<T>& a, BackwardScratch<T>& s, size_t G, size_t widest, size_t C, size_t F) {
    auto grow = [](auto& v, size_t n) {
      if (v.size() < n) v.resize(n);
    };
    grow(a.hs, G * 2 * F);
    grow(a.ys, G * C);
    P::reserve(a.xs, G * C, grow);
    if (!s.half.empty()) grow(s.half, widest * std::max(2 * F, C));
  }

  // The experts over their grouped inputs xs (as the policy computes them, kept into a.xs):
  // a.hs = [gate | up] rows, a.ys = down(swiglu) rows.
  template <class P, typename T>
  void experts_forward(const P& pol, Acts<T>& a, T* xs, const Scratch<T>& m, const std::vector<int32_t>& offset) const {
    const int G = offset[size_t(El)];
    const auto xs_op = pol.keep(a.xs, xs, size_t(G) * C);
    for_each_expert(offset, [&](int e, int from, int n) {
      expert_forward(pol, m.pad, a.hs.data() + size_t(from) * 2 * F, xs_op + size_t(from) * C,
                     pol.weight(gate_up0 + e * stride), n, G - from, C, 2 * F);
    });
    ops::swiglu_forward(m.act, a.hs.data(), G, F);
    SavedInput<T> none;  // nothing kept: the policy rounds in place where it rounds
    const auto act = pol.keep(none, m.act, size_t(G) * F);
    for_each_expert(offset, [&](int e, int from, int n) {
      expert_forward(pol, m.pad, a.ys.data() + size_t(from) * C, act + size_t(from) * F,
                     pol.weight(down0 + e * stride), n, G - from, F, C);
    });
  }

  // From the grouped output gradients dys: the experts' weight gradients and the grouped input
  // gradients m.dxs.
  template <class P, typename T>
  void experts_backward(const P& pol, Acts<T>& a, const GradView<T>* g, T* dys, const Scratch<T>& m,
                        const std::vector<int32_t>& offset, int G) const {
    ops::swiglu_forward(m.act, a.hs.data(), G, F);
    SavedInput<T> none;
    const auto act = pol.keep(none, m.act, size_t(G) * F);
    for_each_expert(offset, [&](int e, int from, int n) {
      expert_backward(pol, m.pad, m.dact + size_t(from) * F, g->at(down0 + e * stride),
                      dys + size_t(from) * C, act + size_t(from) * F, pol.weight(down0 + e * stride), n,
                      G - from, F, C);
    });
    ops::swiglu_backward(m.dhs, m.dact, a.hs.data(), G, F);
    const auto xs = pol.saved(a.xs);
    for_each_expert(offset, [&](int e, int from, int n) {
      expert_backward(pol, m.pad, m.dxs + size_t(from) * C, g->at(gate_up0 + e * stride),
                      m.dhs + size_t(from) * 2 * F, xs + size_t(from) * C, pol.weight(gate_up0 + e * stride),
                      n, G - from, C, 2 * F);
    });
  }

  // The most grouped rows any one of this rank's experts has.
  static size_t widest(const std::vector<int32_t>& offset) {
    int32_t w = 0;
    for (size_t e = 0; e + 1 < offset.size(); ++e) w = std::max(w, offset[e + 1] - offset[e]);
    return size_t(w);
  }

  template <typename T>
  static DataType dtype() {
    return std::is_same_v<T, double> ? DataType::kF64 : DataType::kF32;
  }
  // One all_to_all_v of rows: send_rows[q] rows of `width` from send to rank q, recv_rows[q]
  // from q into recv (resized), timed into the group.
  template <typename T>
  static void exchange(tp::Region::Experts& ep, const std::vector<T>& send, const std::vector<int>& send_rows,
                       std::vector<T>& recv, const std::vector<int>& recv_rows, int width) {
    const auto t0 = std::chrono::steady_clock::now();
    const size_t P = send_rows.size();
    std::vector<size_t> sc(P), rc(P);
    size_t total = 0;
    for (size_t q = 0; q < P; ++q) {
      sc[q] = size_t(send_rows[q]) * width;
      rc[q] = size_t(recv_rows[q]) * width;
      total += rc[q];
    }
    recv.resize(total);
    ep.comm->all_to_all_v(send.data(), sc, {}, recv.data(), rc, {}, dtype<T>())->wait();
    ep.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // The forward under expert parallelism: partial (N x C) = the combine of this rank's tokens'
  // kept choices, computed by the experts' ranks.
  template <class P, typename T>
  void dispatch_forward(const P& pol, Acts<T>& a, typename P::Operand x, T* partial, BackwardScratch<T>& s, int N,
                        tp::Region::Experts& ep) const {
    namespace moe = kernels::moe;
    moe::Dispatch<T>& d = a.dispatch;
    const int ranks = ep.comm->size(), W = moe::Dispatch<T>::dispatch_width(C, k);
    // The exchanged rows in the stage's scratch (s.wire), reused by every layer.
    std::vector<T>& send = s.wire[0];
    std::vector<T>& recv = s.wire[1];
    std::vector<T>& back = s.wire[2];
    std::vector<T>& returned = s.wire[3];
    std::vector<T> widened;
    moe::plan_dispatch(d, send, a.route, values(x, size_t(N) * C, widened), C, ranks);
    {  // the counts, once per layer: backward's are these reversed
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<size_t> sc(static_cast<size_t>(ranks)), rc(static_cast<size_t>(ranks));
      for (int q = 0; q < ranks; ++q) sc[size_t(q)] = size_t(d.send_rows[size_t(q)]);
      ep.comm->all_to_all_counts(sc, rc)->wait();
      d.recv_rows.assign(size_t(ranks), 0);
      for (int q = 0; q < ranks; ++q) d.recv_rows[size_t(q)] = int(rc[size_t(q)]);
      ep.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    exchange(ep, send, d.send_rows, recv, d.recv_rows, W);
    const int G = moe::plan_received(d, recv.data(), C);
    fit<P>(a, s, size_t(G), widest(d.offset), size_t(C), size_t(F));
    const Scratch<T> m(*this, s, size_t(N), size_t(G));
    T* xs = pol.output(a.xs, m.rows_c);
    moe::gather_received(xs, recv.data(), d, C);
    experts_forward(pol, a, xs, m, d.offset);
    back.resize(size_t(d.received()) * C);
    moe::combine_received(back.data(), a.ys.data(), d, C);
    exchange(ep, back, d.recv_rows, returned, d.send_rows, C);
    moe::combine_returned(partial, returned.data(), d, N, C);
  }

  // The backward under expert parallelism: the experts' weight gradients on their ranks; dx
  // (overwritten) this rank's tokens' input gradients through the experts and m.dweight the
  // combine weights' gradients (partial sums over tp).
  template <class P, typename T>
  void dispatch_backward(const P& pol, Acts<T>& a, const GradView<T>* g, const T* dout, T* dx, Scratch<T>& m,
                         BackwardScratch<T>& s, int N, tp::Region::Experts& ep) const {
    namespace moe = kernels::moe;
    const moe::Dispatch<T>& d = a.dispatch;
    const int G = d.grouped(), Wr = moe::Dispatch<T>::return_width(C, k);
    fit<P>(a, s, size_t(G), widest(d.offset), size_t(C), size_t(F));
    m = Scratch<T>(*this, s, size_t(N), size_t(G));
    std::vector<T>& send = s.wire[0];
    std::vector<T>& dback = s.wire[1];
    std::vector<T>& ret = s.wire[2];
    std::vector<T>& returned = s.wire[3];
    send.resize(size_t(d.sent()) * C);
    moe::pack_output_grad(send.data(), dout, d, C);
    exchange(ep, send, d.send_rows, dback, d.recv_rows, C);
    ret.resize(size_t(d.received()) * Wr);
    moe::combine_received_backward(m.rows_c, ret.data(), dback.data(), a.ys.data(), d, C);
    experts_backward(pol, a, g, m.rows_c, m, d.offset, G);
    moe::return_input_grad(ret.data(), m.dxs, d, C);
    exchange(ep, ret, d.recv_rows, returned, d.send_rows, Wr);
    std::fill(dx, dx + size_t(N) * C, T(0));
    moe::scatter_returned(dx, m.dweight, returned.data(), d, N, C);
  }

  // x's values as T (the norm's output, rounded as the policy multiplies it): the operand itself,
  // or its bf16 form widened into buf.
  template <typename T>
  static const T* values(const T* x, size_t, std::vector<T>&) {
    return x;
  }
  static const float* values(const kernels::Bf16Src& x, size_t n, std::vector<float>& buf) {
    if (x.f) return x.f;
    buf.resize(n);
    for (size_t i = 0; i < n; ++i) buf[i] = kernels::from_bf16(x.h[i]);
    return buf.data();
  }

  // xs (rows x C): each grouped row its token's row of x, read from the operand the norm's output
  // is multiplied as (the values themselves, or their bf16 rounding: a matmul input is rounded
  // the same before or after the gather).
  template <typename T>
  void gather(T* xs, const T* x, const kernels::moe::Routing<T>& route) const {
    kernels::moe::gather(xs, x, route, C);
  }
  void gather(float* xs, const kernels::Bf16Src& x, const kernels::moe::Routing<float>& route) const {
    for (int row = 0; row < route.rows(); ++row) {
      const size_t from = size_t(route.token[size_t(row)]) * C;
      float* o = xs + size_t(row) * C;
      if (x.f) std::copy_n(x.f + from, C, o);
      else
        for (int c = 0; c < C; ++c) o[c] = kernels::from_bf16(x.h[from + size_t(c)]);
    }
  }
};

}  // namespace trn::model
