// --precision bf16: rounding, the bf16 GEMM's implementations against a double reference over
// the same bf16 operands, the model's bf16 matmuls, and the bf16 model against the double one.
//
// GEMM tolerance: both paths multiply bf16 values exactly and sum in fp32, so they differ from
// the double sum of the same products only by fp32 rounding of the partial sums: at most
// K * 2^-24 relative to sum_k |a_ik b_kj| (K < 1100 here), and far less in practice. 1e-5 of that
// sum passes any correct order of summation; a wrong index, a lost pair or a skipped block is
// off by O(1) of it.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>

#include "runtime/kernels/bf16.h"
#include "runtime/kernels/kernels.h"
#include "runtime/kernels/ref.h"
#include "runtime/model/one_stage.h"
#include "runtime/model/stage.h"
#include "tests/unit/train/grad_check.h"

using namespace trn;
using namespace trn::test;
using kernels::bf16;

namespace {

std::vector<bf16> random_bf16(size_t n, uint64_t seed) {
  const auto v = random_vec(n, seed);
  std::vector<bf16> h(n);
  for (size_t i = 0; i < n; ++i) h[i] = kernels::to_bf16(float(v[i]));
  return h;
}

using Gemm = void (*)(bool, bool, int, int, int, const bf16*, int, const bf16*, int, float, float*, int);

// C = beta * C0 + op(A) op(B) from gemm against the double sum of the same bf16 products.
void check_gemm(Gemm gemm, bool ta, bool tb, int M, int N, int K, float beta) {
  INFO("ta " << ta << " tb " << tb << " M " << M << " N " << N << " K " << K << " beta " << beta);
  const auto A = random_bf16(size_t(M) * K, 1 + M), B = random_bf16(size_t(K) * N, 2 + N);
  const int lda = ta ? M : K, ldb = tb ? K : N, ldc = N + 3;  // C with padding columns
  auto a = [&](int m, int k) { return double(kernels::from_bf16(ta ? A[size_t(k) * lda + m] : A[size_t(m) * lda + k])); };
  auto b = [&](int k, int n) { return double(kernels::from_bf16(tb ? B[size_t(n) * ldb + k] : B[size_t(k) * ldb + n])); };
  const auto c0 = random_vec(size_t(M) * ldc, 3);
  std::vector<float> C(c0.begin(), c0.end());
  if (beta == 0.0f)  // beta 0 must not read C
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n) C[size_t(m) * ldc + n] = std::numeric_limits<float>::quiet_NaN();
  gemm(ta, tb, M, N, K, A.data(), lda, B.data(), ldb, beta, C.data(), ldc);
  double worst = 0.0;
  bool pads_kept = true;
  for (int m = 0; m < M; ++m) {
    for (int n = 0; n < N; ++n) {
      double want = beta == 0.0f ? 0.0 : double(beta) * double(float(c0[size_t(m) * ldc + n]));
      double mag = std::abs(want);
      for (int k = 0; k < K; ++k) {
        want += a(m, k) * b(k, n);
        mag += std::abs(a(m, k) * b(k, n));
      }
      const double err = std::abs(double(C[size_t(m) * ldc + n]) - want) / (mag + 1e-30);
      worst = std::isnan(err) ? 1e9 : std::max(worst, err);
    }
    for (int n = N; n < ldc; ++n) pads_kept = pads_kept && C[size_t(m) * ldc + n] == float(c0[size_t(m) * ldc + n]);
  }
  CHECK(worst <= 1e-5);
  CHECK(pads_kept);
}

// Shapes across every block edge of the emulated path (512 x 256 x 1024), odd K, tails of 1..3
// rows and < 16 columns (oneDNN's brgemm: 16-column vectors, pairs of K).
void check_gemm_shapes(Gemm gemm) {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      check_gemm(gemm, ta, tb, 7, 5, 3, 0.0f);
      check_gemm(gemm, ta, tb, 33, 47, 65, 1.0f);
      check_gemm(gemm, ta, tb, 130, 530, 257, 0.0f);
      check_gemm(gemm, ta, tb, 515, 1030, 300, 0.5f);
    }
}

}  // namespace

