#include "runtime/optim/adamw.h"

#include <algorithm>
#include <cmath>

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

void AdamW::step(float* params, const float* grads, float lr, ThreadPool& pool) {
  ++t_;
  const float b1 = cfg_.beta1, b2 = cfg_.beta2, eps = cfg_.eps;
  const double bc1 = 1.0 - std::pow(double(b1), double(t_));
  const double bc2_sqrt = std::sqrt(1.0 - std::pow(double(b2), double(t_)));
  const float step_size = static_cast<float>(lr / bc1);
  const float inv_bc2_sqrt = static_cast<float>(1.0 / bc2_sqrt);
  const float one_minus_b1 = 1.0f - b1, one_minus_b2 = 1.0f - b2;
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
      const float decay = s.decay ? 1.0f - lr * cfg_.weight_decay : 1.0f;
      float* m = m_.data() + b;
      float* v = v_.data() + b;
      const size_t at = s.begin + (b - s.state);  // b's buffer offset
      float* p = params + (compact_p ? b : at);
      const float* gr = grads + (compact_g ? b : at);
      for (size_t i = 0; i < e - b; ++i) {
        const float g = gr[i];
        m[i] = b1 * m[i] + one_minus_b1 * g;
        v[i] = b2 * v[i] + one_minus_b2 * g * g;
        const float denom = std::sqrt(v[i]) * inv_bc2_sqrt + eps;
        p[i] = p[i] * decay - step_size * (m[i] / denom);
      }
    }
  });
}

double AdamW::grad_norm(const float* grads, ThreadPool& pool) {
  return global_norm(norm_, piece_sums(norm_.pieces, grads, pool));
}

void AdamW::update(float* params, float* grads, double grad_norm, float lr, ThreadPool& pool) {
  // The same scale for each element either way (clip_to_norm is element-wise).
  if (grads_storage_ == Storage::kCompact) clip_to_norm(grads, m_.size(), grad_norm, cfg_.max_grad_norm, pool);
  else
    for (const Range& r : owned_) clip_to_norm(grads + r.begin, r.size(), grad_norm, cfg_.max_grad_norm, pool);
  step(params, grads, lr, pool);
}

std::string AdamW::describe() const {
  return fmt::format("AdamW m and v of {} of its {} parameters", m_.size(), n_);
}

std::vector<double> piece_sums(const NormPieces& pieces, const float* g, ThreadPool& pool) {
  const std::vector<NormPieces::Piece>& ps = pieces.pieces;
  std::vector<double> sums(ps.size(), 0.0);
  const int nt = pool.size();
  pool.run([&](int k) {
    for (size_t i = size_t(k); i < ps.size(); i += size_t(nt)) {
      if (!ps[i].counted) continue;
      double s = 0.0;
      for (size_t j = ps[i].begin; j < ps[i].end; ++j) s += double(g[j]) * g[j];
      sums[i] = s;
    }
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
    for (size_t c = k; c < chunks; c += nt) {
      const size_t b = c * kSumChunk, e = std::min(n, b + kSumChunk);
      double s = 0.0;
      for (size_t i = b; i < e; ++i) s += double(g[i]) * g[i];
      partial[c] = s;
    }
  });
  double total = 0.0;
  for (double s : partial) total += s;
  return total;
}

void clip_to_norm(float* g, size_t n, double norm, double max_norm, ThreadPool& pool) {
  if (max_norm <= 0.0) return;
  const double coef = max_norm / (norm + 1e-6);
  if (coef >= 1.0) return;
  const float s = static_cast<float>(coef);
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
