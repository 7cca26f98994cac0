#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "collectives/fp8.h"
#include "tests/unit/collectives/local_world.h"

using namespace trn;
using namespace trn::test;
using namespace std::chrono_literals;

namespace {

// The nearest e4m3 value to f by exhaustive search over the 254 finite codes, ties to the even
// code (mantissa bit 0 clear); beyond 448, 448. Independent of the bit tricks in fp8.cc.
float nearest_e4m3(float f) {
  if (std::fabs(f) >= 448.0f) return std::copysign(448.0f, f);
  float best = 0.0f;
  double best_d = std::numeric_limits<double>::infinity();
  int best_code = 0;
  for (int c = 0; c < 256; ++c) {
    const float v = e4m3_to_f32(uint8_t(c));
    if (std::isnan(v)) continue;
    const double d = std::fabs(double(v) - double(f));
    if (d < best_d || (d == best_d && (c & 1) == 0 && (best_code & 1) == 1)) {
      best = v, best_d = d, best_code = c;
    }
  }
  return best == 0.0f ? std::copysign(0.0f, f) : best;
}

std::vector<float> decoded(const std::vector<float>& x) {
  std::vector<char> wire(e4m3_encoded_bytes(x.size()));
  e4m3_encode(x.data(), x.size(), wire.data());
  std::vector<float> y(x.size());
  e4m3_decode(wire.data(), x.size(), y.data());
  return y;
}

CommOptions opts() {
  CommOptions o;
  o.timeout = 20s;
  o.chunk_bytes = 256;
  return o;
}

}  // namespace

TEST_CASE("e4m3 codes decode to the OCP E4M3 values and encode back to themselves") {
  CHECK(e4m3_to_f32(0x00) == 0.0f);
  CHECK(e4m3_to_f32(0x01) == std::ldexp(1.0f, -9));  // smallest subnormal
  CHECK(e4m3_to_f32(0x08) == std::ldexp(1.0f, -6));  // smallest normal
  CHECK(e4m3_to_f32(0x38) == 1.0f);
  CHECK(e4m3_to_f32(0x7E) == 448.0f);
  CHECK(e4m3_to_f32(0xFE) == -448.0f);
  CHECK(std::isnan(e4m3_to_f32(0x7F)));
  CHECK(std::isnan(e4m3_to_f32(0xFF)));
  for (int c = 0; c < 256; ++c) {
    if (c == 0x7F || c == 0xFF) continue;
    INFO("code " << c);
    // The format's definition: exponent field e (bias 7), mantissa m; e = 0 is subnormal.
    const int e = (c >> 3) & 15, m = c & 7;
    const float v = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.0f + float(m) / 8.0f, e - 7);
    CHECK(e4m3_to_f32(uint8_t(c)) == ((c & 0x80) ? -v : v));
    CHECK(std::signbit(e4m3_to_f32(uint8_t(c))) == bool(c & 0x80));
    CHECK(f32_to_e4m3(e4m3_to_f32(uint8_t(c))) == c);
  }
}

TEST_CASE("e4m3: f32 to e4m3 rounds to nearest even and saturates") {
  CHECK(f32_to_e4m3(1000.0f) == 0x7E);
  CHECK(f32_to_e4m3(-1e30f) == 0xFE);
  CHECK(f32_to_e4m3(std::numeric_limits<float>::infinity()) == 0x7F);
  CHECK(std::isnan(e4m3_to_f32(f32_to_e4m3(std::numeric_limits<float>::quiet_NaN()))));
  // 1.0625 lies halfway between 1 and 1.125: ties go to the even mantissa, 1.
  CHECK(e4m3_to_f32(f32_to_e4m3(1.0625f)) == 1.0f);
  CHECK(e4m3_to_f32(f32_to_e4m3(1.1875f)) == 1.25f);
  // Halfway between the two smallest subnormals, and between 0 and the smallest.
  CHECK(e4m3_to_f32(f32_to_e4m3(1.5f * std::ldexp(1.0f, -9))) == std::ldexp(2.0f, -9));
  CHECK(e4m3_to_f32(f32_to_e4m3(0.5f * std::ldexp(1.0f, -9))) == 0.0f);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> ex(-14, 10);
  for (int i = 0; i < 20000; ++i) {
    const float f = std::ldexp(mant(rng), ex(rng));
    INFO("f = " << f);
    REQUIRE(e4m3_to_f32(f32_to_e4m3(f)) == nearest_e4m3(f));
  }
}

