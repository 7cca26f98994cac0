// Counter-based initialisation: every element is a pure function of (seed, tensor name, global
// element index), so every layout and thread count starts from the same model.
#include <algorithm>
#include <cmath>

#include "runtime/model/one_stage.h"
#include "runtime/util/random.h"

namespace trn::model {
namespace {

uint64_t name_hash(const std::string& s) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return h;
}

// A standard normal from a counter: Box-Muller over two uniforms drawn from (key, 2i) and
// (key, 2i + 1), so element i needs no stream position.
double counter_normal(uint64_t key, uint64_t i) {
  const uint64_t a = mix64(key ^ mix64(2 * i)), b = mix64(key ^ mix64(2 * i + 1));
  const double u1 = (double(a >> 11) + 0.5) * (1.0 / 9007199254740992.0);  // (0, 1)
  const double u2 = double(b >> 11) * (1.0 / 9007199254740992.0);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

}  // namespace

void init_params(const ParamLayout& layout, uint64_t seed, float* params) {
  for (const TensorSpec& t : layout.tensors()) {
    float* p = params + t.offset;
    switch (t.init) {
      case TensorSpec::Init::kOnes:
        std::fill(p, p + t.numel, 1.0f);
        break;
      case TensorSpec::Init::kZeros:
        std::fill(p, p + t.numel, 0.0f);
        break;
      case TensorSpec::Init::kNormal: {
        const uint64_t key = mix64(seed ^ name_hash(t.name));
        for (size_t i = 0; i < t.numel; ++i) {
          const int64_t g = t.global_index(i);
          p[i] = g < 0 ? 0.0f : static_cast<float>(counter_normal(key, uint64_t(g)) * t.init_std);
        }
        break;
      }
    }
  }
}

}  // namespace trn::model
