#include "runtime/plan/calibrate.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include "collectives/bootstrap/file_store.h"
#include "collectives/communicator.h"
#include "collectives/core/aligned.h"
#include "collectives/core/error.h"
#include "collectives/core/settings.h"
#include "collectives/fabric/fabric.h"
#include "runtime/kernels/bf16.h"
#include "runtime/kernels/kernels.h"
#include "runtime/model/model.h"
#include "runtime/model/stage.h"
#include "runtime/optim/adamw.h"
#include "runtime/plan/plan.h"
#include "runtime/util/thread_pool.h"

namespace trn::plan {
namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// One piece of the model as a Stage of its own, with parameters, gradients and inputs.
struct Piece {
  Piece(const model::Config& c, int tp, model::Chunk chunk, int B, int T, RecordingRegion* region)
      : lay(c, model::Placement{tp, 0, {chunk}}),
        params(lay.total()),
        grads(lay.total(), 0.0f),
        bf16(lay),
        stage(lay, B, T, 1, tp > 1 ? region : nullptr, 0),
        first(chunk.embedding),
        last(chunk.head) {
    model::init_params(lay, 1234, params.data());
    if (c.precision == model::Precision::kBf16) {
      bf16.refresh(params.data());
      stage.use_bf16_weights(bf16.data());
    }
    const size_t n = size_t(B) * T;
    tokens.resize(n);
    targets.resize(n);
    for (size_t i = 0; i < n; ++i) {
      tokens[i] = int32_t((i * 7919) % size_t(c.vocab));
      targets[i] = int32_t((i * 104729 + 1) % size_t(c.vocab));
    }
    hidden.assign(n * c.d_model, 0.0f);
    dout.assign(n * c.d_model, 0.0f);
    for (size_t i = 0; i < hidden.size(); ++i) {
      hidden[i] = float((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
      dout[i] = hidden[i] * 1e-3f;
    }
  }
  void forward() {
    stage.forward(0, params.data(), first ? tokens.data() : nullptr, first ? nullptr : hidden.data(),
                  last ? targets.data() : nullptr);
  }
  void backward(model::BackwardPart part = model::BackwardPart::kFull) {
    stage.backward(
        0, params.data(), grads.data(), 1e-3f, last ? nullptr : dout.data(), [](size_t) {}, part);
  }
  void weights() { stage.backward_weights(0, grads.data()); }

  model::ParamLayout lay;
  AlignedVector<float> params, grads;
  model::Bf16Weights bf16;
  model::Stage<float> stage;
  bool first, last;
  std::vector<int32_t> tokens, targets;
  AlignedVector<float> hidden, dout;
};

template <class F>
double seconds(F&& f) {
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Forward and backward of the piece, repeated: the medians, and the split of a zero-bubble
// backward into its input and weight parts.
struct Timed {
  double fwd = 0, bwd = 0, bwd_input = 0, bwd_weight = 0;
};
Timed time_piece(Piece& p, int repeats, bool split) {
  std::vector<double> f, b, bi, bw;
  for (int r = 0; r <= repeats; ++r) {  // the first round warms caches and primitives
    const double tf = seconds([&] { p.forward(); });
    const double tb = seconds([&] { p.backward(); });
    double ti = 0, tw = 0;
    if (split) {
      p.forward();
      ti = seconds([&] { p.backward(model::BackwardPart::kInput); });
      tw = seconds([&] { p.weights(); });
    }
    if (r == 0) continue;
    f.push_back(tf);
    b.push_back(tb);
    bi.push_back(ti);
    bw.push_back(tw);
  }
  // The median run, as a step's typical time is what the plan predicts: the fastest would leave
  // out the few percent by which a vCPU's speed varies from one run to the next.
  return {median(f), median(b), median(bi), median(bw)};
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      return colon == std::string::npos ? line : line.substr(colon + 2);
    }
  return "unknown";
}

// A command's output's last non-empty line (its one error line when it failed).
std::string last_line(const std::string& out) {
  const std::string text = out.substr(0, out.find_last_not_of('\n') + 1);
  return text.substr(text.find_last_of('\n') + 1);
}

// The largest "peak RSS N MB" a command's output reports, in bytes (0 when it reports none).
double peak_rss_of(const std::string& command) {
  // A job that hangs is killed: calibrate never waits without a deadline.
  FILE* f = popen(("timeout 600 env " + command + " 2>&1").c_str(), "r");
  if (!f) return 0;
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, f)) out.append(buf, n);
  const int status = pclose(f);
  if (status != 0) {
    throw usage_error("calibrate: measuring the base memory failed ({}): {}", command, last_line(out));
  }
  double mb = 0;
  const std::regex re("peak RSS ([0-9.]+) MB");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it)
    mb = std::max(mb, std::stod((*it)[1]));
  return mb * 1024 * 1024;
}