TEST_CASE("bf16 rounding is to nearest even, keeps infinities and NaN, and widening is exact") {
  using kernels::from_bf16;
  using kernels::to_bf16;
  CHECK(to_bf16(1.0f) == 0x3f80);
  CHECK(from_bf16(0x3f80) == 1.0f);
  // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even significand (1.0).
  CHECK(to_bf16(1.0f + 0x1p-8f) == 0x3f80);
  // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6.
  CHECK(to_bf16(1.0f + 3 * 0x1p-8f) == 0x3f82);
  CHECK(to_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 0x3f81);  // above halfway: up
  CHECK(to_bf16(-2.0f) == 0xc000);
  CHECK(to_bf16(std::numeric_limits<float>::infinity()) == 0x7f80);
  CHECK(std::isnan(from_bf16(to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isnan(from_bf16(to_bf16(std::numeric_limits<float>::signaling_NaN()))));
  CHECK(to_bf16(3.4e38f) == 0x7f80);  // past the largest bf16: rounds to infinity, as IEEE does
  const auto v = random_vec(1000, 9);
  for (double x : v) {
    const float f = float(x), r = from_bf16(to_bf16(f));
    CHECK(std::abs(r - f) <= std::abs(f) * 0x1p-8f);  // half an ulp of an 8-bit significand
    CHECK(from_bf16(to_bf16(r)) == r);                // bf16 values round to themselves
  }
}

TEST_CASE("the emulated bf16 GEMM equals the double sum of the same bf16 products") {
  check_gemm_shapes(kernels::gemm_bf16_emulated);
}

TEST_CASE("the oneDNN bf16 GEMM equals the double sum (runs where oneDNN has a bf16 matmul for the CPU)") {
  const std::string impl = kernels::onednn_bf16_impl();
  if (impl.empty()) {
    WARN("SKIPPED: oneDNN " << kernels::onednn_version() << " has no bf16 matmul for this CPU ("
                            << kernels::cpu_features() << ")");
    CHECK_THROWS_WITH(kernels::parse_bf16_path("onednn"), Catch::Contains("has no bf16 matmul for this CPU"));
    CHECK(kernels::parse_bf16_path("auto") == kernels::Bf16Path::kEmulated);
    return;
  }
  INFO("oneDNN " << kernels::onednn_version() << ": " << impl);
  CHECK(kernels::parse_bf16_path("onednn") == kernels::Bf16Path::kOneDnn);
  // auto takes oneDNN exactly where the CPU has the BF16 units.
  CHECK(kernels::parse_bf16_path("auto") ==
        (kernels::cpu_has_avx512_bf16() ? kernels::Bf16Path::kOneDnn : kernels::Bf16Path::kEmulated));
  check_gemm_shapes(kernels::gemm_bf16_onednn);
}

TEST_CASE("a bad bf16 kernel choice is a usage error") {
  CHECK_THROWS_WITH(kernels::parse_bf16_path("fast"), Catch::Contains("takes auto, emulated or onednn"));
  CHECK_THROWS_WITH(kernels::parse_bf16_path("native"), Catch::Contains("takes auto, emulated or onednn"));
  CHECK(kernels::parse_bf16_path("emulated") == kernels::Bf16Path::kEmulated);
}

TEST_CASE("bf16 matmul forward and backward: bf16 operands, dout rounded to bf16, fp32 bias and db") {
  const int N = 37, IC = 19, OC = 23;
  const auto x = random_bf16(size_t(N) * IC, 11), w = random_bf16(size_t(IC) * OC, 12);
  const auto bias = random_vec(OC, 13), dout = random_vec(size_t(N) * OC, 14);
  auto wide = [](const std::vector<bf16>& h) {
    std::vector<double> d(h.size());
    for (size_t i = 0; i < h.size(); ++i) d[i] = kernels::from_bf16(h[i]);
    return d;
  };
  const auto xd = wide(x), wd = wide(w);
  std::vector<double> dout_r(dout.size());  // dout as the products see it
  for (size_t i = 0; i < dout.size(); ++i) dout_r[i] = kernels::from_bf16(kernels::to_bf16(float(dout[i])));
  const auto biasf = to_float(bias), doutf = to_float(dout);

  std::vector<float> out(size_t(N) * OC);
  kernels::matmul_forward_bf16(out.data(), x.data(), w.data(), biasf.data(), N, IC, OC);
  std::vector<double> want(out.size());
  const std::vector<double> biasd(biasf.begin(), biasf.end());
  kernels::ref::matmul_forward(want.data(), xd.data(), wd.data(), biasd.data(), N, IC, OC);
  CHECK(max_rel_diff(out, want) < 1e-6);

  std::vector<float> dx(size_t(N) * IC), dw(size_t(IC) * OC, 0.5f), db(OC, 0.25f);
  std::vector<bf16> scratch(size_t(N) * OC);
  kernels::matmul_backward_bf16(dx.data(), dw.data(), db.data(), doutf.data(), scratch.data(), x.data(), w.data(), N,
                                IC, OC);
  std::vector<double> dxd(dx.size()), dwd(dw.size(), 0.5), dbd(db.size(), 0.25), dbd_exact(db.size(), 0.25);
  kernels::ref::matmul_backward(dxd.data(), dwd.data(), dbd.data(), dout_r.data(), xd.data(), wd.data(), N, IC, OC);
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < OC; ++o) dbd_exact[o] += double(doutf[size_t(n) * OC + o]);
  CHECK(max_rel_diff(dx, dxd) < 1e-6);
  CHECK(max_rel_diff(dw, dwd) < 1e-6);
  CHECK(max_rel_diff(db, dbd_exact) < 1e-6);  // the bias gradient sums the unrounded fp32 dout
  CHECK(max_rel_diff(db, dbd) > 1e-6);        // (which differs visibly from the rounded one)
}

TEST_CASE("rounding through bf16 in fp32 is to_bf16 then from_bf16, bit for bit, NaN and infinity included") {
  auto v = to_float(random_vec(4099, 31, 3.0));
  const float specials[] = {0.0f, -0.0f, 1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 3.4e38f, -3.4e38f, 1e-40f, -1e-45f,
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::signaling_NaN(),
                            -std::numeric_limits<float>::quiet_NaN()};
  std::copy(std::begin(specials), std::end(specials), v.begin());
  std::vector<float> x = v, y = v;
  std::vector<bf16> h(v.size());
  kernels::round_through_bf16(x.data(), h.data(), x.size());
  kernels::round_through_bf16(y.data(), nullptr, y.size());
  for (size_t i = 0; i < v.size(); ++i) {
    INFO("element " << i << " = " << v[i]);
    const bf16 want = kernels::to_bf16(v[i]);
    CHECK(h[i] == want);
    const float wf = kernels::from_bf16(want);
    CHECK(std::memcmp(&x[i], &wf, sizeof wf) == 0);
    CHECK(std::memcmp(&y[i], &wf, sizeof wf) == 0);
  }
}

namespace {

// Widened to fp32, padded to a larger leading dimension (ld_from -> ld_to per row).
std::vector<float> widened_padded(const std::vector<bf16>& h, int rows, int ld_from, int ld_to) {
  std::vector<float> f(size_t(rows) * ld_to, std::numeric_limits<float>::quiet_NaN());
  for (int r = 0; r < rows; ++r)
    kernels::widen_bf16(f.data() + size_t(r) * ld_to, h.data() + size_t(r) * ld_from, size_t(ld_from));
  return f;
}

using GemmSrc = void (*)(bool, bool, int, int, int, kernels::Bf16Src, int, kernels::Bf16Src, int, float, float*, int);

// Every mix of the two operand forms gives what the bf16 form gives, bit for bit, with the fp32
// forms stored at a wider leading dimension than the bf16 ones.
void check_operand_forms(GemmSrc gemm, bool ta, bool tb, int M, int N, int K, float beta) {
  INFO("ta " << ta << " tb " << tb << " M " << M << " N " << N << " K " << K << " beta " << beta);
  const auto A = random_bf16(size_t(M) * K, 5 + M), B = random_bf16(size_t(K) * N, 6 + N);
  const int lda = ta ? M : K, ldb = tb ? K : N, ldc = N + 1;
  const int arows = ta ? K : M, brows = tb ? N : K;
  const auto Af = widened_padded(A, arows, lda, lda + 5), Bf = widened_padded(B, brows, ldb, ldb + 3);
  const auto c0 = to_float(random_vec(size_t(M) * ldc, 7));
  std::vector<float> want = c0;
  gemm(ta, tb, M, N, K, A.data(), lda, B.data(), ldb, beta, want.data(), ldc);
  for (int form = 1; form < 4; ++form) {
    INFO("A " << (form & 1 ? "fp32" : "bf16") << ", B " << (form & 2 ? "fp32" : "bf16"));
    const kernels::Bf16Src a = form & 1 ? kernels::Bf16Src::widened(Af.data()) : kernels::Bf16Src(A.data());
    const kernels::Bf16Src b = form & 2 ? kernels::Bf16Src::widened(Bf.data()) : kernels::Bf16Src(B.data());
    std::vector<float> got = c0;
    gemm(ta, tb, M, N, K, a, form & 1 ? lda + 5 : lda, b, form & 2 ? ldb + 3 : ldb, beta, got.data(), ldc);
    CHECK(std::memcmp(got.data(), want.data(), sizeof(float) * got.size()) == 0);
  }
}

}  // namespace

TEST_CASE("a bf16 GEMM operand held widened in fp32 gives the bf16 operand's result bit for bit") {
  std::vector<GemmSrc> gemms{kernels::gemm_bf16_emulated};
  if (!kernels::onednn_bf16_impl().empty()) gemms.push_back(kernels::gemm_bf16_onednn);
  for (GemmSrc gemm : gemms)
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        check_operand_forms(gemm, ta, tb, 7, 5, 3, 0.0f);
        check_operand_forms(gemm, ta, tb, 530, 1030, 300, 1.0f);  // past every block edge of both
      }
}

