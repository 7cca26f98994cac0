#include "collectives/dtype.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <type_traits>

#if defined(__F16C__) && defined(__AVX__)
#define TRN_F16C 1
#include <immintrin.h>
#endif

#include "collectives/core/error.h"

namespace trn {
namespace {

// Integer sums and products wrap (two's complement), as a reduction's definition says; signed
// overflow would be undefined, so signed integers are added and multiplied as unsigned ones
// wide enough not to promote to int.
template <class T>
using Wrapping = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;
struct Sum {
  template <class T>
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) return static_cast<T>(Wrapping<T>(a) + Wrapping<T>(b));
    else return a + b;
  }
};
struct Prod {
  template <class T>
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) return static_cast<T>(Wrapping<T>(a) * Wrapping<T>(b));
    else return a * b;
  }
};
struct Min { template <class T> static T apply(T a, T b) { return b < a ? b : a; } };
struct Max { template <class T> static T apply(T a, T b) { return a < b ? b : a; } };

// Native types: one loop the vectorizer turns into packed instructions.
// Every kernel computes dst[i] = a[i] op b[i]; dst may be a itself (the two-operand form), which
// gets its own instantiation (kInPlace) so that no restrict-qualified pointers alias.
template <class Op, class T, bool kInPlace>
void reduce_native(void* dst, const void* a, const void* b, size_t n) {
  T* __restrict d = static_cast<T*>(dst);
  const T* __restrict y = static_cast<const T*>(b);
  if constexpr (kInPlace) {
    for (size_t i = 0; i < n; ++i) d[i] = static_cast<T>(Op::apply(d[i], y[i]));
  } else {
    const T* __restrict x = static_cast<const T*>(a);
    for (size_t i = 0; i < n; ++i) d[i] = static_cast<T>(Op::apply(x[i], y[i]));
  }
}

inline float bf16_bits_to_f32(uint16_t h) { return std::bit_cast<float>(uint32_t{h} << 16); }
inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

template <class Op, bool kInPlace>
void reduce_bf16(void* dst, const void* a, const void* b, size_t n) {
  uint16_t* __restrict d = static_cast<uint16_t*>(dst);
  const uint16_t* __restrict y = static_cast<const uint16_t*>(b);
  if constexpr (kInPlace) {
    for (size_t i = 0; i < n; ++i)
      d[i] = f32_to_bf16_bits(Op::apply(bf16_bits_to_f32(d[i]), bf16_bits_to_f32(y[i])));
  } else {
    const uint16_t* __restrict x = static_cast<const uint16_t*>(a);
    for (size_t i = 0; i < n; ++i)
      d[i] = f32_to_bf16_bits(Op::apply(bf16_bits_to_f32(x[i]), bf16_bits_to_f32(y[i])));
  }
}

#ifdef TRN_F16C
// The compiler does not vectorize f16 conversions; with F16C, 8 lanes at a time by hand.
struct SimdSum { static __m256 apply(__m256 a, __m256 b) { return _mm256_add_ps(a, b); } };
struct SimdProd { static __m256 apply(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); } };
struct SimdMin { static __m256 apply(__m256 a, __m256 b) { return _mm256_blendv_ps(a, b, _mm256_cmp_ps(b, a, _CMP_LT_OQ)); } };
struct SimdMax { static __m256 apply(__m256 a, __m256 b) { return _mm256_blendv_ps(a, b, _mm256_cmp_ps(a, b, _CMP_LT_OQ)); } };
template <class Op> struct SimdOf;
template <> struct SimdOf<Sum> { using type = SimdSum; };
template <> struct SimdOf<Prod> { using type = SimdProd; };
template <> struct SimdOf<Min> { using type = SimdMin; };
template <> struct SimdOf<Max> { using type = SimdMax; };
#endif

// IEEE binary16 <-> binary32 in software, rounding to nearest even as F16C's vcvtps2ph does (the
// same bits for every input, NaNs quieted with their payload's top bits kept): the scalar path,
// and the same results under every compiler (clang before 15 has no _Float16 on x86-64).
inline float f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in f32
    const float v = static_cast<float>(man) * 0x1p-24f;
    return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(v));
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | man << 13);  // inf, NaN
  return std::bit_cast<float>(sign | (exp + 112) << 23 | man << 13);
}
inline uint16_t f32_to_f16_bits(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (a < 0x38800000u) {
    // Below 2^-14, a subnormal (or zero) of f16: adding 0.5 makes the FPU round |f| to a multiple
    // of 2^-24 (the ulp at 0.5), nearest even; the low bits are then the f16's mantissa.
    const float t = std::bit_cast<float>(a) + 0.5f;
    return static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(t) - 0x3f000000u));
  }
  // Normal: rebias the exponent (-112 << 23) and round the 13 dropped bits to nearest even.
  a += 0xc8000fffu + ((a >> 13) & 1u);
  return static_cast<uint16_t>(sign | (a >> 13));
}

