#include "runtime/optim/adamw.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <fmt/format.h>

#include "collectives/communicator.h"
#include "collectives/core/error.h"

namespace trn::optim {

AdamW::AdamW(const model::ParamLayout& layout, AdamWConfig cfg)
    : AdamW(layout, cfg, NormGroup{norm_pieces(layout, 1, 1, 0, 0), nullptr}) {}

AdamW::AdamW(const model::ParamLayout& layout, AdamWConfig cfg, NormGroup norm)
    : AdamW(layout, cfg, std::vector<Range>{Range{0, layout.total()}}) {
  whole_ = true;
  norm_ = std::move(norm);
  TRN_CHECK(norm_.pieces.cuts().back() == layout.total());
}

AdamW::AdamW(const model::ParamLayout& layout, AdamWConfig cfg, const std::vector<Range>& owned)
    : owned_(owned), whole_(false), n_(layout.total()), norm_{norm_pieces(layout, 1, 1, 0, 0), nullptr}, cfg_(cfg) {
  size_t state = 0;
  for (const Range& r : owned_) {
    TRN_CHECK(r.begin <= r.end && r.end <= layout.total());
    for (const auto& t : layout.tensors()) {
      const size_t b = std::max(r.begin, t.offset), e = std::min(r.end, t.offset + t.numel);
      if (b < e) segments_.push_back({b, e, state + (b - r.begin), t.decay});
    }
    state += r.size();
  }
  m_.assign(state, 0.0f);
  v_.assign(state, 0.0f);
}

namespace {

// AdamW's per-element constants of one step, by value so that no store through the arrays can
// change them (with them read through references the compiler reloads them every element and
// keeps the loop scalar).
struct StepConsts {
  float b1, b2, one_minus_b1, one_minus_b2, inv_bc2_sqrt, eps, step_size, decay;
  float grad_scale;  // the clipping factor (clip_scale), 1 when not clipping
};

// One AdamW update of n elements: p, m, v and g are distinct arrays (restrict), so the loop
// vectorizes. Every element runs the same operations in the same order as one at a time (no sum
// across elements), so the vector width changes no bit; g[i] * grad_scale is the value
// clip_to_norm would have left in g. kClear: g[i] is set to 0 once read.
template <bool kClear>
void adamw_elements(float* __restrict p, float* __restrict m, float* __restrict v, float* __restrict g, size_t n,
                    const StepConsts c) {
  for (size_t i = 0; i < n; ++i) {
    const float gi = g[i] * c.grad_scale;
    if constexpr (kClear) g[i] = 0.0f;
    const float mi = c.b1 * m[i] + c.one_minus_b1 * gi;
    const float vi = c.b2 * v[i] + c.one_minus_b2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi) * c.inv_bc2_sqrt + c.eps;
    p[i] = p[i] * c.decay - c.step_size * (mi / denom);
  }
}

}  // namespace

void AdamW::step(float* params, const float* grads, float lr, ThreadPool& pool) {
  // Without clear the gradients are only read.
  step_scaled(params, const_cast<float*>(grads), false, 1.0f, lr, pool);
}

void AdamW::step_scaled(float* params, float* grads, bool clear, float grad_scale, float lr, ThreadPool& pool) {
  ++t_;
  const float b1 = cfg_.beta1, b2 = cfg_.beta2;
  const double bc1 = 1.0 - std::pow(double(b1), double(t_));
  const double bc2_sqrt = std::sqrt(1.0 - std::pow(double(b2), double(t_)));
  StepConsts c{};
  c.b1 = b1;
  c.b2 = b2;
  c.one_minus_b1 = 1.0f - b1;
  c.one_minus_b2 = 1.0f - b2;
  c.inv_bc2_sqrt = static_cast<float>(1.0 / bc2_sqrt);
  c.eps = cfg_.eps;
  c.step_size = static_cast<float>(lr / bc1);
  c.grad_scale = grad_scale;
  const float decay = 1.0f - lr * cfg_.weight_decay;
  const size_t n = m_.size();
  const int nt = pool.size();
  // Thread k updates state elements [lo, hi); state element j of a segment is its buffer
  // element j - state + begin, and compact element j.
  const bool compact_p = params_storage_ == Storage::kCompact, compact_g = grads_storage_ == Storage::kCompact;
  pool.run([&](int k) {
    const size_t lo = n * k / nt, hi = n * (k + 1) / nt;
    for (const Segment& s : segments_) {
      const size_t b = std::max(s.state, lo), e = std::min(s.state + (s.end - s.begin), hi);
      if (b >= e) continue;
      StepConsts sc = c;
      sc.decay = s.decay ? decay : 1.0f;
      const size_t at = s.begin + (b - s.state);  // b's buffer offset
      float* p = params + (compact_p ? b : at);
      float* g = grads + (compact_g ? b : at);
      if (clear) adamw_elements<true>(p, m_.data() + b, v_.data() + b, g, e - b, sc);
      else adamw_elements<false>(p, m_.data() + b, v_.data() + b, g, e - b, sc);
    }
  });
}

double AdamW::grad_norm(const float* grads, ThreadPool& pool) {
  return global_norm(norm_, piece_sums(norm_.pieces, grads, pool));
}

