// Weight and gradient views (runtime/model/views.h): offsets map into their own segment, a
// whole-buffer view is the buffer itself, segment storage keeps the whole buffer's alignment,
// and a stage whose weights and gradients are held in separate pieces computes what the
// whole-buffer stage computes, bit for bit, under fp32 and bf16, for GPT-2 and Llama.
#include "runtime/model/views.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "runtime/kernels/bf16.h"
#include "runtime/model/stage.h"
#include "tests/unit/train/grad_check.h"

using namespace trn;
using namespace trn::test;

TEST_CASE("a whole-buffer view gives the buffer's own pointers") {
  std::vector<float> p(40), g(40);
  std::vector<kernels::bf16> h(40);
  const auto w = model::WeightView<float>::whole(p.data(), p.size());
  const auto gv = model::GradView<float>::whole(g.data(), g.size());
  for (size_t off : {size_t(0), size_t(7), size_t(39)}) {
    CHECK(w.f32(off) == p.data() + off);
    CHECK(gv.at(off) == g.data() + off);
  }
  CHECK(w.f32(0, 40) == p.data());
  CHECK_FALSE(w.has_bf16());

  model::WeightView<float> half = model::WeightView<float>::whole(p.data(), p.size());
  half.add_bf16(0, h.size(), kernels::Bf16Src(h.data()));
  CHECK(half.has_bf16());
  CHECK(half.bf16(5).h == h.data() + 5);
  CHECK(half.bf16(5).f == nullptr);
  CHECK(half.f32(5) == p.data() + 5);  // the master form is still the fp32 segment

  std::vector<float> widened(40);
  model::WeightView<float> wide;
  wide.add_bf16(0, widened.size(), kernels::Bf16Src::widened(widened.data()));
  CHECK(wide.bf16(9).f == widened.data() + 9);
  CHECK(wide.bf16(9).h == nullptr);
}

TEST_CASE("a view of several segments maps each offset into its own segment") {
  std::vector<double> a(10), b(15);
  model::WeightView<double> w;
  w.add_f32(20, 30, a.data()).add_f32(30, 45, b.data());
  CHECK(w.f32(20) == a.data());
  CHECK(w.f32(28, 2) == a.data() + 8);
  CHECK(w.f32(30) == b.data());
  CHECK(w.f32(44) == b.data() + 14);
  CHECK(w.f32(30, 15) == b.data());

  std::vector<float> ga(5), gb(5);
  model::GradView<float> g;
  g.add(100, 105, ga.data()).add(0, 5, gb.data());
  CHECK(g.at(103) == ga.data() + 3);
  CHECK(g.at(0, 5) == gb.data());
#ifdef NDEBUG
  // Outside every segment of its form, or straddling two: null (an assertion in debug builds),
  // never a pointer computed outside an allocation.
  CHECK(w.f32(19) == nullptr);
  CHECK(w.f32(45) == nullptr);
  CHECK(w.f32(29, 2) == nullptr);
  CHECK_FALSE(w.bf16(25));  // no bf16 form held
  CHECK(g.at(5) == nullptr);
  CHECK(g.at(104, 2) == nullptr);
#endif
}

TEST_CASE("segment storage puts each element where a whole aligned buffer would, modulo 64 bytes") {
  for (size_t begin : {size_t(0), size_t(1), size_t(15), size_t(16), size_t(1000003)}) {
    model::SegmentStorage<float> f(begin, begin + 33);
    CHECK(f.size() == 33);
    CHECK(reinterpret_cast<uintptr_t>(f.data()) % kBufferAlign == (begin * sizeof(float)) % kBufferAlign);
    model::SegmentStorage<kernels::bf16> h(begin, begin + 3);
    CHECK(reinterpret_cast<uintptr_t>(h.data()) % kBufferAlign == (begin * 2) % kBufferAlign);
    model::SegmentStorage<double> d(begin, begin + 1);
    CHECK(reinterpret_cast<uintptr_t>(d.data()) % kBufferAlign == (begin * sizeof(double)) % kBufferAlign);
  }
}

