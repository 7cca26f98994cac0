// trn-attention-bench: causal attention forward + backward on one thread, the blockwise kernels
// (kernels.h attention_forward/backward, the model's) against the full-matrix kernel they
// replaced (llama.h attention_forward_gqa/backward_gqa, which keeps the T x T probabilities), on
// one sequence per shape. Runs alternate between the two (old, new, new, old, ...) so drift of
// the machine falls on both alike; prints each one's median per sequence length and their ratio,
// and the bytes each keeps for backward. Times are the thread's CPU time, not the wall clock.
// --bf16 also times the bf16 blockwise kernel on the current --bf16-kernels path; --blas runs the
// blockwise fp32 products on cblas_sgemm, as a CPU without AVX-512 does.
//
// --cache times the KV-cached decoder's attention instead (kernels.h attention_forward_rows, as
// trn-generate calls it) against the row-by-row scalar loop it replaced (one row of scores at a
// time, kept here as scalar_cached_attention): a prefill of T rows from position 0, and one
// decoded row at position T.
//
//   trn-attention-bench [--shape llama-small|gpt2-small] [--max-seq T] [--reps N] [--bf16]
//                       [--blas] [--bf16-kernels auto|emulated|onednn] [--cache]
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

#include "collectives/core/error.h"
#include "collectives/core/flags.h"
#include "collectives/core/main.h"
#include "runtime/kernels/bf16.h"
#include "runtime/kernels/kernels.h"
#include "runtime/kernels/llama.h"
#include "runtime/util/random.h"

namespace {

// The calling thread's CPU time (every product runs on it): on a shared machine the wall clock
// also counts the time the thread waits for a core.
double thread_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

double seconds_of(const std::function<void()>& f) {
  const double t0 = thread_seconds();
  f();
  return thread_seconds() - t0;
}

// The KV-cached decoders' attention before it was blockwise: each query row and head in turn,
// its scores against every cached position in one row of `scores`, a softmax, then the weighted
// sum of the values. q (n, q_stride), kc and vc (t0 + n, kv_stride), out (n, H hd).
void scalar_cached_attention(float* out, float* scores, const float* q, int q_stride, const float* kc,
                             const float* vc, int kv_stride, int t0, int n, int H, int K, int hd) {
  const float scale = 1.0f / std::sqrt(float(hd));
  const int group = H / K;
  for (int i = 0; i < n; ++i) {
    const int t = t0 + i;
    for (int h = 0; h < H; ++h) {
      const float* qh = q + size_t(i) * q_stride + size_t(h) * hd;
      const size_t kv_off = size_t(h / group) * hd;
      float maxv = -INFINITY;
      for (int j = 0; j <= t; ++j) {
        const float* kj = kc + size_t(j) * kv_stride + kv_off;
        float s = 0;
        for (int d = 0; d < hd; ++d) s += qh[d] * kj[d];
        s *= scale;
        scores[j] = s;
        maxv = s > maxv ? s : maxv;
      }
      float sum = 0;
      for (int j = 0; j <= t; ++j) {
        scores[j] = std::exp(scores[j] - maxv);
        sum += scores[j];
      }
      const float inv = 1.0f / sum;
      float* o = out + size_t(i) * H * hd + size_t(h) * hd;
      for (int d = 0; d < hd; ++d) o[d] = 0;
      for (int j = 0; j <= t; ++j) {
        const float p = scores[j] * inv;
        const float* vj = vc + size_t(j) * kv_stride + kv_off;
        for (int d = 0; d < hd; ++d) o[d] += p * vj[d];
      }
    }
  }
}

// Alternating runs of a and b (a, b, b, a, ...): their medians.
std::pair<double, double> alternate(int reps, const std::function<void()>& a, const std::function<void()>& b) {
  std::vector<double> ta, tb;
  for (int r = 0; r < reps; ++r) {
    if (r % 2 == 0) {
      ta.push_back(seconds_of(a));
      tb.push_back(seconds_of(b));
    } else {
      tb.push_back(seconds_of(b));
      ta.push_back(seconds_of(a));
    }
  }
  auto med = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  };
  return {med(ta), med(tb)};
}