// The family's own fields come with it (Config::flags), so a new family's shape is measured whole.
std::string model_flags(const model::Config& c) { return c.flags(); }

// The median step time of each of `commands` (trn-train runs, each writing the --metrics-jsonl
// file of the same index), run all at once: the steps after the first two (warm-up), whose
// elapsed_s differences are the steps' own times.
std::vector<double> step_seconds_of(const std::vector<std::string>& commands,
                                    const std::vector<std::string>& metrics) {
  std::vector<FILE*> running;
  for (const std::string& c : commands) {
    // A job that hangs is killed: calibrate never waits without a deadline.
    FILE* f = popen(("timeout 600 env " + c + " 2>&1").c_str(), "r");
    if (!f) {
      const int e = errno;
      for (FILE* started : running) pclose(started);  // (each ends by its own timeout at worst)
      throw usage_error("calibrate: cannot run {}: {}", c, std::strerror(e));
    }
    running.push_back(f);
  }
  std::vector<std::string> outs(running.size());
  std::vector<int> status(running.size());
  for (size_t i = 0; i < running.size(); ++i) {
    char buf[4096];
    while (size_t n = fread(buf, 1, sizeof buf, running[i])) outs[i].append(buf, n);
    status[i] = pclose(running[i]);
  }
  std::vector<double> out;
  for (size_t i = 0; i < commands.size(); ++i) {
    if (status[i] != 0)
      throw usage_error("calibrate: timing a step failed ({}): {}", commands[i], last_line(outs[i]));
    std::ifstream in(metrics[i]);
    std::vector<double> elapsed;
    const std::regex re("\"elapsed_s\": ([0-9.e+-]+)");
    for (std::string line; std::getline(in, line);) {
      std::smatch m;
      if (std::regex_search(line, m, re)) elapsed.push_back(std::stod(m[1]));
    }
    std::vector<double> steps;
    for (size_t k = 2; k < elapsed.size(); ++k) steps.push_back(elapsed[k] - elapsed[k - 1]);
    if (steps.empty()) throw usage_error("calibrate: timing a step wrote no step times ({})", commands[i]);
    out.push_back(median(steps));
  }
  return out;
}