namespace {

std::vector<int32_t> tokens(size_t n, int vocab, uint64_t seed) {
  std::vector<int32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = int32_t((i * 7 + seed * 13) % size_t(vocab));
  return t;
}

// The pieces a sharded model holds apart: each block whole (a block's body may read adjacent
// tensors as one, e.g. Llama's q, k and v), every other tensor on its own.
std::vector<std::pair<size_t, size_t>> pieces(const model::ParamLayout& lay) {
  std::vector<std::pair<size_t, size_t>> out;
  for (const auto& b : lay.blocks)
    if (b.end > b.begin) out.push_back({b.begin, b.end});
  for (const model::TensorSpec& t : lay.tensors()) {
    bool in_block = false;
    for (const auto& b : lay.blocks) in_block |= t.offset >= b.begin && t.offset < b.end;
    if (!in_block) out.push_back({t.offset, t.offset + t.numel});
  }
  return out;
}

struct Run {
  double loss = 0;
  std::vector<float> grads;
};

// One forward and backward (full, or input then weights) of a whole-model stage, over the whole
// buffers or over views of separately held pieces of the same values.
Run run(const model::Config& c, bool split, bool zero_bubble) {
  const int B = 2, Tn = 5;
  model::ParamLayout lay(c);
  std::vector<float> p(lay.total());
  const auto r = random_vec(lay.total(), 3, 0.3);
  for (size_t i = 0; i < p.size(); ++i) p[i] = float(r[i]);
  model::Bf16Weights bf(lay);
  bf.refresh(p.data());
  model::Stage<float> s(lay, B, Tn);
  s.use_bf16_weights(bf.data());
  const auto in = tokens(B * Tn, c.vocab, 1), tg = tokens(B * Tn, c.vocab, 2);
  const auto part = zero_bubble ? model::BackwardPart::kInput : model::BackwardPart::kFull;
  Run out;
  out.grads.assign(lay.total(), 0.0f);
  if (!split) {
    out.loss = s.forward(0, p.data(), in.data(), nullptr, tg.data());
    s.backward(0, p.data(), out.grads.data(), 0.1f, nullptr, {}, part);
    if (zero_bubble) s.backward_weights(0, out.grads.data());
    return out;
  }
  std::vector<std::unique_ptr<model::SegmentStorage<float>>> ws, gs, widened;
  std::vector<std::unique_ptr<model::SegmentStorage<kernels::bf16>>> halves;
  model::WeightView<float> w;
  model::GradView<float> g;
  const kernels::Bf16Src copy = bf.data();
  for (auto [b, e] : pieces(lay)) {
    ws.push_back(std::make_unique<model::SegmentStorage<float>>(b, e));
    std::memcpy(ws.back()->data(), p.data() + b, sizeof(float) * (e - b));
    w.add_f32(b, e, ws.back()->data());
    gs.push_back(std::make_unique<model::SegmentStorage<float>>(b, e));
    std::fill(gs.back()->data(), gs.back()->data() + (e - b), 0.0f);
    g.add(b, e, gs.back()->data());
    if (copy.f) {
      widened.push_back(std::make_unique<model::SegmentStorage<float>>(b, e));
      std::memcpy(widened.back()->data(), copy.f + b, sizeof(float) * (e - b));
      w.add_bf16(b, e, kernels::Bf16Src::widened(widened.back()->data()));
    } else if (copy.h) {
      halves.push_back(std::make_unique<model::SegmentStorage<kernels::bf16>>(b, e));
      std::memcpy(halves.back()->data(), copy.h + b, sizeof(kernels::bf16) * (e - b));
      w.add_bf16(b, e, halves.back()->data());
    }
  }
  out.loss = s.forward(0, w, in.data(), nullptr, tg.data());
  s.backward(0, w, g, 0.1f, nullptr, {}, part);
  if (zero_bubble) s.backward_weights(0, g);
  for (const auto& piece : gs)
    std::memcpy(out.grads.data() + piece->begin(), piece->data(), sizeof(float) * piece->size());
  return out;
}

}  // namespace

TEST_CASE("a stage over views of separately held pieces computes what it computes over whole buffers") {
  const model::Config gpt2{3, 2, 8, 6, 11};  // n_layer, n_head, d_model, ctx, vocab
  model::Config llama{2, 4, 16, 8, 11};
  llama.arch = "llama";
  llama.n_kv_head = 2;
  llama.ffn_dim = 24;
  llama.tie_embeddings = false;
  // Each path against itself (the two may differ from each other).
  std::vector<kernels::Bf16Path> paths{kernels::Bf16Path::kEmulated};
  if (!kernels::onednn_bf16_impl().empty()) paths.push_back(kernels::Bf16Path::kOneDnn);
  const kernels::Bf16Path before = kernels::bf16_path();
  for (const model::Config& base : {gpt2, llama})
    for (auto precision : {model::Precision::kFp32, model::Precision::kBf16})
      for (auto path : paths)
        for (bool zero_bubble : {false, true}) {
          model::Config c = base;
          c.precision = precision;
          kernels::set_bf16_path(path);
          INFO(c.arch << (precision == model::Precision::kBf16 ? " bf16 " : " fp32 ")
                      << kernels::bf16_path_name(path)
                      << (zero_bubble ? " input, then weights" : " full backward"));
          const Run whole = run(c, false, zero_bubble), split = run(c, true, zero_bubble);
          CHECK(split.loss == whole.loss);
          CHECK(split.grads == whole.grads);
        }
  kernels::set_bf16_path(before);
}
