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

std::vector<float> decoded(const std::vector<float>& x, Fp8Format fmt = Fp8Format::kOCP) {
  std::vector<char> wire(e4m3_encoded_bytes(x.size()));
  e4m3_encode(x.data(), x.size(), wire.data(), fmt);
  std::vector<float> y(x.size());
  e4m3_decode(wire.data(), x.size(), y.data(), fmt);
  return y;
}

// The e4m3 all-reduce's result from the codec alone: rank j's part of every rank's input
// decoded and summed in rank order (avg: over the ranks), then rounded once more.
std::vector<float> all_reduce_reference(const std::vector<std::vector<float>>& in, size_t count, bool avg,
                                        Fp8Format fmt) {
  const int n = int(in.size());
  std::vector<float> expect(count);
  for (int j = 0; j < n; ++j) {
    const size_t b = count * size_t(j) / size_t(n), e = count * size_t(j + 1) / size_t(n);
    std::vector<float> sum(e - b, 0.0f);
    for (int r = 0; r < n; ++r) {
      const auto d = decoded(std::vector<float>(in[r].begin() + long(b), in[r].begin() + long(e)), fmt);
      for (size_t i = 0; i < sum.size(); ++i) sum[i] = r == 0 ? d[i] : sum[i] + d[i];
    }
    if (avg)
      for (float& v : sum) v /= float(n);
    const auto d = decoded(sum, fmt);
    std::copy(d.begin(), d.end(), expect.begin() + long(b));
  }
  return expect;
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
      const std::vector<float> expect = all_reduce_reference(in, count, true, Fp8Format::kOCP);
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

// --- the neuron format: Trainium2's IEEE-style E4M3 (max 240, exponent 1111 infinity or NaN) ---

namespace {

constexpr Fp8Format kNeuron = Fp8Format::kNeuron;

// A neuron code's value from the format's definition alone, in double: sign, exponent field e
// (bias 7; 0 subnormal), mantissa m; e = 15 is infinity (m = 0) or NaN.
double neuron_value(int c) {
  const int e = (c >> 3) & 15, m = c & 7;
  const double s = (c & 0x80) ? -1.0 : 1.0;
  if (e == 15)
    return m == 0 ? s * std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  return s * (e == 0 ? std::ldexp(double(m), -9) : std::ldexp(1.0 + m / 8.0, e - 7));
}

// The nearest finite neuron value to f, in double, ties to the even code; beyond 240, 240.
double nearest_neuron(float f) {
  if (std::fabs(f) >= 240.0f) return std::copysign(240.0, f);
  double best = 0, best_d = std::numeric_limits<double>::infinity();
  int best_code = 0;
  for (int c = 0; c < 256; ++c) {
    const double v = neuron_value(c);
    if (!std::isfinite(v)) continue;
    const double d = std::fabs(v - double(f));
    if (d < best_d || (d == best_d && (c & 1) == 0 && (best_code & 1) == 1))
      best = v, best_d = d, best_code = c;
  }
  return best == 0 ? std::copysign(0.0, f) : best;
}

std::vector<float> decoded_as(const std::vector<float>& x, Fp8Format fmt,
                              std::vector<char>* wire_out = nullptr) {
  std::vector<char> wire(e4m3_encoded_bytes(x.size()));
  e4m3_encode(x.data(), x.size(), wire.data(), fmt);
  std::vector<float> y(x.size());
  e4m3_decode(wire.data(), x.size(), y.data(), fmt);
  if (wire_out) *wire_out = wire;
  return y;
}

}  // namespace

TEST_CASE("e4m3 formats: names and ranges") {
  CHECK(parse_fp8_format("ocp") == Fp8Format::kOCP);
  CHECK(parse_fp8_format("neuron") == kNeuron);
  CHECK_THROWS_WITH(parse_fp8_format("e4m3fnuz"), Catch::Contains("--fp8-format takes ocp"));
  CHECK(std::string(to_string(kNeuron)) == "neuron");
  CHECK(e4m3_max(Fp8Format::kOCP) == 448.0f);
  CHECK(e4m3_max(kNeuron) == 240.0f);
}

TEST_CASE("neuron e4m3: all 256 codes decode to the format's values and the finite ones encode back") {
  int finite = 0;
  for (int c = 0; c < 256; ++c) {
    INFO("code " << c);
    const double want = neuron_value(c);
    const float got = e4m3_to_f32(uint8_t(c), kNeuron);
    if (std::isnan(want)) {
      CHECK(std::isnan(got));
      continue;
    }
    CHECK(double(got) == want);
    CHECK(std::signbit(got) == bool(c & 0x80));
    if (std::isinf(want)) continue;
    ++finite;
    CHECK(f32_to_e4m3(got, kNeuron) == c);
    // Below exponent 1111 the formats agree code for code.
    CHECK(e4m3_to_f32(uint8_t(c), Fp8Format::kOCP) == got);
  }
  CHECK(finite == 240);  // 2 x (15 x 8) codes: exponents 0-14, every mantissa, both signs
  CHECK(e4m3_to_f32(0x77, kNeuron) == 240.0f);
  CHECK(e4m3_to_f32(0x78, kNeuron) == std::numeric_limits<float>::infinity());
  CHECK(e4m3_to_f32(0xF8, kNeuron) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(e4m3_to_f32(0x79, kNeuron)));
  CHECK(e4m3_to_f32(0x78, Fp8Format::kOCP) == 256.0f);  // the same byte is 256 in ocp
}

TEST_CASE("neuron e4m3: round to nearest even against a double reference, saturating at 240") {
  CHECK(f32_to_e4m3(240.0f, kNeuron) == 0x77);
  CHECK(f32_to_e4m3(247.9f, kNeuron) == 0x77);
  CHECK(f32_to_e4m3(250.0f, kNeuron) == 0x77);  // would round to 256: saturates
  CHECK(f32_to_e4m3(448.0f, kNeuron) == 0x77);
  CHECK(f32_to_e4m3(-1e30f, kNeuron) == 0xF7);
  CHECK(f32_to_e4m3(std::numeric_limits<float>::infinity(), kNeuron) == 0x7F);
  CHECK(std::isnan(e4m3_to_f32(f32_to_e4m3(-std::numeric_limits<float>::infinity(), kNeuron), kNeuron)));
  CHECK(std::isnan(e4m3_to_f32(f32_to_e4m3(std::numeric_limits<float>::quiet_NaN(), kNeuron), kNeuron)));
  // Ties: 1.0625 between 1 and 1.125 goes to 1; 232 between 224 and 240 goes to 224 (even).
  CHECK(e4m3_to_f32(f32_to_e4m3(1.0625f, kNeuron), kNeuron) == 1.0f);
  CHECK(e4m3_to_f32(f32_to_e4m3(232.0f, kNeuron), kNeuron) == 224.0f);
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> ex(-14, 9);
  for (int i = 0; i < 20000; ++i) {
    const float f = std::ldexp(mant(rng), ex(rng));
    INFO("f = " << f);
    REQUIRE(double(e4m3_to_f32(f32_to_e4m3(f, kNeuron), kNeuron)) == nearest_neuron(f));
  }
}

TEST_CASE("neuron e4m3 blocks scale below 240 and ocp blocks below 448, so only their subnormals differ") {
  std::mt19937 rng(5);
  std::normal_distribution<float> g(0.0f, 1.0f);
  const size_t n = 4 * kE4M3Block + 9;
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = g(rng) * std::ldexp(1.0f, int(i / kE4M3Block) * 11 - 25);
  x[7] = std::numeric_limits<float>::infinity();
  std::vector<char> wn, wo;
  const auto yn = decoded_as(x, kNeuron, &wn), yo = decoded_as(x, Fp8Format::kOCP, &wo);
  const size_t blocks = (n + kE4M3Block - 1) / kE4M3Block;
  for (size_t b = 0; b < n; b += kE4M3Block) {
    float amax = 0;
    const size_t e = std::min(n, b + kE4M3Block);
    for (size_t i = b; i < e; ++i)
      if (std::isfinite(x[i])) amax = std::max(amax, std::fabs(x[i]));
    const int kn = int8_t(wn[b / kE4M3Block]), ko = int8_t(wo[b / kE4M3Block]);
    INFO("block " << b / kE4M3Block << " amax " << amax);
    CHECK(std::ldexp(amax, -kn) > 120.0f);
    CHECK(std::ldexp(amax, -kn) <= 240.0f);
    CHECK(std::ldexp(amax, -ko) > 224.0f);
    CHECK(std::ldexp(amax, -ko) <= 448.0f);
    for (size_t i = b; i < e; ++i) {
      const uint8_t code = uint8_t(wn[blocks + i]);
      if (!std::isfinite(x[i])) {
        CHECK(std::isnan(yn[i]));
        continue;
      }
      CHECK((code & 0x7F) < 0x78);  // never exponent 1111: no infinity from a finite value
      // 3 mantissa bits: within 2^-4 relative above the block's subnormals.
      if (std::fabs(x[i]) >= amax * std::ldexp(1.0f, -12))
        CHECK(std::fabs(yn[i] - x[i]) <= std::fabs(x[i]) / 16);
      // Normal in both formats: the same value (the scales differ by a power of two at most).
      if (std::fabs(x[i]) >= amax * std::ldexp(1.0f, -12)) CHECK(yn[i] == yo[i]);
    }
  }
  // Where they differ: neuron's block scale is a binade higher (unless the largest value scales
  // into (224, 240], where both take the same), so its subnormals start a binade earlier. With
  // 1.0 the largest, ocp scales by 2^8 and keeps 1.25 x 2^-15 exactly (5 units of 2^-9); neuron
  // scales by 2^7, 2.5 units, and rounds to even: 2^-15.
  std::vector<float> small(kE4M3Block, 0.0f);
  small[0] = 1.0f;
  small[1] = 1.25f * std::ldexp(1.0f, -15);
  CHECK(decoded_as(small, Fp8Format::kOCP)[1] == small[1]);
  CHECK(decoded_as(small, kNeuron)[1] == std::ldexp(1.0f, -15));
  // Error feedback under neuron leaves exactly what the encoding lost.
  std::vector<float> res(n, 0.0f), dec(n);
  std::vector<char> wire(e4m3_encoded_bytes(n));
  e4m3_encode_feedback(x.data(), res.data(), n, wire.data(), kNeuron);
  e4m3_decode(wire.data(), n, dec.data(), kNeuron);
  for (size_t i = 0; i < n; ++i)
    if (std::isfinite(x[i]))
      CHECK(res[i] == x[i] - dec[i]);
    else
      CHECK(res[i] == 0.0f);
}

// Every 16th value is 2^-14 of its neighbours': in the subnormal range, where the formats round
// differently, so the results differ.
TEST_CASE("e4m3 all-reduce in the neuron format matches the neuron codec, and differs from ocp") {
  const int n = 3;
  const size_t count = 1000;
  LocalWorld world(n, opts());
  std::vector<std::vector<float>> in(n, std::vector<float>(count)), neuron(n, std::vector<float>(count)),
      ocp(n, std::vector<float>(count));
  std::mt19937 rng(17);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (auto& v : in)
    for (size_t i = 0; i < count; ++i) v[i] = g(rng) * (i % 16 == 3 ? std::ldexp(1.0f, -14) : 1.0f);
  auto res = world.run([&](Communicator& comm, int r) -> std::string {
    comm.all_reduce_e4m3(in[r].data(), neuron[r].data(), count, ReduceOp::kSum, nullptr, kNeuron)->wait();
    comm.all_reduce_e4m3(in[r].data(), ocp[r].data(), count, ReduceOp::kSum)->wait();
    return "";
  });
  REQUIRE(first_failure(res) == "");
  const std::vector<float> expect = all_reduce_reference(in, count, false, kNeuron);
  for (int r = 0; r < n; ++r) {
    CHECK(std::memcmp(neuron[r].data(), expect.data(), count * sizeof(float)) == 0);
    CHECK(std::memcmp(ocp[r].data(), neuron[r].data(), count * sizeof(float)) != 0);
  }
}