TEST_CASE("e4m3 block encoding scales each block to the format's range") {
  std::mt19937 rng(3);
  std::normal_distribution<float> g(0.0f, 1.0f);
  // Blocks of very different magnitudes, and a tail block shorter than the rest.
  const size_t n = 5 * kE4M3Block + 17;
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = g(rng) * std::ldexp(1.0f, int(i / kE4M3Block) * 9 - 20);
  const auto y = decoded(x);
  for (size_t b = 0; b < n; b += kE4M3Block) {
    float amax = 0;
    for (size_t i = b; i < std::min(n, b + kE4M3Block); ++i) amax = std::max(amax, std::fabs(x[i]));
    for (size_t i = b; i < std::min(n, b + kE4M3Block); ++i) {
      INFO("element " << i << " x " << x[i] << " y " << y[i]);
      // 3 mantissa bits: relative error at most 2^-4 above the block's subnormal range (the
      // largest scales to at least 224 = 2^7.8, so 2^-13 below it is still normal, >= 2^-6).
      if (std::fabs(x[i]) >= amax * std::ldexp(1.0f, -13)) REQUIRE(std::fabs(y[i] - x[i]) <= std::fabs(x[i]) / 16);
      else REQUIRE(std::fabs(y[i] - x[i]) <= amax * std::ldexp(1.0f, -17));
    }
  }
  // The block's largest value maps near the top of the range: it is within 2^-4 as well.
  std::vector<float> one(kE4M3Block, 0.0f);
  one[5] = 3.0e-7f;
  CHECK(std::fabs(decoded(one)[5] - 3.0e-7f) <= 3.0e-7f / 16);
}

TEST_CASE("e4m3: non-finite values decode as NaN without spoiling their block's scale") {
  std::vector<float> x(kE4M3Block, 0.25f);
  x[3] = std::numeric_limits<float>::infinity();
  x[4] = -std::numeric_limits<float>::quiet_NaN();
  const auto y = decoded(x);
  CHECK(std::isnan(y[3]));
  CHECK(std::isnan(y[4]));
  CHECK(y[0] == 0.25f);
  std::vector<float> zeros(300, 0.0f);
  for (float v : decoded(zeros)) CHECK(v == 0.0f);
}

TEST_CASE("e4m3 error feedback carries what one encoding lost into the next") {
  std::mt19937 rng(5);
  std::normal_distribution<float> g(0.0f, 1.0f);
  const size_t n = 3 * kE4M3Block + 9;
  std::vector<float> x(n), residual(n, 0.0f);
  for (float& v : x) v = g(rng);
  x[7] = 1e-6f;  // far below its block's largest: rounds to zero alone
  std::vector<double> sent(n, 0.0);
  std::vector<char> wire(e4m3_encoded_bytes(n));
  std::vector<float> y(n);
  const int calls = 64;
  for (int k = 0; k < calls; ++k) {
    e4m3_encode_feedback(x.data(), residual.data(), n, wire.data());
    e4m3_decode(wire.data(), n, y.data());
    for (size_t i = 0; i < n; ++i) sent[i] += y[i];
  }
  CHECK(decoded(x)[7] == 0.0f);
  for (size_t i = 0; i < n; ++i) {
    INFO("element " << i);
    // What was sent over all calls is what was given, up to the one residual still held.
    CHECK(std::abs(sent[i] + residual[i] - double(x[i]) * calls) <= 1e-5 * std::abs(double(x[i]) * calls) + 1e-9);
    CHECK(std::abs(residual[i]) <= std::abs(x[i]) / 8 + 1e-3f);
  }
  CHECK(sent[7] > 0.0);  // the tiny value got through in time
  // A non-finite input goes out as NaN and is not kept.
  x[0] = std::numeric_limits<float>::infinity();
  e4m3_encode_feedback(x.data(), residual.data(), n, wire.data());
  e4m3_decode(wire.data(), n, y.data());
  CHECK(std::isnan(y[0]));
  CHECK(residual[0] == 0.0f);
}

