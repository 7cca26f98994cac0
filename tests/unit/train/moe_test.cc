// The mixture-of-experts routing kernels (runtime/kernels/moe.h): the top-k choice, the capacity,
// the grouping, the balancing loss and bias, and a whole MoE layer's gradient (router, SwiGLU
// experts over grouped rows, combine, balancing loss) against central finite differences.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "runtime/kernels/llama_ref.h"
#include "runtime/kernels/moe.h"
#include "runtime/kernels/moe_dispatch.h"
#include "runtime/kernels/ref.h"
#include "tests/unit/train/grad_check.h"

namespace trn {
namespace {

namespace moe = kernels::moe;
namespace ref = kernels::ref;
using test::check_gradient;
using test::random_vec;

TEST_CASE("moe route: top-k by probability, renormalised weights, grouped in token order", "[unit][moe]") {
  // 3 tokens, 4 experts, top-2; one sequence of 3.
  const std::vector<double> probs = {0.1, 0.4, 0.3, 0.2,  //
                                     0.5, 0.1, 0.1, 0.3,  //
                                     0.25, 0.25, 0.4, 0.1};
  moe::Routing<double> r;
  moe::route(r, probs.data(), nullptr, 3, {4, 2, true, 0.0, 3});
  CHECK(r.choice == std::vector<int32_t>{1, 2, 0, 3, 2, 0});  // the tie 0.25/0.25 goes to expert 0
  CHECK(r.weight[0] == Approx(0.4 / 0.7));
  CHECK(r.weight[1] == Approx(0.3 / 0.7));
  CHECK(r.weight[4] == Approx(0.4 / 0.65));
  CHECK(r.offset == std::vector<int32_t>{0, 2, 3, 5, 6});
  CHECK(r.token == std::vector<int32_t>{1, 2, 0, 0, 2, 1});
  for (int n = 0; n < 3; ++n)
    for (int j = 0; j < 2; ++j) CHECK(r.token[size_t(r.slot[size_t(n) * 2 + j])] == n);
  CHECK(r.chosen == std::vector<int32_t>{2, 1, 2, 1});
  CHECK(r.dropped == 0);

  moe::Routing<double> raw;
  moe::route(raw, probs.data(), nullptr, 3, {4, 2, false, 0.0, 3});
  CHECK(raw.weight[0] == 0.4);
  CHECK(raw.weight[1] == 0.3);
}

TEST_CASE("moe route: the bias moves the choice, not the weights", "[unit][moe]") {
  const std::vector<double> probs = {0.1, 0.4, 0.3, 0.2};
  moe::Routing<double> r;
  // The bias scales a probability by exp(b): 0.25 would lift 0.1 over 0.3 if added to the
  // probabilities; on the logits it takes more than ln 3.
  std::vector<double> bias = {0.25, 0.0, 0.0, 0.0};
  moe::route(r, probs.data(), bias.data(), 1, {4, 2, false, 0.0, 1});
  CHECK(r.choice == std::vector<int32_t>{1, 2});
  bias = {1.2, 0.0, 0.0, -0.2};  // 0.1 e^1.2 = 0.33: expert 0 over expert 2, not over 1
  moe::route(r, probs.data(), bias.data(), 1, {4, 2, false, 0.0, 1});
  CHECK(r.choice == std::vector<int32_t>{1, 0});
  CHECK(r.weight[0] == 0.4);
  CHECK(r.weight[1] == 0.1);  // its probability, not its biased score
}

TEST_CASE("moe route: a bias chooses as the same bias added to the logits would", "[unit][moe]") {
  const int N = 64, E = 8, k = 3;
  const std::vector<double> logits = test::random_vec(size_t(N) * E, 11, 2.0);
  const std::vector<double> bias = test::random_vec(size_t(E), 12, 1.5);
  std::vector<double> shifted(logits);
  for (int n = 0; n < N; ++n)
    for (int e = 0; e < E; ++e) shifted[size_t(n) * E + e] += bias[size_t(e)];
  std::vector<double> probs(logits.size()), shifted_probs(logits.size());
  moe::softmax_rows(probs.data(), logits.data(), N, E);
  moe::softmax_rows(shifted_probs.data(), shifted.data(), N, E);
  moe::Routing<double> with_bias, on_logits;
  moe::route(with_bias, probs.data(), bias.data(), N, {E, k, true, 0.0, N});
  moe::route(on_logits, shifted_probs.data(), nullptr, N, {E, k, true, 0.0, N});
  CHECK(with_bias.choice == on_logits.choice);
  moe::Routing<double> plain;
  moe::route(plain, probs.data(), nullptr, N, {E, k, true, 0.0, N});
  CHECK(plain.choice != with_bias.choice);  // the bias did move choices
  for (size_t i = 0; i < with_bias.choice.size(); ++i)  // the weights stay the unbiased probabilities
    CHECK(with_bias.weight[i] ==
          probs[i / k * E + size_t(with_bias.choice[i])] / with_bias.norm[i / k]);
}

TEST_CASE("moe route: the capacity keeps first choices before second ones, per sequence", "[unit][moe]") {
  // Two sequences of 4 tokens, 2 experts, top-1, capacity factor 1: ceil(1 * 1 * 4 / 2) = 2 each.
  // Sequence 0 sends all four tokens to expert 0: tokens 2 and 3 are dropped. Sequence 1 is
  // balanced: nothing dropped, whatever sequence 0 did.
  std::vector<double> probs;
  for (int t = 0; t < 4; ++t) probs.insert(probs.end(), {0.9, 0.1});
  for (int t = 0; t < 4; ++t) probs.insert(probs.end(), t % 2 ? std::initializer_list<double>{0.2, 0.8}
                                                               : std::initializer_list<double>{0.7, 0.3});
  moe::Routing<double> r;
  moe::route(r, probs.data(), nullptr, 8, {2, 1, true, 1.0, 4});
  CHECK(r.dropped == 2);
  CHECK(r.slot[2] == -1);
  CHECK(r.slot[3] == -1);
  CHECK(r.load(0) == 4);  // tokens 0, 1 of sequence 0; 4, 6 of sequence 1
  CHECK(r.load(1) == 2);
  CHECK(r.chosen == std::vector<int32_t>{4, 0, 2, 2});  // before the capacity

  // Top-2 with room for 3 per expert in a sequence of 4 tokens over 2 experts: every first
  // choice is taken before any second one, so the last token in order of each expert's second
  // choices is the one dropped.
  std::vector<double> p2 = {0.9, 0.1, 0.8, 0.2, 0.3, 0.7, 0.4, 0.6};
  moe::route(r, p2.data(), nullptr, 4, {2, 2, true, 0.75, 4});
  // cap = ceil(0.75 * 2 * 4 / 2) = 3. First choices: e0 (t0, t1), e1 (t2, t3); second choices:
  // e1 (t0) kept, e1 (t1) dropped, e0 (t2) kept, e0 (t3) dropped.
  CHECK(r.dropped == 2);
  CHECK(r.slot[1 * 2 + 1] == -1);
  CHECK(r.slot[3 * 2 + 1] == -1);
  CHECK(r.slot[0 * 2 + 1] >= 0);
  CHECK(r.load(0) == 3);
  CHECK(r.load(1) == 3);
}

TEST_CASE("moe balancing loss and bias", "[unit][moe]") {
  // One sequence of 2 tokens, 2 experts, top-1: both choose expert 0. f = (1, 0),
  // P = mean probs; aux = 2 * (1 * P_0 + 0) = 2 * (0.6 + 0.7) / 2.
  const std::vector<double> probs = {0.6, 0.4, 0.7, 0.3};
  moe::Routing<double> r;
  moe::route(r, probs.data(), nullptr, 2, {2, 1, true, 0.0, 2});
  double aux = 0;
  CHECK(moe::aux_forward(&aux, probs.data(), r, 2) == Approx(1.3));
  // Uniform probabilities give aux = 1 whatever is chosen (every P_e = 1/E); a bias decides a tie.
  const std::vector<double> even = {0.5, 0.5, 0.5, 0.5};
  std::vector<double> tilt = {0.0, 0.0};
  moe::route(r, even.data(), tilt.data(), 2, {2, 1, true, 0.0, 2});
  CHECK(r.choice == std::vector<int32_t>{0, 0});  // a tie goes to the lower expert
  CHECK(moe::aux_forward(&aux, even.data(), r, 2) == Approx(1.0));
  tilt = {0.0, 1e-3};
  moe::route(r, even.data(), tilt.data(), 2, {2, 1, true, 0.0, 2});
  CHECK(r.choice == std::vector<int32_t>{1, 1});

  // Each bias moves by rate x (mean - load) / mean: in proportion to the expert's shortfall, and
  // the steps sum to zero.
  std::vector<float> bias = {0, 0, 0, 0};
  const std::vector<int64_t> loads = {10, 2, 4, 4};  // mean 5
  moe::update_bias(bias.data(), loads.data(), 4, 0.1f);
  CHECK(bias[0] == Approx(-0.1));
  CHECK(bias[1] == Approx(0.06));
  CHECK(bias[2] == Approx(0.02));
  CHECK(bias[3] == Approx(0.02));
  CHECK(std::abs(bias[0] + bias[1] + bias[2] + bias[3]) < 1e-6);
  const std::vector<float> before = bias;
  const std::vector<int64_t> equal = {3, 3, 3, 3};
  moe::update_bias(bias.data(), equal.data(), 4, 0.1f);
  CHECK(bias == before);
  const std::vector<int64_t> none = {0, 0, 0, 0};  // no tokens: no step (and no division by 0)
  moe::update_bias(bias.data(), none.data(), 4, 0.1f);
  CHECK(bias == before);
}

// A collapsed router: every token's logits favour experts 0 and 1 by 8 and 7 units over the rest,
// so top-2 of 8 sends every token to both (max/mean 4, six experts dead). Routing the same tokens
// again and again with update_bias after each pass, the bias undoes that within 40 passes and then
// holds the balance (no overshoot back out of it).
TEST_CASE("moe bias: undoes a collapsed router and holds the balance", "[unit][moe]") {
  const int N = 512, E = 8, k = 2;
  std::vector<double> logits = test::random_vec(size_t(N) * E, 21);
  for (int n = 0; n < N; ++n) {
    logits[size_t(n) * E + 0] += 8.0;
    logits[size_t(n) * E + 1] += 7.0;
  }
  std::vector<double> pd(logits.size());
  moe::softmax_rows(pd.data(), logits.data(), N, E);
  const std::vector<float> probs = test::to_float(pd);
  std::vector<float> bias(static_cast<size_t>(E), 0.0f);
  std::vector<int64_t> loads(static_cast<size_t>(E));
  moe::Routing<float> r;
  auto pass = [&] {
    moe::route(r, probs.data(), bias.data(), N, {E, k, true, 0.0, N});
    int64_t most = 0, least = N;
    for (int e = 0; e < E; ++e) {
      loads[size_t(e)] = r.load(e);
      most = std::max(most, loads[size_t(e)]);
      least = std::min(least, loads[size_t(e)]);
    }
    moe::update_bias(bias.data(), loads.data(), E, 0.1f);
    return std::pair{double(most) / (double(N) * k / E), least};
  };
  CHECK(pass().first == 4.0);
  for (int i = 1; i < 40; ++i) pass();
  for (int i = 40; i < 100; ++i) {
    const auto [max_mean, least] = pass();
    INFO("pass " << i);
    CHECK(max_mean <= 1.1);
    CHECK(least > 0);
  }
}

// A whole MoE layer in double: router logits = x Wg^T, softmax, route, then per expert e over its
// grouped rows h = xs W13_e^T (gate | up), a = silu(gate) * up, y = a W2_e^T; out = combine(y).
// The loss is sum(out * R) + coef * mean over sequences of aux.
struct Layer {
  int N = 8, C = 6, F = 5, E = 4, k = 2, S = 4;
  bool norm_topk = true;
  double capacity = 0, coef = 0.3;
  std::vector<double> x, wg, w13, w2, R;

