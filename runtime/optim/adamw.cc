#include "runtime/optim/adamw.h"

#include <algorithm>
#include <cmath>

#include "collectives/core/error.h"

namespace trn::optim {

AdamW::AdamW(const model::ParamLayout& layout, AdamWConfig cfg) : cfg_(cfg) {
  for (const auto& t : layout.tensors()) ranges_.push_back({t.offset, t.offset + t.numel, t.decay});
  m_.assign(layout.total(), 0.0f);
  v_.assign(layout.total(), 0.0f);
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
  pool.run([&](int k) {
    const size_t lo = n * k / nt, hi = n * (k + 1) / nt;
    float* m = m_.data();
    float* v = v_.data();
    for (const Range& r : ranges_) {
      const size_t b = std::max(r.begin, lo), e = std::min(r.end, hi);
      if (b >= e) continue;
      const float decay = r.decay ? 1.0f - lr * cfg_.weight_decay : 1.0f;
      for (size_t i = b; i < e; ++i) {
        const float g = grads[i];
        m[i] = b1 * m[i] + one_minus_b1 * g;
        v[i] = b2 * v[i] + one_minus_b2 * g * g;
        const float denom = std::sqrt(v[i]) * inv_bc2_sqrt + eps;
        params[i] = params[i] * decay - step_size * (m[i] / denom);
      }
    }
  });
}

namespace {
constexpr size_t kChunk = 1 << 16;
}

double sum_of_squares(const float* g, size_t n, ThreadPool& pool) {
  const size_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(chunks, 0.0);
  const int nt = pool.size();
  pool.run([&](int k) {
    for (size_t c = k; c < chunks; c += nt) {
      const size_t b = c * kChunk, e = std::min(n, b + kChunk);
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