TEST_CASE("bf16 matmul and LM-head backward: dout rounded in fp32, in place or not, equals dout rounded to bf16") {
  const int N = 37, IC = 19, OC = 23;
  const auto x = random_bf16(size_t(N) * IC, 41), w = random_bf16(size_t(IC) * OC, 42);
  const auto dout = to_float(random_vec(size_t(N) * OC, 43));
  std::vector<float> dx1(size_t(N) * IC), dw1(size_t(IC) * OC, 0.5f), db1(OC, 0.25f);
  std::vector<bf16> half(dout.size());
  kernels::matmul_backward_bf16(dx1.data(), dw1.data(), db1.data(), dout.data(), half.data(), x.data(), w.data(), N,
                                IC, OC);
  for (bool in_place : {false, true}) {
    INFO("in place " << in_place);
    std::vector<float> dx2(dx1.size()), dw2(dw1.size(), 0.5f), db2(db1.size(), 0.25f), d = dout;
    std::vector<float> r(in_place ? 0 : dout.size());
    kernels::matmul_backward_bf16(dx2.data(), dw2.data(), db2.data(), d.data(), in_place ? d.data() : r.data(),
                                  x.data(), w.data(), N, IC, OC);
    CHECK(dx2 == dx1);
    CHECK(dw2 == dw1);
    CHECK(db2 == db1);
    if (!in_place) CHECK(d == dout);  // the caller's dout is left alone
  }
  // The LM head: dlogits (N, V) against wte (V, C), x (N, C).
  const int V = OC, C = IC;
  std::vector<float> hx1(size_t(N) * C), hw1(size_t(V) * C, 0.5f), hx2(hx1.size()), hw2(hw1.size(), 0.5f);
  const auto wte = random_bf16(size_t(V) * C, 44);
  kernels::lmhead_backward_bf16(hx1.data(), hw1.data(), dout.data(), half.data(), x.data(), wte.data(), N, C, V);
  std::vector<float> dl = dout;
  kernels::lmhead_backward_bf16(hx2.data(), hw2.data(), dl.data(), x.data(), wte.data(), N, C, V);
  CHECK(hx2 == hx1);
  CHECK(hw2 == hw1);
}

