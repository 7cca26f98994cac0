// The Llama family end to end in one process: double-precision gradients against finite
// differences (tied and untied heads, every grouping of KV heads), the float model against the
// double one, the zero-bubble split against the full backward, and its layout's names.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>

#include "runtime/kernels/llama.h"
#include "runtime/model/llama.h"
#include "runtime/model/one_stage.h"
#include "runtime/model/stage.h"
#include "tests/unit/train/grad_check.h"

using namespace trn;
using namespace trn::test;
using model::Config;

namespace {

Config llama(int n_kv_head, bool tied) {
  Config c{2, 4, 16, 8, 11};  // n_layer, n_head, d_model (head size 4), ctx, vocab
  c.arch = "llama";
  c.n_kv_head = n_kv_head;
  c.ffn_dim = 24;
  c.rope_theta = 10000.0;
  c.tie_embeddings = tied;
  return c;
}

std::vector<int32_t> tokens(size_t n, int vocab, uint64_t seed) {
  Rng r(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = int32_t(r.below(vocab));
  return t;
}

}  // namespace

TEST_CASE("a Llama layout has Hugging Face LlamaForCausalLM's names and shapes") {
  const model::ParamLayout untied(llama(2, false));
  CHECK(untied.find("lm_head.weight").global_shape == std::vector<int64_t>{11, 16});
  CHECK(untied.find("model.layers.1.self_attn.k_proj.weight").global_shape == std::vector<int64_t>{8, 16});
  CHECK(untied.find("model.layers.0.self_attn.o_proj.weight").global_shape == std::vector<int64_t>{16, 16});
  CHECK(untied.find("model.layers.0.mlp.down_proj.weight").global_shape == std::vector<int64_t>{16, 24});
  CHECK(untied.find("model.norm.weight").shape == std::vector<int64_t>{16});
  CHECK(untied.tied() == nullptr);
  CHECK(untied.tensors().size() == 2 * 9 + 3);
  const model::ParamLayout tied(llama(2, true));
  CHECK(tied.find_or_null("lm_head.weight") == nullptr);
  REQUIRE(tied.tied() != nullptr);
  CHECK(tied.tied()->name == "model.embed_tokens.weight");
  // Norms are not decayed, every 2-D tensor is.
  for (const auto& t : untied.tensors()) CHECK(t.decay == (t.shape.size() == 2));
}

TEST_CASE("Llama gradients match finite differences in double precision") {
  const int B = 2, T = 5;
  for (const auto& [kv, tied] : std::vector<std::pair<int, bool>>{{2, false}, {1, true}, {4, false}, {1, false}}) {
    const Config c = llama(kv, tied);
    INFO("n_kv_head " << kv << " tied " << tied);
    model::ParamLayout lay(c);
    auto params = random_vec(lay.total(), 40 + kv, 0.3);
    const auto in = tokens(B * T, c.vocab, 41), tg = tokens(B * T, c.vocab, 42);
    model::Stage<double> core(lay, B, T);
    std::vector<double> grads(lay.total(), 0.0);
    core.forward(0, params.data(), in.data(), nullptr, tg.data());
    core.backward(0, params.data(), grads.data(), 1.0, nullptr, {});
    auto loss = [&] { return core.forward(0, params.data(), in.data(), nullptr, tg.data()); };
    check_gradient("llama", params, grads, loss, 1500);
  }
}

TEST_CASE("Qwen2's q/k/v biases, an explicit head_dim and llama3 rope scaling: finite differences and layout") {
  // head_dim 6 over d_model 16 (6 x 4 heads = 24 query columns), biases, and rope scaling whose
  // bands hold one pair each of a 6-wide head at theta 10000: wavelengths 2 pi, 2 pi 10^(4/3) ~ 135
  // and 2 pi 10^(8/3) ~ 2916 against original_ctx / high = 10 and original_ctx / low = 2000: the
  // first kept, the second interpolated, the third divided by the factor.
  Config c = llama(2, true);
  c.head_size = 6;
  c.qkv_bias = true;
  c.rope_factor = 8;
  c.rope_low_freq_factor = 0.01;
  c.rope_high_freq_factor = 2;
  c.rope_original_ctx = 20;
  c.validate();
  model::ParamLayout lay(c);
  CHECK(lay.find("model.layers.0.self_attn.q_proj.weight").global_shape == std::vector<int64_t>{24, 16});
  CHECK(lay.find("model.layers.0.self_attn.o_proj.weight").global_shape == std::vector<int64_t>{16, 24});
  CHECK(lay.find("model.layers.1.self_attn.q_proj.bias").global_shape == std::vector<int64_t>{24});
  CHECK(lay.find("model.layers.1.self_attn.v_proj.bias").global_shape == std::vector<int64_t>{12});
  CHECK(lay.tensors().size() == 2 * 12 + 2);
  const kernels::RopeScaling s = model::rope_scaling(c);
  const double f1 = std::pow(1e4, -1.0 / 3), f2 = std::pow(1e4, -2.0 / 3);
  const double smooth = (20 / (2 * M_PI / f1) - 0.01) / (2 - 0.01);
  CHECK(kernels::rope_frequency(0, 6, 1e4, s) == 1.0);
  CHECK(kernels::rope_frequency(1, 6, 1e4, s) == Approx((1 - smooth) * f1 / 8 + smooth * f1));
  CHECK(kernels::rope_frequency(2, 6, 1e4, s) == Approx(f2 / 8));
  const int B = 2, T = 5;
  auto params = random_vec(lay.total(), 47, 0.3);
  const auto in = tokens(B * T, c.vocab, 48), tg = tokens(B * T, c.vocab, 49);
  model::Stage<double> core(lay, B, T);
  std::vector<double> grads(lay.total(), 0.0);
  core.forward(0, params.data(), in.data(), nullptr, tg.data());
  core.backward(0, params.data(), grads.data(), 1.0, nullptr, {});
  auto loss = [&] { return core.forward(0, params.data(), in.data(), nullptr, tg.data()); };
  check_gradient("qwen2", params, grads, loss, 1500);
  // The biases get gradient (they are not dead weights).
  const size_t qb = lay.find("model.layers.0.self_attn.q_proj.bias").offset;
  double sum = 0;
  for (size_t i = 0; i < 24; ++i) sum += std::abs(grads[qb + i]);
  CHECK(sum > 0);
}

TEST_CASE("the float Llama matches the double one, with any thread count") {
  const int B = 4, T = 6;
  const Config c = llama(2, false);
  model::ParamLayout lay(c);
  const auto params = random_vec(lay.total(), 43, 0.3);
  const auto in = tokens(B * T, c.vocab, 44), tg = tokens(B * T, c.vocab, 45);
  model::Stage<double> core(lay, B, T);
  std::vector<double> grads(lay.total(), 0.0);
  const double loss = core.forward(0, params.data(), in.data(), nullptr, tg.data()) / (B * T);
  core.backward(0, params.data(), grads.data(), 1.0 / (B * T), nullptr, {});
  for (int threads : {1, 2, 3}) {
    model::OneStageModel m(c, B, T, threads);
    for (size_t i = 0; i < lay.total(); ++i) m.params()[i] = float(params[i]);
    m.zero_grad();
    const double lf = m.forward_backward(in.data(), tg.data(), 1.0f / (B * T));
    INFO("threads " << threads);
    CHECK(lf == Approx(loss).epsilon(1e-5));
    CHECK(max_rel_diff(std::vector<float>(m.grads(), m.grads() + lay.total()), grads) < 1e-5);
  }
}

TEMPLATE_TEST_CASE("a Llama input-only backward plus the weight pass equals the full backward", "", float, double) {
  const int B = 2, T = 5;
  for (auto precision : {model::Precision::kFp32, model::Precision::kBf16}) {
    Config c = llama(2, false);
    c.precision = precision;
    model::ParamLayout lay(c);
    const auto p64 = random_vec(lay.total(), 50, 0.3);
    const std::vector<TestType> params(p64.begin(), p64.end());
    const auto in = tokens(B * T, c.vocab, 51), tg = tokens(B * T, c.vocab, 52);
    model::Bf16Weights w(lay);
    if constexpr (std::is_same_v<TestType, float>) w.refresh(params.data());
    model::Stage<TestType> s(lay, B, T);
    s.use_bf16_weights(w.data());
    std::vector<TestType> full(lay.total(), 0), split(lay.total(), 0);
    std::vector<size_t> done;
    s.forward(0, params.data(), in.data(), nullptr, tg.data());
    s.backward(0, params.data(), full.data(), TestType(0.1), nullptr, [&](size_t n) { done.push_back(n); });
    s.forward(0, params.data(), in.data(), nullptr, tg.data());
    s.backward(0, params.data(), split.data(), TestType(0.1), nullptr, {}, model::BackwardPart::kInput);
    s.backward_weights(0, split.data());
    INFO("bf16 " << (precision == model::Precision::kBf16));
    CHECK(std::memcmp(full.data(), split.data(), full.size() * sizeof(TestType)) == 0);
    // The finished prefix grows to the whole buffer.
    REQUIRE(!done.empty());
    CHECK(std::is_sorted(done.begin(), done.end()));
    CHECK(done.back() == lay.total());
  }
}

TEST_CASE("Llama's shapes are checked with one usage error each") {
  Config c = llama(3, false);
  CHECK_THROWS_WITH(c.validate(), Catch::Contains("--n-kv-head 3 must divide --n-head 4"));
  c = llama(2, false);
  CHECK_THROWS_WITH(model::check_tensor_parallel(c, 4), Catch::Contains("use --tp one of 1, 2"));
  CHECK(model::parse_config(c.describe()).describe() == c.describe());
  CHECK(model::parse_config("n_layer=2 n_head=4 d_model=128 ctx=128 vocab=256").arch == "gpt2");
  CHECK_THROWS(model::parse_config("arch=llama n_layer=2"));
  CHECK_THROWS(model::parse_config("arch=mamba n_layer=2"));
  // The optional fields (Hugging Face models' head_dim, q/k/v biases, llama3 rope scaling) are
  // written only where they differ from the defaults, so a model without them describes as before.
  CHECK(c.describe().find("head_dim") == std::string::npos);
  model::Config h = c;
  h.head_size = 64;
  h.qkv_bias = true;
  h.rope_factor = 32;
  h.rope_original_ctx = 8192;
  const std::string d = h.describe();
  CHECK_THAT(d, Catch::EndsWith(" head_dim=64 qkv_bias=1 rope_factor=32"));
  const model::Config back = model::parse_config(d);
  CHECK(back.head_dim() == 64);
  CHECK(back.qkv_bias);
  CHECK(back.rope_factor == 32);
  CHECK(back.describe() == d);
  CHECK_THROWS_WITH(model::parse_config(c.describe() + " qkv_bias=0"), Catch::Contains("not in the form trn writes"));
  CHECK_THROWS_WITH(model::parse_config(c.describe() + " window=4"), Catch::Contains("is not a field of llama"));
  CHECK_THROWS_WITH(model::parse_config(d.substr(0, d.find(" head_dim")) + " rope_factor=32 head_dim=64"),
                    Catch::Contains("not in the form trn writes"));
}
