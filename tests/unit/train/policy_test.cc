// The precision policies of runtime/model/stage.h: what each keeps of a matmul input, that the
// places a rounded output gradient may go give one result, that every policy finalises the
// gradient buffer in one order (the contract of prefix_done), and that a stage's activation
// bytes can be counted before it is built.
#include <catch2/catch.hpp>
#include <type_traits>
#include <vector>

#include "runtime/kernels/bf16.h"
#include "runtime/model/stage.h"
#include "tests/unit/train/grad_check.h"

using namespace trn;
using namespace trn::test;

namespace {

const model::Config kShape{3, 2, 8, 6, 11};  // n_layer, n_head, d_model, ctx, vocab

model::Config with(model::Config c, model::Precision p) {
  c.precision = p;
  return c;
}

std::vector<int32_t> tokens(size_t n, int vocab, uint64_t seed) {
  std::vector<int32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = int32_t((i * 7 + seed * 13) % size_t(vocab));
  return t;
}

// The prefix_done calls of one full backward of a whole-model Stage<T>.
template <typename T>
std::vector<size_t> done_order(const model::Config& c) {
  const int B = 2, Tn = 5;
  model::ParamLayout lay(c);
  std::vector<T> p(lay.total()), g(lay.total(), T(0));
  const auto r = random_vec(lay.total(), 3, 0.3);
  for (size_t i = 0; i < p.size(); ++i) p[i] = T(r[i]);
  model::Bf16Weights w(lay);
  if constexpr (std::is_same_v<T, float>) w.refresh(p.data());
  model::Stage<T> s(lay, B, Tn);
  s.use_bf16_weights(w.data());
  const auto in = tokens(B * Tn, c.vocab, 1), tg = tokens(B * Tn, c.vocab, 2);
  s.forward(0, p.data(), in.data(), nullptr, tg.data());
  std::vector<size_t> order;
  s.backward(0, p.data(), g.data(), T(0.1), nullptr, [&](size_t n) { order.push_back(n); });
  return order;
}

}  // namespace

TEST_CASE("every precision policy finalises the gradient buffer in one order") {
  const auto fp32 = done_order<float>(with(kShape, model::Precision::kFp32));
  const auto bf16 = done_order<float>(with(kShape, model::Precision::kBf16));
  const auto f64 = done_order<double>(with(kShape, model::Precision::kBf16));  // double: FullPrecision
  // ln_f, then per block six tensors groups, then the embedding: a growing prefix.
  REQUIRE(fp32.size() == 2 + 6 * size_t(kShape.n_layer));
  for (size_t i = 1; i < fp32.size(); ++i) CHECK(fp32[i] >= fp32[i - 1]);
  CHECK(fp32.back() == model::ParamLayout(kShape).total());
  CHECK(bf16 == fp32);
  CHECK(f64 == fp32);
}

TEST_CASE(
    "FullPrecision keeps a matmul input as computed; Bf16Compute keeps it as bf16 and hands on the forms its "
    "kernel path reads") {
  model::BackwardScratch<float> s;
  const auto x0 = to_float(random_vec(37, 5, 3.0));

  const model::WeightView<float> no_weights;
  model::FullPrecision<float> full(no_weights, s);
  model::SavedInput<float> a;
  model::FullPrecision<float>::reserve(a, x0.size(), [](auto& v, size_t n) { v.resize(n); });
  CHECK(a.full.size() == x0.size());
  CHECK(a.half.empty());
  float* x = full.output(a, nullptr);
  CHECK(x == a.full.data());
  std::copy(x0.begin(), x0.end(), x);
  CHECK(full.keep(a, x, x0.size()) == x);
  CHECK(full.saved(a) == a.full.data());
  CHECK(a.full == x0);

  model::Bf16Compute half(no_weights, s);
  model::SavedInput<float> b;
  model::Bf16Compute::reserve(b, x0.size(), [](auto& v, size_t n) { v.resize(n); });
  CHECK(b.full.empty());
  CHECK(b.half.size() == x0.size());
  std::vector<float> scratch(x0);
  CHECK(half.output(b, scratch.data()) == scratch.data());
  // The emulated path also multiplies the rounded fp32 form in place; oneDNN reads only bf16.
  const kernels::Bf16Path before = kernels::bf16_path();
  for (auto path : {kernels::Bf16Path::kEmulated, kernels::Bf16Path::kOneDnn}) {
    kernels::set_bf16_path(path);
    INFO(kernels::bf16_path_name(path));
    std::copy(x0.begin(), x0.end(), scratch.begin());
    const kernels::Bf16Src now = half.keep(b, scratch.data(), scratch.size());
    CHECK(now.h == b.half.data());
    CHECK(half.saved(b).h == b.half.data());
    const bool emulated = path == kernels::Bf16Path::kEmulated;
    CHECK(now.f == (emulated ? scratch.data() : nullptr));
    for (size_t i = 0; i < x0.size(); ++i) {
      CHECK(b.half[i] == kernels::to_bf16(x0[i]));
      CHECK(scratch[i] == (emulated ? kernels::from_bf16(kernels::to_bf16(x0[i])) : x0[i]));
    }
  }
  kernels::set_bf16_path(before);
}