namespace {

const model::Config kCfg{2, 2, 8, 6, 11};  // n_layer, n_head, d_model, ctx, vocab

model::Config bf16_of(model::Config c) {
  c.precision = model::Precision::kBf16;
  return c;
}

std::vector<int32_t> tokens(size_t n, int vocab, uint64_t seed) {
  Rng r(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = int32_t(r.below(vocab));
  return t;
}

}  // namespace

TEST_CASE("the bf16 model tracks the double model to bf16 rounding, for any thread split") {
  // bf16 keeps 8 significant bits (relative rounding up to 2^-8 = 4e-3) of each matmul operand; through
  // two blocks and the head the loss moves by about that and the gradients by a few times more.
  // 1e-2 (loss) and 5e-2 of the largest gradient leave room for that and catch a wrong term.
  const int B = 4, T = 6;
  model::ParamLayout lay(kCfg);
  const auto params = random_vec(lay.total(), 43, 0.3);
  const auto in = tokens(B * T, kCfg.vocab, 44), tg = tokens(B * T, kCfg.vocab, 45);
  model::Stage<double> core(lay, B, T);
  std::vector<double> grads(lay.total(), 0.0);
  const double loss = core.forward(0, params.data(), in.data(), nullptr, tg.data()) / (B * T);
  core.backward(0, params.data(), grads.data(), 1.0 / (B * T), nullptr, {});
  std::vector<float> first;
  for (int threads : {1, 2}) {
    model::OneStageModel m(bf16_of(kCfg), B, T, threads);
    for (size_t i = 0; i < lay.total(); ++i) m.params()[i] = float(params[i]);
    m.zero_grad();
    const double lf = m.forward_backward(in.data(), tg.data(), 1.0f / (B * T));
    INFO("threads " << threads);
    CHECK(lf == Approx(loss).epsilon(1e-2));
    CHECK(lf != Approx(loss).epsilon(1e-7));  // it did compute in bf16
    const std::vector<float> g(m.grads(), m.grads() + lay.total());
    CHECK(max_rel_diff(g, grads) < 5e-2);
    if (first.empty()) first = g;
  }
}

TEST_CASE("the bf16 weight copy follows every change of the fp32 master") {
  const int B = 2, T = 6;
  model::OneStageModel m(bf16_of(kCfg), B, T, 1), fresh(bf16_of(kCfg), B, T, 1);
  m.init(1);
  const auto in = tokens(B * T, kCfg.vocab, 46), tg = tokens(B * T, kCfg.vocab, 47);
  const double before = m.forward(in.data(), tg.data());
  for (size_t i = 0; i < m.num_params(); ++i) m.params()[i] *= 1.5f;  // as an optimizer step would
  const double after = m.forward(in.data(), tg.data());
  CHECK(after != before);
  std::memcpy(fresh.params(), static_cast<const model::OneStageModel&>(m).params(), sizeof(float) * m.num_params());
  CHECK(fresh.forward(in.data(), tg.data()) == after);  // as if built from those weights
}

TEST_CASE("bf16: an input-only backward and the weight pass give a full backward's gradients bit for bit") {
  const int B = 2, T = 6;
  const model::Config c = bf16_of(kCfg);
  model::ParamLayout lay(c);
  const auto p = to_float(random_vec(lay.total(), 50, 0.3));
  model::Bf16Weights w(lay);
  w.refresh(p.data());
  const auto in = tokens(B * T, c.vocab, 51), tg = tokens(B * T, c.vocab, 52);
  model::Stage<float> s(lay, B, T);
  s.use_bf16_weights(w.data());
  std::vector<float> full(lay.total(), 0.0f), split(lay.total(), 0.0f);
  s.forward(0, p.data(), in.data(), nullptr, tg.data());
  s.backward(0, p.data(), full.data(), 0.1f, nullptr, {});
  s.forward(0, p.data(), in.data(), nullptr, tg.data());
  s.backward(0, p.data(), split.data(), 0.1f, nullptr, {}, model::BackwardPart::kInput);
  s.backward_weights(0, split.data());
  CHECK(full == split);
}

TEST_CASE("a bf16 stage stores its matmul inputs as 16-bit values") {
  const int B = 3, T = 6;
  const model::Config c{2, 2, 8, 6, 11};
  model::ParamLayout l32(c), l16(bf16_of(c));
  model::Stage<float> s32(l32, B, T), s16(l16, B, T);
  const size_t N = B * T, C = c.d_model, layers = c.n_layer;
  // Per layer ln1, qkv, atty, ln2, fch_gelu (C + 3C + C + C + 4C per token), and the head's lnf,
  // drop from 4 bytes to 2; the bf16 stage adds an output gradient in bf16 (N x the widest of
  // 4C, 3C, C and the vocabulary) and one sequence's q, k, v in fp32 (T x 3C).
  const size_t halved = layers * N * 10 * C + N * C;
  const size_t widest = std::max<size_t>(4 * C, c.vocab);
  CHECK(s16.activation_bytes() == s32.activation_bytes() - 2 * halved + 2 * N * widest + 4 * T * 3 * C);
  CHECK(s16.activation_bytes() < s32.activation_bytes());
}

TEST_CASE("a bf16 stage refuses to run without its bf16 weights") {
  model::ParamLayout lay(bf16_of(kCfg));
  model::Stage<float> s(lay, 1, 6);
  const std::vector<float> p(lay.total(), 0.0f);
  const auto in = tokens(6, kCfg.vocab, 1);
  CHECK_THROWS_WITH(s.forward(0, p.data(), in.data(), nullptr, in.data()), Catch::Contains("use_bf16_weights"));
}