TEST_CASE("e4m3 decode_add adds the decoded values") {
  std::vector<float> x = {1.0f, -2.5f, 0.3f, 7.0f}, acc = {10.0f, 10.0f, 10.0f, 10.0f};
  std::vector<char> wire(e4m3_encoded_bytes(x.size()));
  e4m3_encode(x.data(), x.size(), wire.data());
  e4m3_decode_add(wire.data(), x.size(), acc.data());
  const auto y = decoded(x);
  for (size_t i = 0; i < x.size(); ++i) CHECK(acc[i] == 10.0f + y[i]);
}

TEST_CASE("e4m3 all-reduce: the mean of every rank's rounded input, rounded once more, on every rank") {
  for (int n : {1, 2, 3, 4}) {
    for (size_t count : {size_t(0), size_t(1), size_t(5), size_t(1000), size_t(4099)}) {
      LocalWorld world(n, opts());
      std::vector<std::vector<float>> in(n, std::vector<float>(count)), out(n, std::vector<float>(count));
      std::mt19937 rng(uint32_t(n * 7919 + count));
      std::normal_distribution<float> g(0.0f, 1.0f);
      for (auto& v : in)
        for (size_t i = 0; i < count; ++i) v[i] = g(rng) * (1.0f + float(i % 37));
      const bool in_place = count % 2 == 1;
      auto res = world.run([&](Communicator& comm, int r) -> std::string {
        if (in_place) out[r] = in[r];  // in place: out holds the input
        const float* src = in_place ? out[r].data() : in[r].data();
        comm.all_reduce_e4m3(src, out[r].data(), count, ReduceOp::kAvg)->wait();
        return "";
      });
      INFO("ranks " << n << " count " << count);
      REQUIRE(first_failure(res) == "");
      // Reference: the same parts, decodes and sums in rank order, from the codec alone.
      std::vector<float> expect(count);
      for (int j = 0; j < n; ++j) {
        const size_t b = count * size_t(j) / size_t(n), e = count * size_t(j + 1) / size_t(n);
        std::vector<float> sum(e - b, 0.0f);
        for (int r = 0; r < n; ++r) {
          std::vector<float> part(in[r].begin() + long(b), in[r].begin() + long(e));
          const auto d = decoded(part);
          for (size_t i = 0; i < sum.size(); ++i) sum[i] = r == 0 ? d[i] : sum[i] + d[i];
        }
        for (float& s : sum) s /= float(n);
        const auto d = decoded(sum);
        std::copy(d.begin(), d.end(), expect.begin() + long(b));
      }
      for (int r = 0; r < n; ++r)
        REQUIRE((count == 0 || std::memcmp(out[r].data(), expect.data(), count * sizeof(float)) == 0));
      // And it is close to the exact mean: two roundings of at most 2^-4 each, relative to the
      // block's largest values.
      double err = 0, norm = 0;
      for (size_t i = 0; i < count; ++i) {
        double m = 0;
        for (int r = 0; r < n; ++r) m += in[r][i];
        m /= n;
        err += (out[0][i] - m) * (out[0][i] - m);
        norm += m * m;
      }
      if (count > 100) CHECK(std::sqrt(err / norm) < 0.08);
    }
  }
}