// Samples (microseconds, by size in bytes) of a 2-rank ring all-reduce in a step, as `trn-plan
// probe-link` measures them on this host under `env`: each run's median per size is appended to
// `samples`. A run that printed nothing leaves rank 0's last error line in `failure`.
void probe_costs(const std::string& prober, const model::Config& c, int seq_len, const std::string& env,
                 int runs, std::map<double, std::vector<double>>& samples, std::string& failure,
                 int ranks = 2, const std::string& flags = "") {
  for (int r = 0; r < runs; ++r) {
    char dir[] = "/tmp/trn-plan-linkXXXXXX";
    if (!mkdtemp(dir)) throw usage_error("calibrate: cannot make a scratch directory in /tmp");
    const std::string d = dir;
    const std::string one = fmt::format(
        "TRN_STORE_DIR={} TRN_WORLD_SIZE={} TRN_LOG_LEVEL=error OPENBLAS_NUM_THREADS=1 {} {} probe-link "
        "{} --seq-len {} {}",
        d, ranks, env, prober, model_flags(c), seq_len, flags);
    // Rank 0's error output goes to a file in the scratch directory, the measurements to the pipe.
    std::string others;
    for (int k = 1; k < ranks; ++k)
      others += fmt::format("TRN_RANK={} timeout 300 env {} > /dev/null 2>&1 & ", k, one);
    const std::string cmd =
        fmt::format("{{ {}TRN_RANK=0 timeout 300 env {} 2>{}/rank0.err; wait; }}", others, one, d);
    FILE* f = popen(cmd.c_str(), "r");
    std::string out;
    if (f) {
      char buf[4096];
      while (size_t n = fread(buf, 1, sizeof buf, f)) out.append(buf, n);
      pclose(f);
    }
    std::istringstream lines(out);
    bool any = false;
    for (std::string line; std::getline(lines, line);) {
      std::istringstream w(line);
      double size = 0, us = 0;
      if (w >> size >> us) samples[size].push_back(us), any = true;
    }
    if (!any) {
      std::ifstream err(d + "/rank0.err");
      for (std::string line; std::getline(err, line);)
        if (!line.empty()) failure = line;
      if (failure.empty()) failure = "it printed no measurement";
    }
    std::filesystem::remove_all(d);
  }
}

// alpha and beta of p fitted to a 2-rank ring all-reduce's times, t = 2 alpha + size (beta +
// gamma (1 - overlap) / 2) as the cost model charges it (least squares on the relative error);
// false when there are too few points or the fit is not a link.
//
// The times are first made non-decreasing in size, each the least of its own and every larger
// size's: a message never costs more than a larger one on the same link (it could travel as
// part of it), so a small size measured slower than a larger one was slowed by something else
// on the host (a loaded host wakes a rank late), and the larger size's time bounds it.
bool fit_link(std::map<double, double> times, CostParams& p) {
  std::erase_if(times, [](const auto& st) { return !(st.second > 0); });  // no time: no point
  if (times.size() < 3) return false;
  double least = std::numeric_limits<double>::infinity();
  for (auto it = times.rbegin(); it != times.rend(); ++it) least = it->second = std::min(it->second, least);
  // Minimise sum ((a + b s - t) / t)^2: weights 1 / t^2.
  double sw = 0, ss = 0, sss = 0, st = 0, sst = 0;
  for (const auto& [s, t] : times) {
    if (t <= 0) continue;
    const double w = 1 / (t * t), kib = s / 1024;
    sw += w, ss += w * kib, sss += w * kib * kib, st += w * t, sst += w * kib * t;
  }
  const double det = sw * sss - ss * ss;
  if (det <= 0) return false;
  const double a = (sss * st - ss * sst) / det, b = (sw * sst - ss * st) / det;
  const double reduce = p.gamma_us_per_kib * (1 - p.ring_overlap) / 2;
  if (b <= reduce) return false;
  p.beta_us_per_kib = b - reduce;
  p.alpha_us = std::max(1.0, a / 2);
  return true;
}

}  // namespace