  moe::Routing<double> r;
  std::vector<double> logits, probs, xs, h, a, ys, out, aux;

  double forward() {
    logits.assign(size_t(N) * E, 0);
    ref::linear_forward(logits.data(), x.data(), wg.data(), N, C, E);
    probs.assign(logits.size(), 0);
    moe::softmax_rows(probs.data(), logits.data(), N, E);
    moe::route(r, probs.data(), nullptr, N, {E, k, norm_topk, capacity, S});
    const int rows = r.rows();
    xs.assign(size_t(rows) * C, 0);
    moe::gather(xs.data(), x.data(), r, C);
    h.assign(size_t(rows) * 2 * F, 0);
    a.assign(size_t(rows) * F, 0);
    ys.assign(size_t(rows) * C, 0);
    for (int e = 0; e < E; ++e) {
      const int o = r.offset[size_t(e)], n = int(r.load(e));
      if (n == 0) continue;
      ref::linear_forward(h.data() + size_t(o) * 2 * F, xs.data() + size_t(o) * C, w13.data() + size_t(e) * 2 * F * C,
                          n, C, 2 * F);
      ref::swiglu_forward(a.data() + size_t(o) * F, h.data() + size_t(o) * 2 * F, n, F);
      ref::linear_forward(ys.data() + size_t(o) * C, a.data() + size_t(o) * F, w2.data() + size_t(e) * C * F, n, F, C);
    }
    out.assign(size_t(N) * C, 0);
    moe::combine(out.data(), ys.data(), r, C);
    aux.assign(size_t(N / S), 0);
    const double aux_sum = moe::aux_forward(aux.data(), probs.data(), r, S);
    double loss = 0;
    for (size_t i = 0; i < out.size(); ++i) loss += out[i] * R[i];
    return loss + coef * aux_sum / double(N / S);
  }

