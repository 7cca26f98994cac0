#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "collectives/core/error.h"
#include "collectives/dtype.h"

using namespace trn;

namespace {

// x rounded once to the nearest f16 value (ties to even), as a float (which holds it exactly).
float round_to_f16(double x) {
  if (x == 0 || !std::isfinite(x)) return static_cast<float>(x);
  const int e = std::max(std::ilogb(x), -14);         // subnormals share 2^-14's spacing
  const double q = std::nearbyint(std::ldexp(x, 10 - e));  // the default mode: nearest even
  return static_cast<float>(std::ldexp(q, e - 10));   // 65520 and up become 65536: inf in f16
}

}  // namespace

TEST_CASE("f16 conversions: every f16 value round-trips, and f32 rounds to the nearest f16") {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float f = f16_to_f32(static_cast<uint16_t>(bits));
    if (std::isnan(f)) {
      CHECK(std::isnan(f16_to_f32(f32_to_f16(f))));
      continue;
    }
    REQUIRE(f32_to_f16(f) == bits);
  }
  // f32 values between and around f16 values: subnormals, normals, the overflow edge, and ties.
  std::mt19937 rng(3);
  std::uniform_int_distribution<uint32_t> any;
  for (int i = 0; i < 200000; ++i) {
    const uint32_t u = i < 100000 ? any(rng) : (0x33000000u + any(rng) % (0x47800000u - 0x33000000u));
    const float f = std::bit_cast<float>(u);
    if (std::isnan(f)) continue;
    const float want = round_to_f16(f);
    const uint16_t got = f32_to_f16(f);
    if (std::isinf(want) || std::fabs(want) >= 65536.0f) REQUIRE((got & 0x7fff) == 0x7c00);
    else REQUIRE(f16_to_f32(got) == want);
  }
  CHECK(f32_to_f16(65519.99f) == 0x7bff);
  CHECK(f32_to_f16(65520.0f) == 0x7c00);
  CHECK(f32_to_f16(std::ldexp(1.0f, -25)) == 0);       // a tie between 0 and the least subnormal
  CHECK(f32_to_f16(std::ldexp(1.5f, -25)) == 1);
  CHECK(f32_to_f16(-std::ldexp(3.0f, -25)) == 0x8002);  // 1.5 ulps: a tie, to even
}

TEST_CASE("bf16 and f16 round to nearest even") {
  // 1 + 2^-8 lies exactly between two bf16 values (1 and 1 + 2^-7): ties go to the even one, 1.
  CHECK(bf16_to_f32(f32_to_bf16(1.0f + std::ldexp(1.0f, -8))) == 1.0f);
  // 1 + 3 * 2^-8 lies between 1 + 2^-7 (odd) and 1 + 2^-6 (even): goes up.
  CHECK(bf16_to_f32(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8))) == 1.0f + std::ldexp(1.0f, -6));
  CHECK(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isinf(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::infinity()))));
  // f16 has 10 fraction bits: 1 + 2^-11 is a tie that goes to 1.
  CHECK(f16_to_f32(f32_to_f16(1.0f + std::ldexp(1.0f, -11))) == 1.0f);
  CHECK(f16_to_f32(f32_to_f16(65504.0f)) == 65504.0f);
}

TEST_CASE("bf16 and f16 sums are the correctly rounded sum of the two operands") {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> d(-100, 100);
  std::vector<uint16_t> a(1000), b(1000), h(1000), g(1000);
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = f32_to_bf16(d(rng));
    b[i] = f32_to_bf16(d(rng));
    h[i] = f32_to_f16(d(rng));
    g[i] = f32_to_f16(d(rng));
  }
  auto a0 = a, h0 = h;
  reduce(a.data(), b.data(), a.size(), DataType::kBF16, ReduceOp::kSum);
  reduce(h.data(), g.data(), h.size(), DataType::kF16, ReduceOp::kSum);
  for (size_t i = 0; i < a.size(); ++i) {
    // The exact sum in double, rounded once.
    double exact = double(bf16_to_f32(a0[i])) + double(bf16_to_f32(b[i]));
    CHECK(a[i] == f32_to_bf16(static_cast<float>(exact)));
    double exact16 = double(f16_to_f32(h0[i])) + double(f16_to_f32(g[i]));
    CHECK(h[i] == f32_to_f16(round_to_f16(exact16)));
  }
}