void AdamW::update(float* params, float* grads, double grad_norm, float lr, ThreadPool& pool) {
  // Clipping is folded into the step: each gradient is read once, times the factor clip_to_norm
  // would have applied (element-wise, so the same bits as clipping first).
  step_scaled(params, grads, clears_grads(), clip_scale(grad_norm, cfg_.max_grad_norm), lr, pool);
}

std::string AdamW::describe() const {
  return fmt::format("AdamW m and v of {} of its {} parameters", m_.size(), n_);
}

void range_squares(const float* g, const Range* ranges, size_t count, double* out) {
  constexpr size_t kChains = 8;
  size_t i = 0;
  for (; i + kChains <= count; i += kChains) {
    const float* p[kChains];
    double s[kChains];
    size_t common = SIZE_MAX;
    for (size_t c = 0; c < kChains; ++c) {
      p[c] = g + ranges[i + c].begin;
      s[c] = 0.0;
      common = std::min(common, ranges[i + c].size());
    }
    for (size_t j = 0; j < common; ++j) {
#pragma GCC unroll 8
      for (size_t c = 0; c < kChains; ++c) s[c] += double(p[c][j]) * p[c][j];
    }
    for (size_t c = 0; c < kChains; ++c) {
      for (size_t j = common; j < ranges[i + c].size(); ++j) s[c] += double(p[c][j]) * p[c][j];
      out[i + c] = s[c];
    }
  }
  for (; i < count; ++i) {
    double s = 0.0;
    for (size_t j = ranges[i].begin; j < ranges[i].end; ++j) s += double(g[j]) * g[j];
    out[i] = s;
  }
}

std::vector<double> piece_sums(const NormPieces& pieces, const float* g, ThreadPool& pool) {
  const std::vector<NormPieces::Piece>& ps = pieces.pieces;
  std::vector<double> sums(ps.size(), 0.0);
  const int nt = pool.size();
  // Thread k sums the counted ones of pieces [P k / nt, P (k + 1) / nt): each piece's sum is its
  // own loop, so which thread runs it changes nothing.
  pool.run([&](int k) {
    const size_t lo = ps.size() * size_t(k) / size_t(nt), hi = ps.size() * size_t(k + 1) / size_t(nt);
    std::vector<Range> ranges;
    std::vector<size_t> which;
    for (size_t i = lo; i < hi; ++i)
      if (ps[i].counted) {
        ranges.push_back({ps[i].begin, ps[i].end});
        which.push_back(i);
      }
    std::vector<double> out(ranges.size());
    range_squares(g, ranges.data(), ranges.size(), out.data());
    for (size_t i = 0; i < which.size(); ++i) sums[which[i]] = out[i];
  });
  return sums;
}

double global_norm(const NormGroup& group, const std::vector<double>& sums) {
  double local = group.pieces.combine(sums);
  if (group.comm) group.comm->all_reduce(&local, &local, 1, DataType::kF64, ReduceOp::kSum)->wait();
  return std::sqrt(local);
}

double sum_of_squares(const float* g, size_t n, ThreadPool& pool) {
  const size_t chunks = (n + kSumChunk - 1) / kSumChunk;
  std::vector<double> partial(chunks, 0.0);
  const int nt = pool.size();
  pool.run([&](int k) {
    const size_t lo = chunks * size_t(k) / size_t(nt), hi = chunks * size_t(k + 1) / size_t(nt);
    std::vector<Range> ranges;
    for (size_t c = lo; c < hi; ++c) ranges.push_back({c * kSumChunk, std::min(n, (c + 1) * kSumChunk)});
    range_squares(g, ranges.data(), ranges.size(), partial.data() + lo);
  });
  double total = 0.0;
  for (double s : partial) total += s;
  return total;
}

float clip_scale(double norm, double max_norm) {
  if (max_norm <= 0.0) return 1.0f;
  const double coef = max_norm / (norm + 1e-6);
  return coef >= 1.0 ? 1.0f : static_cast<float>(coef);
}

void clip_to_norm(float* g, size_t n, double norm, double max_norm, ThreadPool& pool) {
  const float s = clip_scale(norm, max_norm);
  if (s == 1.0f) return;
  const int nt = pool.size();
  pool.run([&](int k) {
    const size_t lo = n * k / nt, hi = n * (k + 1) / nt;
    for (size_t i = lo; i < hi; ++i) g[i] *= s;
  });
}

float Schedule::at(int64_t s) const {
  if (warmup > 0 && s < warmup) return lr * float(s + 1) / float(warmup);
  if (kind == Kind::kConstant) return lr;
  const double span = double(std::max<int64_t>(1, total - warmup));
  const double ratio = std::clamp(double(s - warmup) / span, 0.0, 1.0);
  return static_cast<float>(min_lr + 0.5 * (1.0 + std::cos(M_PI * ratio)) * (lr - min_lr));
}

Schedule::Kind parse_schedule(const std::string& name) {
  if (name == "constant") return Schedule::Kind::kConstant;
  if (name == "cosine") return Schedule::Kind::kCosine;
  throw usage_error("unknown --lr-schedule '{}': use constant or cosine", name);
}

}  // namespace trn::optim