PieceTimes time_pieces(const model::Config& c, int tp, int B, int T, int repeats,
                       std::vector<std::pair<std::string, std::vector<TpCall>>>* calls) {
  RecordingRegion region(tp);
  PieceTimes t;
  auto record = [&](const char* name) {
    if (calls) calls->push_back({name, region.calls});
    region.calls.clear();
  };
  {
    Piece e(c, tp, model::Chunk{0, 0, true, false}, B, T, &region);
    if (calls) {
      region.calls.clear();
      e.forward();
      record("embedding_fwd");
      e.backward();
      record("embedding_bwd");
    }
    const Timed x = time_piece(e, repeats, false);
    t.embedding_fwd = x.fwd;
    t.embedding_bwd = x.bwd;
  }
  {
    Piece b(c, tp, model::Chunk{0, 1, false, false}, B, T, &region);
    if (calls) {
      region.calls.clear();
      b.forward();
      record("block_fwd");
      b.backward();
      record("block_bwd");
    }
    // (Zero-bubble's split backward runs with neither recomputation nor sequence parallelism, and
    // not for a mixture of experts, whose layer has no split backward: parallel::check refuses zb.)
    const bool split = c.recompute == 0 && !c.recompute_selective && !c.sequence_parallel && !c.moe();
    const Timed x = time_piece(b, repeats, split);
    t.block_fwd = x.fwd;
    t.block_bwd = x.bwd;
    t.block_bwd_input = x.bwd_input;
    t.block_bwd_weight = x.bwd_weight;
  }
  {
    Piece h(c, tp, model::Chunk{c.n_layer, c.n_layer, false, true}, B, T, &region);
    if (calls) {
      region.calls.clear();
      h.forward();
      record("head_fwd");
      h.backward();
      record("head_bwd");
    }
    const Timed x = time_piece(h, repeats, false);
    t.head_fwd = x.fwd;
    t.head_bwd = x.bwd;
  }
  region.calls.clear();
  // The pieces alone run from warm caches; a model's step walks through every block's weights
  // and activations. The whole model's forward and backward, timed the same way, scale them.
  if (!calls) {
    Piece whole(c, tp, model::Chunk{0, c.n_layer, true, true}, B, T, &region);
    const Timed x = time_piece(whole, repeats, false);
    const double f = t.embedding_fwd + c.n_layer * t.block_fwd + t.head_fwd;
    const double b = t.embedding_bwd + c.n_layer * t.block_bwd + t.head_bwd;
    const double rf = f > 0 ? x.fwd / f : 1, rb = b > 0 ? x.bwd / b : 1;
    for (double* v : {&t.embedding_fwd, &t.block_fwd, &t.head_fwd}) *v *= rf;
    for (double* v : {&t.embedding_bwd, &t.block_bwd, &t.block_bwd_input, &t.block_bwd_weight, &t.head_bwd})
      *v *= rb;
  }
  return t;
}

