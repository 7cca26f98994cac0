// 8-bit floating point on the wire, E4M3 (1 sign bit, 4 exponent bits of bias 7, 3 mantissa bits,
// smallest subnormal 2^-9) in one of two formats (Fp8Format), with a power-of-two scale per block
// of kE4M3Block elements:
//   ocp     OCP FP8 E4M3 ("E4M3FN"): no infinities, exponent 1111 holds normal values up to
//           1.75 x 2^8 = 448, S.1111.111 is NaN.
//   neuron  the E4M3 of Trainium2 (NeuronCore-v3), whose compiler refuses OCP's: IEEE-style,
//           exponent 1111 is infinity (mantissa 000) or NaN (any other), so the largest finite
//           value is 1.875 x 2^7 = 240.
// Both formats share every code below exponent 1111, so they differ only in the top binade.
//
// A block's scale is the power of two that maps its largest finite magnitude into (max/2, max]
// (max: 448 or 240), so every block uses the format's whole range whatever the magnitude of its
// values. Multiplying by
// a power of two is exact, so the only rounding is the one to 3 mantissa bits (round to nearest
// even, relative error at most 2^-4 for values within 2^13 of the block's largest; smaller ones
// fall into the subnormals, absolute error at most the largest's 2^-17, and then to zero).
// Infinities and NaNs encode as NaN (S.1111.111 in both formats), so a non-finite gradient stays non-finite
// after the trip; a finite value within a rounding of FLT_MAX comes back as infinity (its scale is
// 2^120 under ocp, 2^121 under neuron).
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
#include <string>

namespace trn {

inline constexpr size_t kE4M3Block = 128;
inline constexpr float kE4M3Max = 448.0f;        // ocp
inline constexpr float kE4M3NeuronMax = 240.0f;  // neuron

// The wire's E4M3 format (trn-train --fp8-format). Every rank of a collective must use the same.
enum class Fp8Format { kOCP, kNeuron };
// "ocp" or "neuron"; anything else is a usage error naming the choices.
Fp8Format parse_fp8_format(const std::string& name);
const char* to_string(Fp8Format f);
// The largest finite value: 448 (ocp) or 240 (neuron).
inline float e4m3_max(Fp8Format f) { return f == Fp8Format::kNeuron ? kE4M3NeuronMax : kE4M3Max; }

// Scalar conversions: round to nearest even, saturating at +-max; NaN and +-inf give NaN.
uint8_t f32_to_e4m3(float f, Fp8Format fmt = Fp8Format::kOCP);
float e4m3_to_f32(uint8_t code, Fp8Format fmt = Fp8Format::kOCP);

inline size_t e4m3_encoded_bytes(size_t n) { return (n + kE4M3Block - 1) / kE4M3Block + n; }
void e4m3_encode(const float* x, size_t n, char* out, Fp8Format fmt = Fp8Format::kOCP);
// Error feedback: encodes x + residual and leaves in residual what the encoding lost of it
// ((x + residual) - decoded), for the next call to add back.
void e4m3_encode_feedback(const float* x, float* residual, size_t n, char* out,
                          Fp8Format fmt = Fp8Format::kOCP);
void e4m3_decode(const char* in, size_t n, float* out, Fp8Format fmt = Fp8Format::kOCP);
void e4m3_decode_add(const char* in, size_t n, float* acc, Fp8Format fmt = Fp8Format::kOCP);

}  // namespace trn