TEST_CASE("e4m3 reduce-scatter gives each rank the sum of its block, in place too") {
  const int n = 3;
  const size_t count = 777;
  LocalWorld world(n, opts());
  std::vector<std::vector<float>> in(n, std::vector<float>(count * n));
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  for (auto& v : in)
    for (float& x : v) x = u(rng);
  auto copy = in;
  std::vector<std::vector<float>> out(n, std::vector<float>(count));
  auto res = world.run([&](Communicator& comm, int r) -> std::string {
    comm.reduce_scatter_e4m3(in[r].data(), out[r].data(), count, ReduceOp::kSum)->wait();
    comm.reduce_scatter_e4m3(copy[r].data(), copy[r].data() + count * r, count, ReduceOp::kSum)->wait();
    return "";
  });
  REQUIRE(first_failure(res) == "");
  for (int r = 0; r < n; ++r) {
    std::vector<float> expect(count, 0.0f);
    for (int s = 0; s < n; ++s) {
      std::vector<float> part(in[s].begin() + long(count * r), in[s].begin() + long(count * (r + 1)));
      const auto d = decoded(part);
      for (size_t i = 0; i < count; ++i) expect[i] = s == 0 ? d[i] : expect[i] + d[i];
    }
    CHECK(std::memcmp(out[r].data(), expect.data(), count * sizeof(float)) == 0);
    CHECK(std::memcmp(copy[r].data() + count * r, expect.data(), count * sizeof(float)) == 0);
  }
}

TEST_CASE("e4m3 all-reduce with error feedback encodes input plus residual and keeps what was lost") {
  const int n = 2;
  const size_t count = 301;
  LocalWorld world(n, opts());
  std::vector<std::vector<float>> in(n, std::vector<float>(count)), res(n, std::vector<float>(count)),
      out(n, std::vector<float>(count));
  std::mt19937 rng(13);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (int r = 0; r < n; ++r)
    for (size_t i = 0; i < count; ++i) in[r][i] = g(rng), res[r][i] = 0.01f * g(rng);
  auto expect_res = res;
  std::vector<std::vector<float>> sent(n, std::vector<float>(count));
  for (int r = 0; r < n; ++r)
    for (int j = 0; j < n; ++j) {  // each part encoded on its own, as the all-to-all sends it
      const size_t b = count * size_t(j) / n, e = count * size_t(j + 1) / n;
      std::vector<char> wire(e4m3_encoded_bytes(e - b));
      e4m3_encode_feedback(in[r].data() + b, expect_res[r].data() + b, e - b, wire.data());
      e4m3_decode(wire.data(), e - b, sent[r].data() + b);
    }
  auto ok = world.run([&](Communicator& comm, int r) -> std::string {
    comm.all_reduce_e4m3(in[r].data(), out[r].data(), count, ReduceOp::kSum, res[r].data())->wait();
    return "";
  });
  REQUIRE(first_failure(ok) == "");
  std::vector<float> sum(count);
  for (size_t i = 0; i < count; ++i) sum[i] = sent[0][i] + sent[1][i];
  std::vector<float> expect(count);
  for (int j = 0; j < n; ++j) {
    const size_t b = count * size_t(j) / n, e = count * size_t(j + 1) / n;
    std::vector<float> part(sum.begin() + long(b), sum.begin() + long(e));
    const auto d = decoded(part);
    std::copy(d.begin(), d.end(), expect.begin() + long(b));
  }
  for (int r = 0; r < n; ++r) {
    CHECK(std::memcmp(out[r].data(), expect.data(), count * sizeof(float)) == 0);
    CHECK(std::memcmp(res[r].data(), expect_res[r].data(), count * sizeof(float)) == 0);
  }
}

TEST_CASE("e4m3 collectives take only sum and avg") {
  LocalWorld world(1, opts());
  float x = 1;
  CHECK_THROWS_WITH(world.comm(0).all_reduce_e4m3(&x, &x, 1, ReduceOp::kMax),
                    Catch::Contains("must be sum or avg"));
}