void probe_link(const model::Config& c, int seq_len, int iters, bool behind) {
  kernels::set_gemm_threads(1);
  auto store = FileStore::from_environment();
  const int world =
      settings::get("TRN_WORLD_SIZE").empty() ? 0 : static_cast<int>(settings::get_int("TRN_WORLD_SIZE"));
  const int rank = settings::get("TRN_RANK").empty() ? -1 : static_cast<int>(settings::get_int("TRN_RANK"));
  if (world < 2 || world > 64 || rank < 0 || rank >= world)
    throw usage_error("probe-link runs as 2 to 64 ranks: TRN_WORLD_SIZE=N and TRN_RANK 0 .. N - 1");
  auto p2p = fabric::connect(*store, rank, world, fabric::Options::from_environment());
  CommOptions co;
  co.algo = Algo::kRing;
  Communicator comm(p2p, co);
  // The work: the block forward of the fewest sequences (a power of two, at most 64) that come
  // to half a GFLOP: the compute between two tensor-parallel all-reduces
  // of a block. Both ranks pick the same from the model's shape.
  const model::ParamLayout lay(c);
  double block_matmul = 0;
  for (const model::TensorSpec& t : lay.tensors())
    if (t.matmul && t.name.find(".0.") != std::string::npos) block_matmul += double(t.numel);
  int B = 1;
  while (B < 64 && 2.0 * B * seq_len * block_matmul < 0.5e9) B *= 2;
  Piece block(c, 1, model::Chunk{0, 1, false, false}, B, seq_len, nullptr);
  constexpr size_t kMax = size_t(4) << 20;
  AlignedVector<float> in(kMax / sizeof(float), 1.0f), out(kMax / sizeof(float));
  auto all_reduce = [&](size_t bytes) {
    comm.all_reduce(in.data(), out.data(), bytes / sizeof(float), DataType::kF32, ReduceOp::kSum)->wait();
  };
  for (int i = 0; i < 3; ++i) {  // warm-up: primitives, caches, the connection
    block.forward();
    all_reduce(kMax);
  }
  // Each call after the work, as a step's collectives come between its kernels, so its time
  // holds the peer arriving a little late and the threads waking after the work. Medians: the
  // time of the work alone varies by more than a small call takes, so a cost measured as the
  // difference of the two would be noise at the small sizes that fix alpha.
  // Behind: each call is issued before the work and waited for after it, as a step's hidden
  // collectives (data-parallel buckets, ZeRO-3's prefetched gathers, context parallelism's ring,
  // pipeline sends) run while the rank computes; its own time (issued to the engine's end) is
  // the sample.
  for (size_t bytes = 4096; bytes <= kMax; bytes *= 4) {
    std::vector<double> wait;
    for (int i = 0; i < iters; ++i) {
      if (behind) {
        const auto issued = std::chrono::steady_clock::now();
        const WorkPtr w =
            comm.all_reduce(in.data(), out.data(), bytes / sizeof(float), DataType::kF32, ReduceOp::kSum);
        block.forward();
        w->wait();
        wait.push_back(std::chrono::duration<double>(w->ran().second - issued).count());
        continue;
      }
      block.forward();
      wait.push_back(seconds([&] { all_reduce(bytes); }));
    }
    if (rank == 0) {
      double mean = 0;
      for (double w : wait) mean += w / double(wait.size());
      std::sort(wait.begin(), wait.end());
      fmt::print("{} {:.1f} {:.1f} {:.1f}\n", bytes, median(wait) * 1e6, mean * 1e6, wait[wait.size() * 9 / 10] * 1e6);
    }
  }
  comm.barrier()->wait();
}

