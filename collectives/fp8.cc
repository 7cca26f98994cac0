#include "collectives/fp8.h"

#include <algorithm>
#include <bit>
#include <cmath>

#include "collectives/core/error.h"

namespace trn {
namespace {

// What distinguishes the two formats: the largest finite code's magnitude bits and the exponent
// of the top binade that holds finite values (ilogb of the largest value).
template <Fp8Format F>
struct Spec;
template <>
struct Spec<Fp8Format::kOCP> {
  static constexpr int32_t kMaxCode = 0x7E;  // 0.1111.110 = 1.75 x 2^8 = 448
  static constexpr int kTopExponent = 8;
  static constexpr float kMax = kE4M3Max;
};
template <>
struct Spec<Fp8Format::kNeuron> {
  static constexpr int32_t kMaxCode = 0x77;  // 0.1110.111 = 1.875 x 2^7 = 240
  static constexpr int kTopExponent = 7;
  static constexpr float kMax = kE4M3NeuronMax;
};

// Written so the compiler vectorizes the encode loop (this file is built with
// -fno-trapping-math, which lets it compute the subnormal rounding's float addition for every
// element and select): both roundings are computed and one is selected, with no branch.
template <Fp8Format F>
inline uint8_t encode(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (u >> 24) & 0x80;
  const uint32_t a = u & 0x7FFFFFFF;
  // Normal e4m3 (|f| >= 2^-6): round the mantissa to 3 bits (nearest, ties to even), then
  // rebias the exponent from 127 to 7; a carry out of the mantissa bumps the exponent, as it
  // should. Above the format's largest finite value saturate to it.
  const uint32_t rounded = a + 0x7FFFF + ((a >> 20) & 1);
  int32_t normal = int32_t(rounded >> 20) - (120 << 3);
  normal = normal < Spec<F>::kMaxCode ? normal : Spec<F>::kMaxCode;
  // Subnormal e4m3 (|f| < 2^-6): the code is |f| in units of 2^-9, rounded to nearest even by
  // the float addition itself: 2^14's ulp is 2^-9. 8 units (2^-6) is the smallest normal's code.
  const float biased = std::bit_cast<float>(a) + 16384.0f;
  const int32_t sub = int32_t(std::bit_cast<uint32_t>(biased) - std::bit_cast<uint32_t>(16384.0f));
  // Masks rather than branches, so the selects vectorize.
  const uint32_t is_sub = 0u - uint32_t(a < 0x3C800000), is_nan = 0u - uint32_t(a >= 0x7F800000);
  uint32_t code = (uint32_t(sub) & is_sub) | (uint32_t(normal) & ~is_sub);
  code = (0x7Fu & is_nan) | (code & ~is_nan);  // inf and NaN: NaN (S.1111.111 in both formats)
  return uint8_t(sign | code);
}

// A code's value computed from its bits rather than looked up, so decode loops vectorize:
// normal codes map to an f32 exponent rebiased by 120 with the 3 mantissa bits on top,
// subnormal ones are m * 2^-9. Exponent 1111: ocp's is normal but for S.1111.111 (NaN);
// neuron's is infinity (mantissa 0) or NaN.
template <Fp8Format F>
inline float decode(uint8_t code) {
  const int32_t c = code;
  const int32_t sign = (c & 0x80) << 24, e = (c >> 3) & 15, m = c & 7;
  const int32_t normal = ((e + 120) << 23) | (m << 20);
  const int32_t sub = std::bit_cast<int32_t>(float(m) * 0.001953125f);  // m * 2^-9, exact
  int32_t bits = e == 0 ? sub : normal;
  if constexpr (F == Fp8Format::kOCP)
    bits = (c & 0x7F) == 0x7F ? 0x7FC00000 : bits;
  else
    bits = e == 15 ? (m == 0 ? 0x7F800000 : 0x7FC00000) : bits;
  return std::bit_cast<float>(bits | sign);
}

inline bool is_nan_code(uint8_t c) { return (c & 0x7F) == 0x7F; }

// 2^k as a float for k in [-127, 127] (2^-127 is subnormal but exact).
inline float pow2(int k) { return std::ldexp(1.0f, k); }

// The exponent k of a block's scale 2^k: max * 2^-k lands in (max/2, max] (max 448 or 240).
// Clamped at -127, so a block whose largest value is below 2^-119 (ocp; 2^-120 neuron) is scaled
// by 2^127 only and uses less of the range.
template <Fp8Format F>
int8_t block_exponent(const float* x, size_t n) {
  // The largest finite magnitude, compared as bits (ordered like the magnitudes), which
  // vectorizes where a float max with NaN rules would not.
  int32_t top = 0;
  for (size_t i = 0; i < n; ++i) {
    const int32_t a = std::bit_cast<int32_t>(x[i]) & 0x7FFFFFFF;
    const int32_t finite = a < 0x7F800000 ? a : 0;
    top = finite > top ? finite : top;
  }
  const float amax = std::bit_cast<float>(top);
  if (amax == 0.0f) return 0;
  int k = std::ilogb(amax) - Spec<F>::kTopExponent;
  if (std::ldexp(amax, -k) > Spec<F>::kMax) ++k;
  return int8_t(std::clamp(k, -127, 127));
}

template <Fp8Format F>
void encode_blocks(const float* x, size_t n, char* out) {
  auto* exps = reinterpret_cast<int8_t*>(out);
  auto* codes = reinterpret_cast<uint8_t*>(out + (n + kE4M3Block - 1) / kE4M3Block);
  for (size_t b = 0, blk = 0; b < n; b += kE4M3Block, ++blk) {
    const size_t len = std::min(kE4M3Block, n - b);
    const int8_t k = block_exponent<F>(x + b, len);
    exps[blk] = k;
    const float inv = pow2(-k);
    for (size_t i = 0; i < len; ++i) codes[b + i] = encode<F>(x[b + i] * inv);
  }
}

template <Fp8Format F>
void encode_feedback_blocks(const float* x, float* residual, size_t n, char* out) {
  auto* exps = reinterpret_cast<int8_t*>(out);
  auto* codes = reinterpret_cast<uint8_t*>(out + (n + kE4M3Block - 1) / kE4M3Block);
  for (size_t b = 0, blk = 0; b < n; b += kE4M3Block, ++blk) {
    const size_t len = std::min(kE4M3Block, n - b);
    float* r = residual + b;
    for (size_t i = 0; i < len; ++i) r[i] += x[b + i];
    const int8_t k = block_exponent<F>(r, len);
    exps[blk] = k;
    const float inv = pow2(-k), s = pow2(k);
    for (size_t i = 0; i < len; ++i) {
      const uint8_t c = encode<F>(r[i] * inv);
      codes[b + i] = c;
      // A non-finite value was sent as NaN; it must not stay in the residual for every later call.
      r[i] = is_nan_code(c) ? 0.0f : r[i] - decode<F>(c) * s;
    }
  }
}

template <Fp8Format F, bool kAdd>
void decode_blocks(const char* in, size_t n, float* out) {
  const auto* exps = reinterpret_cast<const int8_t*>(in);
  const auto* codes = reinterpret_cast<const uint8_t*>(in + (n + kE4M3Block - 1) / kE4M3Block);
  for (size_t b = 0, blk = 0; b < n; b += kE4M3Block, ++blk) {
    const size_t len = std::min(kE4M3Block, n - b);
    const float s = pow2(exps[blk]);
    // The product of a code's value (4 significant bits) and a power of two is exact, so adding
    // rounds once, in the addition, with or without a fused multiply-add.
    for (size_t i = 0; i < len; ++i) {
      if constexpr (kAdd)
        out[b + i] += decode<F>(codes[b + i]) * s;
      else
        out[b + i] = decode<F>(codes[b + i]) * s;
    }
  }
}

}  // namespace

Fp8Format parse_fp8_format(const std::string& name) {
  if (name == "ocp") return Fp8Format::kOCP;
  if (name == "neuron") return Fp8Format::kNeuron;
  throw usage_error(
      "--fp8-format takes ocp (E4M3FN, max 448) or neuron (Trainium2's E4M3, max 240), got '{}'", name);
}

const char* to_string(Fp8Format f) { return f == Fp8Format::kNeuron ? "neuron" : "ocp"; }

uint8_t f32_to_e4m3(float f, Fp8Format fmt) {
  return fmt == Fp8Format::kNeuron ? encode<Fp8Format::kNeuron>(f) : encode<Fp8Format::kOCP>(f);
}
float e4m3_to_f32(uint8_t code, Fp8Format fmt) {
  return fmt == Fp8Format::kNeuron ? decode<Fp8Format::kNeuron>(code) : decode<Fp8Format::kOCP>(code);
}

void e4m3_encode(const float* x, size_t n, char* out, Fp8Format fmt) {
  fmt == Fp8Format::kNeuron ? encode_blocks<Fp8Format::kNeuron>(x, n, out)
                            : encode_blocks<Fp8Format::kOCP>(x, n, out);
}

void e4m3_encode_feedback(const float* x, float* residual, size_t n, char* out, Fp8Format fmt) {
  fmt == Fp8Format::kNeuron ? encode_feedback_blocks<Fp8Format::kNeuron>(x, residual, n, out)
                            : encode_feedback_blocks<Fp8Format::kOCP>(x, residual, n, out);
}

void e4m3_decode(const char* in, size_t n, float* out, Fp8Format fmt) {
  fmt == Fp8Format::kNeuron ? decode_blocks<Fp8Format::kNeuron, false>(in, n, out)
                            : decode_blocks<Fp8Format::kOCP, false>(in, n, out);
}

void e4m3_decode_add(const char* in, size_t n, float* acc, Fp8Format fmt) {
  fmt == Fp8Format::kNeuron ? decode_blocks<Fp8Format::kNeuron, true>(in, n, acc)
                            : decode_blocks<Fp8Format::kOCP, true>(in, n, acc);
}

}  // namespace trn
