// trn-attention-bench: causal attention forward + backward on one thread, the blockwise kernels
// (kernels.h attention_forward/backward, the model's) against the full-matrix kernel they
// replaced (llama.h attention_forward_gqa/backward_gqa, which keeps the T x T probabilities), on
// one sequence per shape. Runs alternate between the two (old, new, new, old, ...) so drift of
// the machine falls on both alike; prints each one's median per sequence length and their ratio,
// and the bytes each keeps for backward. Times are the thread's CPU time, not the wall clock.
// --bf16 also times the bf16 blockwise kernel on the current --bf16-kernels path; --blas runs the
// blockwise fp32 products on cblas_sgemm, as a CPU without AVX-512 does.
//
//   trn-attention-bench [--shape llama-small|gpt2-small] [--max-seq T] [--reps N] [--bf16]
//                       [--blas] [--bf16-kernels auto|emulated|onednn]
#include <fmt/format.h>

#include <algorithm>
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
    bool bf16 = false, blas = false;
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