Calibration calibrate(const model::Config& c, int seq_len, const CalibrateOptions& opt) {
  // One thread per matmul, as a trn-train rank with --threads 1 runs (OpenBLAS would take every core).
  kernels::set_gemm_threads(1);
  Calibration cal;
  model::Config bare = c;
  cal.model = c.describe();
  cal.precision = c.precision == model::Precision::kBf16 ? "bf16" : "fp32";
  cal.seq_len = seq_len;
  cal.cpu = cpu_model();
  for (int tp = 1; tp <= opt.max_tp; ++tp) {
    try {
      model::check_tensor_parallel(c, tp);
    } catch (const Error&) {
      continue;
    }
    for (int B = 1; B <= opt.max_batch; B *= 2) {
      cal.pieces[tp][B] = time_pieces(bare, tp, B, seq_len, opt.repeats);
      if (!opt.quiet)
        fmt::print(stderr, "calibrate: tp {} micro-batch {}: block forward {:.2f} ms, backward {:.2f} ms\n",
                   tp, B, cal.pieces[tp][B].block_fwd * 1e3, cal.pieces[tp][B].block_bwd * 1e3);
    }
  }
  // AdamW and the gradient norm over the whole model's buffer, one thread.
  {
    const model::ParamLayout lay(c);
    AlignedVector<float> params(lay.total()), grads(lay.total(), 1e-3f);
    model::init_params(lay, 1, params.data());
    optim::AdamW adam(lay, optim::AdamWConfig{});
    ThreadPool pool(1);
    std::vector<double> a, n;
    for (int r = 0; r <= opt.repeats; ++r) {
      const double ta = seconds([&] { adam.step(params.data(), grads.data(), 1e-4f, pool); });
      const double tn = seconds([&] { (void)adam.grad_norm(grads.data(), pool); });
      if (r) a.push_back(ta), n.push_back(tn);
    }
    cal.adamw_s_per_param = median(a) / double(lay.total());
    cal.norm_s_per_param = median(n) / double(lay.total());
    std::vector<char> src(size_t(256) << 20, 1), dst(src.size());
    std::vector<double> cp;
    for (int r = 0; r <= opt.repeats; ++r) {
      const double s = seconds([&] { std::memcpy(dst.data(), src.data(), src.size()); });
      if (r) cp.push_back(s);
    }
    cal.copy_bytes_per_s = double(src.size()) / *std::min_element(cp.begin(), cp.end());
  }
  // The links, as 2 ranks of this host see them: shm, and tcp (what ranks on other hosts use).
  if (!opt.prober.empty()) {
    CostParams intra = params_for_transport("shm"), inter = params_for_transport("tcp");
    // A busy host can hide a link's growth with size in noise: up to three rounds of
    // measurements, each round's medians joining the earlier ones', before calibrate gives up.
    const auto measure = [&](const char* name, const std::string& env, CostParams& p) {
      std::map<double, std::vector<double>> samples;
      std::string failure;
      for (int round = 0; round < 3; ++round) {
        probe_costs(opt.prober, c, seq_len, env, std::max(1, opt.repeats), samples, failure);
        if (samples.empty()) break;  // the probe measures nothing at all: more rounds would not either
        std::map<double, double> medians;
        for (auto& [size, v] : samples) medians[size] = median(v);
        if (fit_link(medians, p)) return;
      }
      if (samples.empty())
        throw usage_error("calibrate: {} probe-link measured no {} link between 2 ranks of this host: {}",
                          opt.prober, name, failure);
      throw usage_error("calibrate: the {} link's all-reduce times did not grow with message size in 3 rounds "
                        "of measurements (this host is too busy to measure it); rerun calibrate on an idle host",
                        name);
    };
    measure("shm", "", intra);
    measure("tcp", "TRN_FABRIC_PROVIDER=tcp TRN_FABRIC_SHM=0", inter);
    cal.intra = intra;
    cal.inter = inter;
    cal.links_measured = true;
    // Ranks beyond the cores: twice as many ranks as cores in one ring over shm, each running
    // the same work between its calls. A ring step then often waits for its neighbour to be
    // scheduled again: the latency per step, fitted as the 2-rank one is, over 2 (n - 1) steps.
    // (Up to probe-link's 64 ranks: a host of more than 32 cores is not measured.)
    const long cores = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
    if (const int n = int(2 * cores); n > 2 && n <= 64) {
      // The same ring with each call behind the work (probe-link --behind), as a step's hidden
      // collectives run: a ring step then waits for a peer's engine thread to get a core from
      // the ranks' compute, not from callers that wait.
      auto ring_step = [&](const std::string& flags, std::string& failure) {
        std::map<double, std::vector<double>> samples;
        probe_costs(opt.prober, c, seq_len, "", std::max(1, opt.repeats), samples, failure, n, flags);
        std::map<double, double> medians;
        for (auto& [size, v] : samples) medians[size] = median(v);
        CostParams over = params_for_transport("shm");
        return fit_link(medians, over) ? std::max(intra.alpha_us, over.alpha_us / (n - 1)) : 0.0;
      };
      std::string failure, behind_failure;
      cal.oversubscribed_alpha_us = ring_step("", failure);
      cal.oversubscribed_behind_alpha_us =
          std::max(cal.oversubscribed_alpha_us, ring_step("--behind", behind_failure));
      if (!opt.quiet)
        fmt::print(
            stderr, "calibrate: {} ranks on {} cores: {:.1f} us a ring step{}, {:.1f} us behind the work{}\n",
            n, cores, cal.oversubscribed_alpha_us, failure.empty() ? "" : " (" + failure + ")",
            cal.oversubscribed_behind_alpha_us, behind_failure.empty() ? "" : " (" + behind_failure + ")");
    }
    if (!opt.quiet)
      fmt::print(stderr,
                 "calibrate: links: shm alpha {:.1f} us beta {:.3f} us/KiB; tcp alpha {:.1f} us beta {:.3f} "
                 "us/KiB\n",
                 cal.intra.alpha_us, cal.intra.beta_us_per_kib, cal.inter.alpha_us,
                 cal.inter.beta_us_per_kib);
  }
  // A worker's memory beyond what the plan counts: libraries, the fabric, threads. Measured as
  // trn-train's peak RSS less the plan's own count for the same job: one process alone (no
  // fabric), 2 ranks over shm, and 2 ranks over tcp (a rank with peers on other hosts).
  if (!opt.trn_train.empty()) {
    const std::string dir = opt.trn_train.substr(0, opt.trn_train.find_last_of('/') + 1);
    const int batch = 2 * std::min(opt.max_batch, 2);
    Cluster here;
    here.local = true;
    here.cpu_cores = 1 << 20;
    here.calibration = cal;
    Job job;
    job.model = c;
    job.global_batch = batch;
    job.seq_len = seq_len;
    const auto base = [&](int ranks, const char* env) {
      std::string cmd = fmt::format(
          "OPENBLAS_NUM_THREADS=1 TRN_LOG_LEVEL=info {} {}{} {} --precision {} --dp {} --steps 2 "
          "--batch-size {} --seq-len {} --threads 1 --log-every 1000",
          env, ranks > 1 ? dir + "trnrun --nproc-per-node 2 -- " : "", opt.trn_train, model_flags(c),
          cal.precision, ranks, batch, seq_len);
      const double measured = peak_rss_of(cmd);
      Layout l;
      l.dp = ranks;
      const double counted = predict(job, l, here).memory.total();
      if (!opt.quiet)
        fmt::print(stderr, "calibrate: {} peak RSS {:.0f} MB, {:.0f} MB of it the model's\n",
                   ranks > 1 ? (env[0] ? "2 ranks over tcp:" : "2 ranks over shm:") : "one process:",
                   measured / 1048576, counted / 1048576);
      return std::max(0.0, measured - counted);
    };
    cal.base_rss_single_bytes = base(1, "");
    cal.base_rss_bytes = base(2, "");
    cal.base_rss_network_bytes = base(2, "TRN_FABRIC_PROVIDER=tcp TRN_FABRIC_SHM=0");

    // Real steps: one process of the largest micro-batch measured (at most 16 sequences) alone,
    // twice, then one on each core at once (at most 8; independent processes: no communication),
    // against the pieces' prediction.
    char tmpl[] = "/tmp/trn-calibrate-XXXXXX";
    if (!mkdtemp(tmpl))
      throw usage_error("calibrate: cannot make a directory under /tmp: {}", std::strerror(errno));
    const std::string tmp = tmpl;
    struct Remove {
      std::string dir;
      ~Remove() {
        std::error_code ec;
        std::filesystem::remove_all(dir, ec);
      }
    } remove{tmp};
    int B = 1;
    while (B * 2 <= std::min(opt.max_batch, 16)) B *= 2;
    auto runs = [&](int n, const char* tag) {
      std::vector<std::string> cmds, files;
      for (int i = 0; i < n; ++i) {
        files.push_back(fmt::format("{}/{}{}.jsonl", tmp, tag, i));
        cmds.push_back(fmt::format(
            "OPENBLAS_NUM_THREADS=1 {} {} --precision {} --steps 8 --batch-size {} --seq-len {} --threads 1 "
            "--log-every 1000 --metrics-jsonl {}",
            opt.trn_train, model_flags(c), cal.precision, B, seq_len, files.back()));
      }
      return step_seconds_of(cmds, files);
    };
    const long cores = std::min(8L, std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
    // Means on both sides: the same estimator for the step alone and the steps at once.
    const double alone = (runs(1, "alone")[0] + runs(1, "again")[0]) / 2;
    double busy = 0;
    if (cores > 1) {
      const std::vector<double> all = runs(int(cores), "busy");
      for (double x : all) busy += x / double(all.size());
    }
    if (!(alone > 0)) throw usage_error("calibrate: a one-process trn-train step measured {} s", alone);
    job.global_batch = B;
    Layout one;
    const Prediction predicted_step = predict(job, one, here);
    const double predicted = predicted_step.step_s;
    // The scale is the compute's: the step's other terms (AdamW, the norm) are calibrated apart.
    const double compute = predicted_step.breakdown.compute, rest = predicted - compute;
    if (compute > 0 && alone > rest) cal.step_scale = (alone - rest) / compute;
    // Ranks running at once are never faster than one alone: a lower figure is the host's noise.
    cal.busy_scale = cores > 1 ? std::max(1.0, busy / alone) : 1.0;
    if (!opt.quiet)
      fmt::print(
          stderr,
          "calibrate: a one-process step of {} sequences: {:.1f} ms, the pieces' {:.1f} ms (x {:.3f}); "
          "{} at once: {:.1f} ms (x {:.3f})\n",
          B, alone * 1e3, predicted * 1e3, cal.step_scale, cores, busy * 1e3, cal.busy_scale);

    // Ranks of one job, and ZeRO-3 beside the compute: 2 ranks of --dp 2, plain and --zero 3,
    // alternating, twice each. The plain step against the plan's (its compute scaled to meet it:
    // ranks_scale), then the two steps' ratio against the plan's ratio of the same two on this
    // host's measured links (zero3_scale).
    if (cores > 1 && B >= 2) {
      auto dp2 = [&](const char* tag, bool zero3) {
        const std::string file = fmt::format("{}/{}.jsonl", tmp, tag);
        return step_seconds_of(
            {fmt::format("OPENBLAS_NUM_THREADS=1 {}trnrun --nproc-per-node 2 -- {} {} --precision {} "
                         "--dp 2{} --steps 8 --batch-size {} --seq-len {} --threads 1 "
                         "--log-every 1000 --metrics-jsonl {}",
                         dir, opt.trn_train, model_flags(c), cal.precision, zero3 ? " --zero 3" : "", B,
                         seq_len, file)},
            {file})[0];
      };
      double plain = dp2("dp", false), sharded = dp2("zero3", true);
      plain = (plain + dp2("dp-again", false)) / 2;
      sharded = (sharded + dp2("zero3-again", true)) / 2;
      Cluster host;
      host.local = true;
      host.cpu_cores = int(cores);
      host.links = CostModel{cal.intra, cal.inter};
      host.calibration = cal;
      Layout l0, l3;
      l0.dp = l3.dp = 2;
      l3.zero = 3;
      // Never below 1 either: ranks are never faster together than the pieces running at once.
      const Prediction q0 = predict(job, l0, host);
      const double rest = q0.step_s - q0.breakdown.compute;
      if (q0.breakdown.compute > 0 && plain > rest)
        cal.ranks_scale = std::max(1.0, (plain - rest) / q0.breakdown.compute);
      host.calibration = cal;
      const double p0 = predict(job, l0, host).step_s, p3 = predict(job, l3, host).step_s;
      // Never below 1: a ZeRO-3 step that measured faster relative to plain than the plan says is
      // the host's noise, not gathers that speed the compute up.
      if (plain > 0 && p0 > 0 && p3 > 0) cal.zero3_scale = std::max(1.0, (sharded / plain) / (p3 / p0));
      if (!opt.quiet)
        fmt::print(
            stderr,
            "calibrate: --dp 2 steps of {} sequences: {:.1f} ms (the plan's compute x {:.3f}), with --zero 3 "
            "{:.1f} ms (the plan: {:.1f} and {:.1f} ms; x {:.3f})\n",
            B, plain * 1e3, cal.ranks_scale, sharded * 1e3, p0 * 1e3, p3 * 1e3, cal.zero3_scale);
    }
  }
  return cal;
}

}  // namespace trn::plan