TEST_CASE("reduction kernels compute each op for each type") {
  float fa[3] = {1, -2, 3}, fb[3] = {4, 5, -6};
  reduce(fa, fb, 3, DataType::kF32, ReduceOp::kMax);
  CHECK(fa[0] == 4);
  CHECK(fa[1] == 5);
  CHECK(fa[2] == 3);
  int64_t ia[2] = {3, -4}, ib[2] = {5, 6};
  reduce(ia, ib, 2, DataType::kI64, ReduceOp::kProd);
  CHECK(ia[0] == 15);
  CHECK(ia[1] == -24);
  uint8_t ua[2] = {200, 7}, ub[2] = {100, 9};
  reduce(ua, ub, 2, DataType::kU8, ReduceOp::kSum);
  CHECK(ua[0] == 44);  // wraps
  CHECK(ua[1] == 16);
  int32_t ja[2] = {7, -7};
  finish_avg(ja, 2, DataType::kI32, 2);
  CHECK(ja[0] == 3);
  CHECK(ja[1] == -3);
  double da[1] = {5}, db[1] = {-1};
  reduce(da, db, 1, DataType::kF64, ReduceOp::kMin);
  CHECK(da[0] == -1);
}

TEST_CASE("unknown type and op names are usage errors that list the choices") {
  CHECK(parse_data_type("bf16") == DataType::kBF16);
  CHECK(parse_reduce_op("avg") == ReduceOp::kAvg);
  try {
    parse_data_type("float");
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kUsage);
    CHECK_THAT(e.what(), Catch::Contains("float") && Catch::Contains("bf16"));
  }
  CHECK_THROWS_WITH(parse_reduce_op("mean"), Catch::Contains("sum, prod, min, max or avg"));
}

TEST_CASE("three-operand reduce writes exactly what reduce in place leaves, for every type and op") {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> byte(0, 255);
  for (DataType t : kAllDataTypes) {
    for (ReduceOp op : kAllReduceOps) {
      const size_t n = 37;  // a vector body and a scalar tail
      const size_t bytes = n * size_of(t);
      std::vector<unsigned char> a(bytes), b(bytes);
      for (auto& x : a) x = static_cast<unsigned char>(byte(rng));
      for (auto& x : b) x = static_cast<unsigned char>(byte(rng));
      if (t == DataType::kF32 || t == DataType::kF64 || t == DataType::kF16 || t == DataType::kBF16) {
        // Finite values only, so NaN payloads cannot make equal results compare unequal.
        for (size_t i = 0; i < n; ++i) {
          float v = static_cast<float>(byte(rng) - 128) / 8.0f;
          float w = static_cast<float>(byte(rng) - 128) / 16.0f;
          if (t == DataType::kF32) {
            std::memcpy(&a[i * 4], &v, 4);
            std::memcpy(&b[i * 4], &w, 4);
          } else if (t == DataType::kF64) {
            double dv = v, dw = w;
            std::memcpy(&a[i * 8], &dv, 8);
            std::memcpy(&b[i * 8], &dw, 8);
          } else {
            uint16_t hv = t == DataType::kF16 ? f32_to_f16(v) : f32_to_bf16(v);
            uint16_t hw = t == DataType::kF16 ? f32_to_f16(w) : f32_to_bf16(w);
            std::memcpy(&a[i * 2], &hv, 2);
            std::memcpy(&b[i * 2], &hw, 2);
          }
        }
      }
      std::vector<unsigned char> in_place = a, out(bytes, 0xAB), aliased = a;
      reduce(in_place.data(), b.data(), n, t, op);
      reduce(out.data(), a.data(), b.data(), n, t, op);
      reduce(aliased.data(), aliased.data(), b.data(), n, t, op);
      INFO(to_string(t) << " " << to_string(op));
      CHECK(out == in_place);
      CHECK(aliased == in_place);
    }
  }
}
