// exp and tanh for float written as branch-free arithmetic, so loops over them vectorize (the
// libm calls do not without -ffast-math). exp is within 2 ulp of expf over the range it is used
// (range reduction to [-ln2/2, ln2/2], degree-6 polynomial, exponent set through the bits); NaN
// gives NaN.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace trn::kernels {

inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float n = std::rint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;  // ln2 split in two so the product is exact
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // A NaN x passes the clamps and makes p NaN; its n must still convert to an int defined (a
  // float NaN to int is undefined behaviour), so a NaN n counts as 0 and NaN comes out.
  const int32_t bits = (static_cast<int32_t>(n == n ? n : 0.0f) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline float fast_tanh(float u) {
  const float e = fast_exp(2.0f * u);
  return 1.0f - 2.0f / (e + 1.0f);
}

}  // namespace trn::kernels