  // Gradients of forward()'s loss (forward must have run).
  void backward(std::vector<double>& dx, std::vector<double>& dwg, std::vector<double>& dw13,
                std::vector<double>& dw2) {
    const int rows = r.rows();
    std::vector<double> dys(size_t(rows) * C), dweight(size_t(N) * k);
    moe::combine_backward(dys.data(), dweight.data(), R.data(), ys.data(), r, C);
    std::vector<double> da(size_t(rows) * F), dh(size_t(rows) * 2 * F), dxs(size_t(rows) * C);
    dw13.assign(w13.size(), 0);
    dw2.assign(w2.size(), 0);
    for (int e = 0; e < E; ++e) {
      const int o = r.offset[size_t(e)], n = int(r.load(e));
      if (n == 0) continue;
      ref::linear_backward(da.data() + size_t(o) * F, dw2.data() + size_t(e) * C * F, dys.data() + size_t(o) * C,
                           a.data() + size_t(o) * F, w2.data() + size_t(e) * C * F, n, F, C);
      ref::swiglu_backward(dh.data() + size_t(o) * 2 * F, da.data() + size_t(o) * F, h.data() + size_t(o) * 2 * F, n,
                           F);
      ref::linear_backward(dxs.data() + size_t(o) * C, dw13.data() + size_t(e) * 2 * F * C,
                           dh.data() + size_t(o) * 2 * F, xs.data() + size_t(o) * C,
                           w13.data() + size_t(e) * 2 * F * C, n, C, 2 * F);
    }
    std::vector<double> dlogits(size_t(N) * E);
    moe::router_backward(dlogits.data(), dweight.data(), probs.data(), r, norm_topk, S, coef / double(N / S));
    dx.assign(x.size(), 0);
    dwg.assign(wg.size(), 0);
    ref::linear_backward(dx.data(), dwg.data(), dlogits.data(), x.data(), wg.data(), N, C, E);
    moe::scatter_add(dx.data(), dxs.data(), r, C);
  }