TEST_CASE(
    "Bf16Compute's matmul backward is the same with its output gradient rounded in place, into spare scratch "
    "or into its bf16 scratch") {
  const int N = 6, IC = 8, OC = 5;
  model::BackwardScratch<float> s;
  s.half.resize(size_t(N) * OC);
  const auto d0 = to_float(random_vec(size_t(N) * OC, 11));
  const auto xf = to_float(random_vec(size_t(N) * IC, 12)), wf = to_float(random_vec(size_t(IC) * OC, 13));
  std::vector<kernels::bf16> x(xf.size()), w(wf.size());
  kernels::round_to_bf16(x.data(), xf.data(), x.size());
  kernels::round_to_bf16(w.data(), wf.data(), w.size());
  model::WeightView<float> wv;
  wv.add_bf16(0, w.size(), kernels::Bf16Src(w.data()));
  const model::Bf16Compute pol(wv, s);
  struct Out {
    std::vector<float> dx, dw, db;
  };
  auto run = [&](auto make_grad) {
    Out o{std::vector<float>(size_t(N) * IC), std::vector<float>(size_t(IC) * OC), std::vector<float>(OC)};
    std::vector<float> d(d0), spare(d0.size());
    pol.matmul_backward(o.dx.data(), o.dw.data(), o.db.data(), make_grad(d, spare), x.data(), pol.weight(0),
                        N, IC, OC);
    return o;
  };
  using G = model::OutGrad<float>;
  const Out in_place = run([](std::vector<float>& d, std::vector<float>&) { return G::spent(d.data()); });
  const Out spare =
      run([](std::vector<float>& d, std::vector<float>& sp) { return G::kept(d.data(), sp.data()); });
  const Out own = run([](std::vector<float>& d, std::vector<float>&) { return G::kept(d.data()); });
  CHECK(in_place.dx == spare.dx);
  CHECK(in_place.dw == spare.dw);
  CHECK(in_place.db == spare.db);
  CHECK(own.dx == spare.dx);
  CHECK(own.dw == spare.dw);
  CHECK(own.db == spare.db);
  // The bias gradient sums the unrounded gradient.
  for (int j = 0; j < OC; ++j) {
    float sum = 0;
    for (int n = 0; n < N; ++n) sum += d0[size_t(n) * OC + j];
    CHECK(own.db[j] == Approx(sum).epsilon(1e-6));
  }
}

TEMPLATE_TEST_CASE("Stage::activation_bytes(layout, ...) counts what a Stage of that shape holds", "", float,
                   double) {
  const int B = 2, Tn = 5;
  model::Config llama = kShape;  // every family's stage counts its own buffers
  llama.arch = "llama";
  llama.n_kv_head = 1;
  llama.ffn_dim = 12;
  llama.tie_embeddings = false;
  for (const model::Config& shape : {kShape, llama})
  for (auto precision : {model::Precision::kFp32, model::Precision::kBf16})
    for (int tp : {1, 2})
      for (int part = 0; part < 4; ++part) {  // the whole model, or one of three pipeline chunks
        if (shape.arch == "llama" && tp > shape.kv_heads()) continue;
        model::Placement placement{tp, tp - 1, {}};
        if (part > 0) placement.chunks = {model::Chunk{part - 1, part, part == 1, part == 3}};
        const model::ParamLayout lay(with(shape, precision), placement);
        for (int slots : {1, 3}) {
          INFO("bf16 " << (precision == model::Precision::kBf16) << " tp " << tp << " part " << part
                       << " slots " << slots);
          const model::Stage<TestType> s(lay, B, Tn, slots);
          CHECK(model::Stage<TestType>::activation_bytes(lay, B, Tn, slots) == s.activation_bytes());
        }
      }
}

TEMPLATE_TEST_CASE("Stage::activation_bytes counts what a Mixtral stage holds, at every expert-parallel size", "",
                   float, double) {
  // The MoE layer's routing and padded rows, and under ep its dispatch plan and exchange rows,
  // are sized at construction as the count says.
  model::Config c = model::preset("mixtral-tiny");
  c.n_layer = 2;
  for (auto precision : {model::Precision::kFp32, model::Precision::kBf16})
    for (int ep : {1, 2, 4}) {
      if (precision == model::Precision::kBf16 && !std::is_same_v<TestType, float>) continue;
      model::Placement placement{1, 0, {}};
      placement.ep = ep;
      placement.ep_rank = ep - 1;
      const model::ParamLayout lay(with(c, precision), placement);
      INFO("bf16 " << (precision == model::Precision::kBf16) << " ep " << ep);
      const model::Stage<TestType> s(lay, 2, 16, 1);
      CHECK(model::Stage<TestType>::activation_bytes(lay, 2, 16, 1) == s.activation_bytes());
    }
}
