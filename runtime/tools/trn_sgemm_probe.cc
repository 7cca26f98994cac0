// trn-sgemm-probe: the fp32 ceiling of this machine, cblas_sgemm GFLOP/s on one thread, for
// model-FLOPs-utilization figures. Prints one line per shape and a last "peak" line.
//
//   trn-sgemm-probe [--seconds S] [--threads N]
#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "collectives/core/flags.h"
#include "collectives/core/main.h"

int main(int argc, char** argv) {
  return trn::run_main("trn-sgemm-probe", [&] {
    double seconds = 0.5;
    int threads = 1;
    using trn::flags::Range;
    const trn::flags::Table table{
        .program = "trn-sgemm-probe",
        .summary = "\nThe fp32 ceiling of this machine: cblas_sgemm GFLOP/s per shape and a last \"peak\" line.\n",
        .flags = {
            {"--seconds", &seconds, "time per shape", "", "S", nullptr, Range::kPositive},
            {"--threads", &threads, "OpenBLAS threads", "", "N", nullptr, Range::kPositive},
        }};
    if (!trn::flags::parse(table, std::vector<std::string>(argv + 1, argv + argc))) return 0;
    openblas_set_num_threads(threads);
    // The shapes of the models' big matmuls: (tokens x C) @ (C x 4C) and friends.
    const int shapes[][3] = {{1024, 512, 128}, {2048, 1024, 256}, {1024, 1024, 1024}};
    double peak = 0.0;
    for (const auto& s : shapes) {
      const int M = s[0], N = s[1], K = s[2];
      std::vector<float> a(size_t(M) * K, 0.5f), b(size_t(K) * N, 0.25f), c(size_t(M) * N);
      auto run = [&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, N, K, 1.0f, a.data(), K, b.data(),
                    N, 0.0f, c.data(), N);
      };
      run();
      int iters = 0;
      const auto t0 = std::chrono::steady_clock::now();
      double dt = 0.0;
      while (dt < seconds) {
        run();
        ++iters;
        dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
      const double gflops = 2.0 * M * N * K * iters / dt / 1e9;
      peak = std::max(peak, gflops);
      fmt::print("sgemm {}x{}x{}: {:.1f} GFLOP/s\n", M, N, K, gflops);
    }
    fmt::print("peak {:.1f} GFLOP/s ({} thread{})\n", peak, threads, threads == 1 ? "" : "s");
    return 0;
  });
}