  // The smallest gap between a token's k-th and (k+1)-th score: finite differences of size h
  // must not change a choice.
  double margin() const {
    double m = 1e9;
    for (int n = 0; n < N; ++n) {
      std::vector<double> p(probs.begin() + size_t(n) * E, probs.begin() + size_t(n + 1) * E);
      std::sort(p.rbegin(), p.rend());
      m = std::min(m, p[size_t(k) - 1] - p[size_t(k)]);
    }
    return m;
  }
};

void check_layer(int E, int k, bool norm_topk, double capacity) {
  Layer L;
  L.E = E;
  L.k = k;
  L.norm_topk = norm_topk;
  L.capacity = capacity;
  L.x = random_vec(size_t(L.N) * L.C, 11);
  L.wg = random_vec(size_t(E) * L.C, 12, 0.8);
  L.w13 = random_vec(size_t(E) * 2 * L.F * L.C, 13, 0.5);
  L.w2 = random_vec(size_t(E) * L.C * L.F, 14, 0.5);
  L.R = random_vec(size_t(L.N) * L.C, 15);
  L.forward();
  REQUIRE(L.margin() > 1e-4);  // the seeds give every choice room
  if (capacity > 0) REQUIRE(L.r.dropped > 0);
  std::vector<double> dx, dwg, dw13, dw2;
  L.backward(dx, dwg, dw13, dw2);
  auto loss = [&] { return L.forward(); };
  check_gradient("x", L.x, dx, loss);
  check_gradient("router", L.wg, dwg, loss);
  check_gradient("w1/w3", L.w13, dw13, loss);
  check_gradient("w2", L.w2, dw2, loss);
}

TEST_CASE("moe layer gradient: top-2 of 4, renormalised", "[unit][moe]") { check_layer(4, 2, true, 0.0); }
TEST_CASE("moe layer gradient: top-3 of 8, raw probabilities", "[unit][moe]") { check_layer(8, 3, false, 0.0); }
TEST_CASE("moe layer gradient: with a capacity that drops", "[unit][moe]") { check_layer(4, 2, true, 0.5); }

}  // namespace
}  // namespace trn