// The explicit loads and stores make aliasing of dst and a harmless: no restrict needed.
template <class Op>
void reduce_f16(void* dst, const void* a, const void* b, size_t n) {
  uint16_t* d = static_cast<uint16_t*>(dst);
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  size_t i = 0;
#ifdef TRN_F16C
  for (; i + 8 <= n; i += 8) {
    __m256 va = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
    __m256 vb = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(y + i)));
    __m128i r = _mm256_cvtps_ph(SimdOf<Op>::type::apply(va, vb), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), r);
  }
#endif
  for (; i < n; ++i) d[i] = f32_to_f16_bits(Op::apply(f16_bits_to_f32(x[i]), f16_bits_to_f32(y[i])));
}

template <class Op, bool kInPlace>
void reduce_typed(void* dst, const void* a, const void* b, size_t n, DataType t) {
  switch (t) {
    case DataType::kF32: return reduce_native<Op, float, kInPlace>(dst, a, b, n);
    case DataType::kF64: return reduce_native<Op, double, kInPlace>(dst, a, b, n);
    case DataType::kF16: return reduce_f16<Op>(dst, a, b, n);
    case DataType::kBF16: return reduce_bf16<Op, kInPlace>(dst, a, b, n);
    case DataType::kI32: return reduce_native<Op, int32_t, kInPlace>(dst, a, b, n);
    case DataType::kI64: return reduce_native<Op, int64_t, kInPlace>(dst, a, b, n);
    case DataType::kU8: return reduce_native<Op, uint8_t, kInPlace>(dst, a, b, n);
  }
}

template <bool kInPlace>
void reduce_any(void* dst, const void* a, const void* b, size_t count, DataType t, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: case ReduceOp::kAvg: return reduce_typed<Sum, kInPlace>(dst, a, b, count, t);
    case ReduceOp::kProd: return reduce_typed<Prod, kInPlace>(dst, a, b, count, t);
    case ReduceOp::kMin: return reduce_typed<Min, kInPlace>(dst, a, b, count, t);
    case ReduceOp::kMax: return reduce_typed<Max, kInPlace>(dst, a, b, count, t);
  }
}

template <class T>
void divide_native(void* buf, size_t n, int divisor) {
  T* b = static_cast<T*>(buf);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<T>(b[i] / static_cast<T>(divisor));
}

constexpr const char* kTypeNames[] = {"f32", "f64", "f16", "bf16", "i32", "i64", "u8"};
constexpr const char* kOpNames[] = {"sum", "prod", "min", "max", "avg"};

}  // namespace

size_t size_of(DataType t) {
  switch (t) {
    case DataType::kF32: case DataType::kI32: return 4;
    case DataType::kF64: case DataType::kI64: return 8;
    case DataType::kF16: case DataType::kBF16: return 2;
    case DataType::kU8: return 1;
  }
  return 1;
}

const char* to_string(DataType t) { return kTypeNames[static_cast<int>(t)]; }
const char* to_string(ReduceOp op) { return kOpNames[static_cast<int>(op)]; }

DataType parse_data_type(std::string_view name) {
  for (int i = 0; i < 7; ++i)
    if (name == kTypeNames[i]) return static_cast<DataType>(i);
  throw usage_error("unknown data type '{}' (use f32, f64, f16, bf16, i32, i64 or u8)", name);
}

ReduceOp parse_reduce_op(std::string_view name) {
  for (int i = 0; i < 5; ++i)
    if (name == kOpNames[i]) return static_cast<ReduceOp>(i);
  throw usage_error("unknown reduction '{}' (use sum, prod, min, max or avg)", name);
}

void reduce(void* dst, const void* src, size_t count, DataType t, ReduceOp op) {
  reduce_any<true>(dst, dst, src, count, t, op);
}

void reduce(void* dst, const void* a, const void* b, size_t count, DataType t, ReduceOp op) {
  if (dst == a) return reduce_any<true>(dst, dst, b, count, t, op);
  reduce_any<false>(dst, a, b, count, t, op);
}

void finish_avg(void* buf, size_t count, DataType t, int divisor) {
  if (divisor == 1) return;
  switch (t) {
    case DataType::kF32: return divide_native<float>(buf, count, divisor);
    case DataType::kF64: return divide_native<double>(buf, count, divisor);
    case DataType::kI32: return divide_native<int32_t>(buf, count, divisor);
    case DataType::kI64: return divide_native<int64_t>(buf, count, divisor);
    case DataType::kU8: return divide_native<uint8_t>(buf, count, divisor);
    case DataType::kF16: {
      auto* b = static_cast<uint16_t*>(buf);
      for (size_t i = 0; i < count; ++i) b[i] = f32_to_f16_bits(f16_bits_to_f32(b[i]) / static_cast<float>(divisor));
      return;
    }
    case DataType::kBF16: {
      auto* b = static_cast<uint16_t*>(buf);
      for (size_t i = 0; i < count; ++i)
        b[i] = f32_to_bf16_bits(bf16_bits_to_f32(b[i]) / static_cast<float>(divisor));
      return;
    }
  }
}

float f16_to_f32(uint16_t h) { return f16_bits_to_f32(h); }
uint16_t f32_to_f16(float f) { return f32_to_f16_bits(f); }
float bf16_to_f32(uint16_t h) { return bf16_bits_to_f32(h); }
uint16_t f32_to_bf16(float f) { return f32_to_bf16_bits(f); }

}  // namespace trn
