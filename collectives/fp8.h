// 8-bit floating point on the wire: OCP FP8 E4M3 ("E4M3FN": 1 sign bit, 4 exponent bits of bias
// 7, 3 mantissa bits; largest finite value 448, smallest subnormal 2^-9, no infinities, S.1111.111
// is NaN), with a power-of-two scale per block of kE4M3Block elements.
//
// A block's scale is the power of two that maps its largest finite magnitude into (224, 448], so
// every block uses the format's whole range whatever the magnitude of its values. Multiplying by
// a power of two is exact, so the only rounding is the one to 3 mantissa bits (round to nearest
// even, relative error at most 2^-4 for values within 2^13 of the block's largest; smaller ones
// fall into the subnormals, absolute error at most the largest's 2^-17, and then to zero).
// Infinities and NaNs encode as NaN, so a non-finite gradient stays non-finite after the trip;
// a finite value within a rounding of FLT_MAX comes back as infinity (its scale is 2^120).
//
// Encoded layout of n elements: ceil(n / kE4M3Block) int8 scale exponents, then n codes.
//
//   std::vector<char> wire(e4m3_encoded_bytes(n));
//   e4m3_encode(x, n, wire.data());
//   e4m3_decode(wire.data(), n, y);        // y[i] = x[i] rounded to e4m3 at its block's scale
//   e4m3_decode_add(wire.data(), n, acc);  // acc[i] += the same values
#pragma once

#include <cstddef>
#include <cstdint>

namespace trn {

inline constexpr size_t kE4M3Block = 128;
inline constexpr float kE4M3Max = 448.0f;

// Scalar conversions: round to nearest even, saturating at +-448; NaN and +-inf give NaN.
uint8_t f32_to_e4m3(float f);
float e4m3_to_f32(uint8_t code);

inline size_t e4m3_encoded_bytes(size_t n) { return (n + kE4M3Block - 1) / kE4M3Block + n; }
void e4m3_encode(const float* x, size_t n, char* out);
// Error feedback: encodes x + residual and leaves in residual what the encoding lost of it
// ((x + residual) - decoded), for the next call to add back.
void e4m3_encode_feedback(const float* x, float* residual, size_t n, char* out);
void e4m3_decode(const char* in, size_t n, float* out);
void e4m3_decode_add(const char* in, size_t n, float* acc);

}  // namespace trn