namespace trn {
namespace {

// The rows rank p sends to each rank, in a buffer grouped by destination: what an all-to-all-v
// delivers, source by source (an in-process stand-in for the communicator, for this logic test).
std::vector<std::vector<double>> exchange(const std::vector<std::vector<double>>& send,
                                          const std::vector<std::vector<int>>& rows, int width) {
  const size_t P = send.size();
  std::vector<std::vector<double>> recv(P);
  for (size_t p = 0; p < P; ++p) {
    size_t at = 0;
    for (size_t q = 0; q < P; ++q) {
      const size_t n = size_t(rows[p][q]) * size_t(width);
      recv[q].insert(recv[q].end(), send[p].begin() + long(at), send[p].begin() + long(at + n));
      at += n;
    }
  }
  return recv;
}

// Expert parallelism over P ranks, each routing its own sequences, against one process that
// routes them all: the same outputs, input gradients, weights' gradients (the router's summed over
// the ranks, as gradient sync does) and balancing loss.
void check_expert_parallel(int P, int E, int k, bool norm_topk, double capacity) {
  Layer one;
  one.N = 4 * P;  // each rank: one sequence of S = 4 tokens
  one.E = E;
  one.k = k;
  one.norm_topk = norm_topk;
  one.capacity = capacity;
  const int C = one.C, F = one.F, S = one.S, Nr = one.N / P;
  one.x = random_vec(size_t(one.N) * C, 21);
  one.wg = random_vec(size_t(E) * C, 22, 0.8);
  one.w13 = random_vec(size_t(E) * 2 * F * C, 23, 0.5);
  one.w2 = random_vec(size_t(E) * C * F, 24, 0.5);
  one.R = random_vec(size_t(one.N) * C, 25);
  const double one_loss = one.forward();
  std::vector<double> dx1, dwg1, dw131, dw21;
  one.backward(dx1, dwg1, dw131, dw21);

  const int El = E / P;
  std::vector<moe::Routing<double>> r(static_cast<size_t>(P));
  std::vector<moe::Dispatch<double>> d(static_cast<size_t>(P));
  std::vector<std::vector<double>> probs(static_cast<size_t>(P)), logits(static_cast<size_t>(P)), send(static_cast<size_t>(P));
  std::vector<std::vector<int>> rows(static_cast<size_t>(P));
  double aux_sum = 0;
  for (int p = 0; p < P; ++p) {
    const double* x = one.x.data() + size_t(p) * Nr * C;
    logits[size_t(p)].assign(size_t(Nr) * E, 0);
    ref::linear_forward(logits[size_t(p)].data(), x, one.wg.data(), Nr, C, E);
    probs[size_t(p)].assign(size_t(Nr) * E, 0);
    moe::softmax_rows(probs[size_t(p)].data(), logits[size_t(p)].data(), Nr, E);
    moe::route(r[size_t(p)], probs[size_t(p)].data(), nullptr, Nr,
               {E, k, norm_topk, capacity, S});
    std::vector<double> aux(size_t(Nr / S));
    aux_sum += moe::aux_forward(aux.data(), probs[size_t(p)].data(), r[size_t(p)], S);
    moe::plan_dispatch(d[size_t(p)], send[size_t(p)], r[size_t(p)], x, C, P);
    rows[size_t(p)] = d[size_t(p)].send_rows;
  }
  const auto recv = exchange(send, rows, moe::Dispatch<double>::dispatch_width(C, k));
  // Each destination: group, run its experts, combine its choices, send back.
  std::vector<std::vector<double>> xs(static_cast<size_t>(P)), h(static_cast<size_t>(P)), a(static_cast<size_t>(P)), ys(static_cast<size_t>(P)), back(static_cast<size_t>(P));
  std::vector<std::vector<int>> back_rows(static_cast<size_t>(P));
  for (int q = 0; q < P; ++q) {
    auto& dq = d[size_t(q)];
    dq.recv_rows.assign(size_t(P), 0);
    for (int p = 0; p < P; ++p) dq.recv_rows[size_t(p)] = rows[size_t(p)][size_t(q)];
    moe::group_received(dq, xs[size_t(q)], recv[size_t(q)].data(), C);
    const int G = dq.grouped();
    h[size_t(q)].assign(size_t(G) * 2 * F, 0);
    a[size_t(q)].assign(size_t(G) * F, 0);
    ys[size_t(q)].assign(size_t(G) * C, 0);
    for (int e = 0; e < El; ++e) {
      const int o = dq.offset[size_t(e)], n = dq.offset[size_t(e) + 1] - o, ge = q * El + e;
      if (n == 0) continue;
      ref::linear_forward(h[size_t(q)].data() + size_t(o) * 2 * F, xs[size_t(q)].data() + size_t(o) * C,
                          one.w13.data() + size_t(ge) * 2 * F * C, n, C, 2 * F);
      ref::swiglu_forward(a[size_t(q)].data() + size_t(o) * F, h[size_t(q)].data() + size_t(o) * 2 * F, n, F);
      ref::linear_forward(ys[size_t(q)].data() + size_t(o) * C, a[size_t(q)].data() + size_t(o) * F,
                          one.w2.data() + size_t(ge) * C * F, n, F, C);
    }
    back[size_t(q)].assign(size_t(dq.received()) * C, 0);
    moe::combine_received(back[size_t(q)].data(), ys[size_t(q)].data(), dq, C);
    back_rows[size_t(q)] = dq.recv_rows;
  }
  const auto returned = exchange(back, back_rows, C);
  double loss = 0;
  for (int p = 0; p < P; ++p) {
    std::vector<double> out(size_t(Nr) * C);
    moe::combine_returned(out.data(), returned[size_t(p)].data(), d[size_t(p)], Nr, C);
    for (size_t i = 0; i < out.size(); ++i) {
      CHECK(out[i] == Approx(one.out[size_t(p) * Nr * C + i]).margin(1e-12));
      loss += out[i] * one.R[size_t(p) * Nr * C + i];
    }
  }
  loss += one.coef * aux_sum / double(one.N / S);
  CHECK(loss == Approx(one_loss).epsilon(1e-12));

  // Backward.
  std::vector<std::vector<double>> gsend(static_cast<size_t>(P));
  for (int p = 0; p < P; ++p) {
    gsend[size_t(p)].assign(size_t(d[size_t(p)].sent()) * C, 0);
    moe::pack_output_grad(gsend[size_t(p)].data(), one.R.data() + size_t(p) * Nr * C, d[size_t(p)], C);
  }
  const auto grecv = exchange(gsend, rows, C);
  std::vector<double> dw13(one.w13.size()), dw2(one.w2.size());
  std::vector<std::vector<double>> ret(static_cast<size_t>(P));
  const int RW = moe::Dispatch<double>::return_width(C, k);
  for (int q = 0; q < P; ++q) {
    const auto& dq = d[size_t(q)];
    const int G = dq.grouped();
    std::vector<double> dys(size_t(G) * C), da(size_t(G) * F), dh(size_t(G) * 2 * F), dxs(size_t(G) * C);
    ret[size_t(q)].assign(size_t(dq.received()) * RW, 0);
    moe::combine_received_backward(dys.data(), ret[size_t(q)].data(), grecv[size_t(q)].data(), ys[size_t(q)].data(),
                                   dq, C);
    for (int e = 0; e < El; ++e) {
      const int o = dq.offset[size_t(e)], n = dq.offset[size_t(e) + 1] - o, ge = q * El + e;
      if (n == 0) continue;
      ref::linear_backward(da.data() + size_t(o) * F, dw2.data() + size_t(ge) * C * F, dys.data() + size_t(o) * C,
                           a[size_t(q)].data() + size_t(o) * F, one.w2.data() + size_t(ge) * C * F, n, F, C);
      ref::swiglu_backward(dh.data() + size_t(o) * 2 * F, da.data() + size_t(o) * F,
                           h[size_t(q)].data() + size_t(o) * 2 * F, n, F);
      ref::linear_backward(dxs.data() + size_t(o) * C, dw13.data() + size_t(ge) * 2 * F * C,
                           dh.data() + size_t(o) * 2 * F, xs[size_t(q)].data() + size_t(o) * C,
                           one.w13.data() + size_t(ge) * 2 * F * C, n, C, 2 * F);
    }
    moe::return_input_grad(ret[size_t(q)].data(), dxs.data(), dq, C);
  }
  const auto gback = exchange(ret, back_rows, RW);
  std::vector<double> dwg(one.wg.size());
  for (int p = 0; p < P; ++p) {
    std::vector<double> dx(size_t(Nr) * C), dweight(size_t(Nr) * k), dlogits(size_t(Nr) * E);
    const double* x = one.x.data() + size_t(p) * Nr * C;
    moe::scatter_returned(dx.data(), dweight.data(), gback[size_t(p)].data(), d[size_t(p)], Nr, C);
    moe::router_backward(dlogits.data(), dweight.data(), probs[size_t(p)].data(), r[size_t(p)], norm_topk, S,
                         one.coef / double(one.N / S));
    std::vector<double> dxr(size_t(Nr) * C);
    ref::linear_backward(dxr.data(), dwg.data(), dlogits.data(), x, one.wg.data(), Nr, C, E);
    for (size_t i = 0; i < dx.size(); ++i)
      CHECK(dx[i] + dxr[i] == Approx(dx1[size_t(p) * Nr * C + i]).margin(1e-12));
  }
  for (size_t i = 0; i < dwg.size(); ++i) CHECK(dwg[i] == Approx(dwg1[i]).margin(1e-12));
  for (size_t i = 0; i < dw13.size(); ++i) CHECK(dw13[i] == Approx(dw131[i]).margin(1e-12));
  for (size_t i = 0; i < dw2.size(); ++i) CHECK(dw2[i] == Approx(dw21[i]).margin(1e-12));
}

TEST_CASE("moe expert parallelism: dispatch, combine and backward equal one process", "[unit][moe]") {
  SECTION("2 ranks, top-2 of 4") { check_expert_parallel(2, 4, 2, true, 0.0); }
  SECTION("4 ranks, top-3 of 8, raw weights") { check_expert_parallel(4, 8, 3, false, 0.0); }
  SECTION("2 ranks, top-2 of 4 with drops") { check_expert_parallel(2, 4, 2, true, 0.5); }
  SECTION("4 ranks, one expert each, top-2") { check_expert_parallel(4, 4, 2, true, 0.0); }
}

TEST_CASE("moe expert parallelism: a token goes once to each rank holding any of its choices", "[unit][moe]") {
  // 2 tokens, 4 experts on 2 ranks, top-2: token 0 chooses experts 0 and 1 (both rank 0), token 1
  // experts 1 and 2 (rank 0 and rank 1). Rank 0 gets 2 rows, rank 1 one.
  const std::vector<double> probs = {0.5, 0.4, 0.05, 0.05, 0.1, 0.5, 0.3, 0.1};
  moe::Routing<double> r;
  moe::route(r, probs.data(), nullptr, 2, {4, 2, true, 0.0, 2});
  const std::vector<double> x = {1, 2, 3, 4};
  moe::Dispatch<double> d;
  std::vector<double> buf;
  moe::plan_dispatch(d, buf, r, x.data(), 2, 2);
  CHECK(d.send_rows == std::vector<int>{2, 1});
  CHECK(d.sent_token == std::vector<int32_t>{0, 1, 1});
  // Row 0: token 0's x, weights 0.5/0.9 and 0.4/0.9, local experts 0 and 1.
  REQUIRE(buf.size() == 3 * 6);
  CHECK(buf[0] == 1);
  CHECK(buf[2] == Approx(0.5 / 0.9));
  CHECK(buf[4] == 0);
  CHECK(buf[5] == 1);
  // Row 2: token 1 on rank 1: one choice (expert 2, local 0), the second slot padded.
  CHECK(buf[12] == 3);
  CHECK(buf[14] == Approx(0.3 / 0.8));
  CHECK(buf[15] == 0);
  CHECK(buf[16] == 0);
  CHECK(buf[17] == -1);
}

}  // namespace
}  // namespace trn