// --cache: prefill of T rows and one decoded row at position T, cache of T + 1 positions in the
// decoders' layout (q in a fused qkv row, the cache's rows K heads wide).
void bench_cache(int H, int K, int hd, int max_seq, int reps) {
  fmt::print("{:>6} {:>14} {:>14} {:>8} {:>14} {:>14} {:>8}\n", "T", "prefill scalar", "prefill block", "speedup",
             "decode scalar", "decode block", "speedup");
  const int R = (H + 2 * K) * hd, KW = K * hd, OC = H * hd;
  for (int T : {256, 1024, 2048, 4096, 8192}) {
    if (T > max_seq) break;
    trn::Rng rng{uint64_t(T)};
    std::vector<float> q(size_t(T + 1) * R), kc(size_t(T + 1) * KW), vc(kc.size());
    for (float& x : q) x = float(rng.normal());
    for (float& x : kc) x = float(rng.normal());
    for (float& x : vc) x = float(rng.normal());
    std::vector<float> out(size_t(T) * OC), scores(size_t(T) + 1);
    const float* last = q.data() + size_t(T) * R;
    auto pre_scalar = [&] {
      scalar_cached_attention(out.data(), scores.data(), q.data(), R, kc.data(), vc.data(), KW, 0, T, H, K, hd);
    };
    auto pre_block = [&] {
      trn::kernels::attention_forward_rows(out.data(), OC, nullptr, 0, q.data(), R, kc.data(), vc.data(), KW, 0, T, H,
                                           K, hd);
    };
    // One decoded row is microseconds: time 64 of them per run.
    auto dec_scalar = [&] {
      for (int i = 0; i < 64; ++i)
        scalar_cached_attention(out.data(), scores.data(), last, R, kc.data(), vc.data(), KW, T, 1, H, K, hd);
    };
    auto dec_block = [&] {
      for (int i = 0; i < 64; ++i)
        trn::kernels::attention_forward_rows(out.data(), OC, nullptr, 0, last, R, kc.data(), vc.data(), KW, T, 1, H,
                                             K, hd);
    };
    pre_scalar();  // warm: pages touched, primitives made
    pre_block();
    dec_scalar();
    dec_block();
    const auto [ps, pb] = alternate(reps, pre_scalar, pre_block);
    const auto [ds, db] = alternate(reps, dec_scalar, dec_block);
    fmt::print("{:>6} {:>11.2f} ms {:>11.2f} ms {:>7.2f}x {:>11.1f} us {:>11.1f} us {:>7.2f}x\n", T, ps * 1e3, pb * 1e3,
               ps / pb, ds / 64 * 1e6, db / 64 * 1e6, ds / db);
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  return trn::run_main("trn-attention-bench", [&] {
    std::string shape = "llama-small", bf16_kernels = "auto";
    int max_seq = 2048, reps = 5;
    bool bf16 = false, blas = false, cache = false;
    using trn::flags::Range;
    const trn::flags::Table table{
        .program = "trn-attention-bench",
        .summary =
            "\nCausal attention forward + backward on one thread: the blockwise kernels against the "
            "full-matrix "
            "kernel they replaced, medians of alternating runs at T = 256, 1024, 2048.\n",
        .flags = {
            {"--shape", &shape, "llama-small: 8 heads over 4 KV heads of 32; gpt2-small: 12 heads of 64", "",
             "NAME", nullptr, Range::kAny, 0, 0, "llama-small|gpt2-small"},
            {"--max-seq", &max_seq, "longest sequence timed", "", "T", nullptr, Range::kPositive},
            {"--reps", &reps, "runs of each kernel per length", "", "N", nullptr, Range::kPositive},
            {"--bf16", &bf16, "also time the bf16 blockwise kernel"},
            {"--blas", &blas, "the blockwise fp32 products through cblas_sgemm, as without AVX-512"},
            {"--bf16-kernels", &bf16_kernels, "the bf16 kernel path", "", "PATH", nullptr, Range::kAny, 0, 0,
             "auto|emulated|onednn"},
            {"--cache", &cache,
             "time the KV-cached decoder's attention (prefill of T rows, one decoded row at position T) "
             "against the scalar loop it replaced, T up to 8192"},
        }};
    if (!trn::flags::parse(table, std::vector<std::string>(argv + 1, argv + argc))) return 0;
    trn::kernels::set_gemm_threads(1);
    trn::kernels::set_bf16_path(trn::kernels::parse_bf16_path(bf16_kernels));
    trn::kernels::set_attention_blas(blas);
    const bool gpt2 = shape == "gpt2-small";
    const int H = gpt2 ? 12 : 8, K = gpt2 ? 12 : 4, hd = gpt2 ? 64 : 32;
    fmt::print(
        "shape {}: H {} K {} hd {}, 1 sequence, 1 thread, {} runs each, medians of thread CPU time (ms)\n",
        shape, H, K, hd, reps);
    fmt::print("blockwise fp32 products: {}\n", !blas && trn::kernels::fp32_matmuls_onednn()
                                                    ? trn::kernels::fp32_matmul_description()
                                                    : std::string("OpenBLAS cblas_sgemm"));
    if (cache) {
      bench_cache(H, K, hd, max_seq, reps);
      return 0;
    }
    if (bf16) fmt::print("bf16 path: {}\n", trn::kernels::bf16_kernel_description());
    fmt::print("{:>6} {:>12} {:>12} {:>8} {:>12} {:>14} {:>12}\n", "T", "full-matrix", "blockwise", "speedup",
               bf16 ? "bf16-block" : "", "kept (full)", "kept (lse)");
    for (int T : {256, 1024, 2048}) {
      if (T > max_seq) break;
      const int R = (H + 2 * K) * hd, OC = H * hd;
      trn::Rng rng{uint64_t(T)};
      std::vector<float> qkv(size_t(T) * R), dout(size_t(T) * OC);
      for (float& x : qkv) x = float(rng.normal());
      for (float& x : dout) x = float(rng.normal());
      std::vector<float> out(size_t(T) * OC), dqkv(qkv.size()), att(size_t(H) * T * T),
          scratch(size_t(T) * T), lse(size_t(H) * T), qkv32(qkv.size());
      std::vector<trn::kernels::bf16> qh(qkv.size()), oh(out.size());
      trn::kernels::round_to_bf16(qh.data(), qkv.data(), qkv.size());
      auto full = [&] {
        trn::kernels::attention_forward_gqa(out.data(), att.data(), qkv.data(), 1, T, H, K, hd);
        trn::kernels::attention_backward_gqa(dqkv.data(), scratch.data(), dout.data(), qkv.data(), att.data(),
                                             1, T, H, K, hd);
      };
      auto block = [&] {
        trn::kernels::attention_forward(out.data(), lse.data(), qkv.data(), 1, T, H, K, hd);
        trn::kernels::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), 1, T,
                                         H, K, hd);
      };
      auto block16 = [&] {
        trn::kernels::attention_forward_bf16(out.data(), lse.data(), qh.data(), qkv32.data(), 1, T, H, K, hd);
        trn::kernels::round_to_bf16(oh.data(), out.data(), out.size());
        trn::kernels::attention_backward_bf16(dqkv.data(), dout.data(), qh.data(), qkv32.data(), oh.data(),
                                              lse.data(), 1, T, H, K, hd);
      };
      full();  // warm: pages touched, primitives made
      block();
      if (bf16) block16();
      std::vector<double> tf, tb, t16;
      for (int r = 0; r < reps; ++r) {
        if (r % 2 == 0) {
          tf.push_back(seconds_of(full));
          tb.push_back(seconds_of(block));
        } else {
          tb.push_back(seconds_of(block));
          tf.push_back(seconds_of(full));
        }
        if (bf16) t16.push_back(seconds_of(block16));
      }
      const double mf = median(tf) * 1e3, mb = median(tb) * 1e3;
      fmt::print("{:>6} {:>12.2f} {:>12.2f} {:>7.2f}x {:>12} {:>13.1f}M {:>11.1f}K\n", T, mf, mb, mf / mb,
                 bf16 ? fmt::format("{:.2f}", median(t16) * 1e3) : std::string(),
                 double(att.size()) * 4 / 1e6, double(lse.size()) * 4 / 1e3);
    }
    return 0;
  });
}
