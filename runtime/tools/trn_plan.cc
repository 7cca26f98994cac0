// trn-plan: which layout to run on a cluster, its step time and its memory per rank, before the
// job runs (runtime/plan/plan.h).
//
//   trn-plan [model flags] --cluster trn2.48xlarge:N|local:FILE --global-batch B --seq-len T
//            [--precision fp32|bf16] [--top K] [--json] [--layout "--dp 2 --tp 2 --cp 2 ..."]
//   trn-plan calibrate [model flags] --seq-len T [--precision] --out FILE
//   trn-plan probe-link [model flags] --seq-len T     (as 2 ranks; calibrate runs it)
//
// The model flags are trn-train's (--model, --arch, --n-layer, ...), read by its own parser.
// A search that finds no layout for the ranks, or none that fits, ends with one line and exit 2;
// one running past a second reports its progress on stderr; SIGINT/SIGTERM end it (128 + signal).
#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "collectives/core/stop_signal.h"
#include "collectives/core/error.h"
#include "collectives/core/flags.h"
#include "collectives/core/main.h"
#include "runtime/kernels/bf16.h"
#include "runtime/plan/calibrate.h"
#include "runtime/plan/cluster.h"
#include "runtime/plan/plan.h"
#include "runtime/train/options.h"

namespace {

using namespace trn;
using nlohmann::json;

struct Args {
  std::string cluster, layout, out, moe_loads;
  int global_batch = 0, top = 10, checkpoint_every = 0, snapshot_every = 0;
  int max_tp = 8, max_batch = 16, repeats = 3, max_cp = 0, max_ep = 0;
  bool json = false, behind = false;
  std::vector<std::string> positional;
};

// trn-train's flags that describe the job's model and batch; the rest of trn-train's flags
// mean nothing to a plan.
// The MoE shape flags are among them: calibrate's probe-link gets the model as Config::flags()
// spells it, a mixture of experts with its --n-experts, --top-k and --moe-norm-topk.
const std::set<std::string> kModelFlags = {"--model",   "--arch",       "--n-layer",  "--n-head",
                                           "--d-model", "--ctx",        "--vocab",    "--n-kv-head",
                                           "--ffn-dim", "--rope-theta", "--norm-eps", "--tie-embeddings",
                                           "--seq-len", "--precision",  "--threads",  "--bf16-kernels",
                                           "--n-experts", "--top-k",    "--moe-norm-topk",
                                           "--init-hf"};  // its config.json's shape; no weights are read

flags::Table table(Args* a) {
  return {
      .program = "trn-plan",
      .summary =
          "\nRanks the layouts of a job on a cluster by predicted step time, with each one's memory per "
          "rank\n"
          "and where its step goes; or predicts one --layout. The model flags are trn-train's (--model,\n"
          "--arch, --n-layer, --n-head, --d-model, --ctx, --vocab, --n-kv-head, --ffn-dim, --n-experts,\n"
          "--top-k, --moe-norm-topk, --seq-len, --precision, --threads; --init-hf DIR for a Hugging Face\n"
          "config.json's shape).\n"
          "  calibrate    time trn's kernels at the model's shapes on this machine and write a local\n"
          "               cluster file (--out) for --cluster local:FILE\n"
          "  probe-link   as one of 2 ranks (TRN_STORE_DIR, TRN_RANK, TRN_WORLD_SIZE=2): what a ring\n"
          "               all-reduce costs a step of the model, by size (calibrate runs it)\n",
      .flags =
          {
              {"--cluster", &a->cluster,
               "NAME:NODES (a file of deploy/clusters, e.g. trn2.48xlarge:64) or local:FILE", "Plan", "SPEC"},
              {"--global-batch", &a->global_batch, "sequences per step, global (trn-train's --batch-size)",
               "Plan", "B", nullptr, flags::Range::kPositive},
              {"--top", &a->top, "layouts listed", "Plan", "K", nullptr, flags::Range::kPositive},
              {"--layout", &a->layout, "predict this layout only (trn-train's layout flags)", "Plan",
               "\"FLAGS\""},
              {"--checkpoint-every", &a->checkpoint_every, "steps between checkpoints, charged to the step",
               "Plan", "N", "none", flags::Range::kNonNegative},
              {"--snapshot-every", &a->snapshot_every,
               "steps between in-memory snapshots, charged to the step", "Plan", "N", "none",
               flags::Range::kNonNegative},
              {"--max-cp", &a->max_cp,
               "the largest context-parallel size searched (1: none; a deep pipeline's simulation is long)",
               "Plan", "N", "every size with 1,024 tokens per rank or more", flags::Range::kPositive},
              {"--max-ep", &a->max_ep,
               "the largest expert-parallel size searched for a mixture of experts (1: none)", "Plan", "N",
               "every power of two dividing the replicas and the experts", flags::Range::kPositive},
              {"--moe-loads", &a->moe_loads,
               "a mixture of experts' routing as measured: a trn-train --metrics-jsonl file written with "
               "--metrics-moe-loads (any layout's); expert parallelism's busiest rank is waited for and its "
               "rows held",
               "Plan", "FILE", "balanced routing"},
              {"--json", &a->json, "machine-readable output", "Plan"},
              {"--out", &a->out, "calibrate: the local cluster file to write", "Calibrate", "FILE"},
              {"--max-tp", &a->max_tp, "calibrate: the largest tensor-parallel size measured", "Calibrate",
               "N", nullptr, flags::Range::kPositive},
              {"--max-batch", &a->max_batch,
               "calibrate: the largest micro-batch measured (powers of two up to it)", "Calibrate", "N",
               nullptr, flags::Range::kPositive},
              {"--repeats", &a->repeats, "calibrate: runs per measurement (the median counts)", "Calibrate",
               "N", nullptr, flags::Range::kPositive},
              {"--behind", &a->behind,
               "probe-link: each all-reduce runs behind the block forward (issued before it, waited for "
               "after) and its own time is measured",
               "Calibrate"},
          },
      .positional = flags::Positional::kInterleaved,
      .rest = &a->positional,
      .usage =
          "[model flags] --cluster SPEC --global-batch B --seq-len T [--top K] [--json] [--layout FLAGS]\n"
          "       trn-plan calibrate [model flags] --seq-len T [--precision P] --out FILE",
  };
}

std::vector<std::string> split_words(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

std::string gib(double bytes) { return fmt::format("{:.2f}", bytes / (1024.0 * 1024.0 * 1024.0)); }
std::string ms(double s) { return fmt::format("{:.1f}", s * 1e3); }

json to_json(const plan::Prediction& p, const plan::Prediction* best) {
  const plan::Breakdown& b = p.breakdown;
  const plan::Memory& m = p.memory;
  json j = {{"flags", p.layout.flags()},
            {"dp", p.layout.dp},
            {"tp", p.layout.tp},
            {"pp", p.layout.pp},
            {"cp", p.layout.cp},
            {"cp_comm", cp::to_string(p.layout.cp_comm)},
            {"ep", p.layout.ep},
            {"micro_batches", p.layout.micro_batches},
            {"schedule", pipeline::to_string(p.layout.schedule)},
            {"virtual_stages", p.layout.virtual_stages},
            {"zero", p.layout.zero},
            {"zero_prefetch", p.layout.prefetch},
            {"runs", p.runs},
            {"fits", p.fits},
            {"why", best ? plan::why_slower(p, *best) : p.why_not},
            {"timed", p.timed},
            {"step_s", p.timed ? json(p.step_s) : json(nullptr)},
            {"tokens_per_s", p.timed ? json(p.tokens_per_s()) : json(nullptr)},
            {"model_flops", p.model_flops},
            {"mfu", p.timed && p.mfu > 0 ? json(p.mfu) : json(nullptr)},
            {"shard_group", p.layout.dp_shard()},
            {"recompute", parallel::to_string(p.layout.recompute)},
            {"recompute_layers", p.layout.recompute_layers},
            {"breakdown",
             {{"compute_s", b.compute},
              {"tp_comm_s", b.tp_comm},
              {"cp_comm_s", b.cp_comm},
              {"ep_comm_s", b.ep_comm},
              {"bubble_s", b.bubble},
              {"pp_comm_s", b.pp_comm},
              {"dp_exposed_s", b.dp_exposed},
              {"optimizer_s", b.optimizer},
              {"checkpoint_s", b.checkpoint},
              {"dp_bytes", b.dp_bytes}}},
            {"memory",
             {{"weights", m.weights},
              {"gradients", m.gradients},
              {"optimizer", m.optimizer},
              {"bf16_copy", m.bf16_copy},
              {"activations", m.activations},
              {"buffers", m.buffers},
              {"base", m.base},
              {"total", m.total()}}},
            {"peak_rss_mib", m.total() / (1024.0 * 1024.0)}};
  return j;
}

// The first layout that runs and fits (the plan is sorted), or null.
const plan::Prediction* best_of(const std::vector<plan::Prediction>& ps) {
  for (const auto& p : ps)
    if (p.runs && p.fits) return &p;
  return nullptr;
}

void print_table(const std::vector<plan::Prediction>& ps, size_t top, const plan::Cluster& cl) {
  const bool device = cl.device_memory_bytes > 0;
  // MFU: the model's FLOPs over the ranks' peak matmul rate for the step (devices only).
  fmt::print("{:>3}  {:>9}  {:>10}{}  {:>8}  {:>8} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>6}  {}\n",
             "#", "step ms", "tokens/s", device ? fmt::format("  {:>5}", "MFU") : "",
             device ? "GiB/dev" : "GiB/rank", "compute", "tp", "cp", "ep", "bubble", "pp", "dp", "optim",
             "ckpt", "layout");
  const plan::Prediction* best = best_of(ps);
  size_t shown = 0;
  for (const auto& p : ps) {
    if (shown == top) break;
    if (!p.runs) continue;
    ++shown;
    const plan::Breakdown& b = p.breakdown;
    std::string why = !p.fits ? p.why_not : (best && &p != best ? plan::why_slower(p, *best) : "fastest");
    // A layout the search did not simulate (it does not fit) has no times: "-".
    auto t = [&](double s) { return p.timed ? ms(s) : std::string("-"); };
    const std::string mfu =
        !device ? "" : fmt::format("  {:>5}", p.timed ? fmt::format("{:.1f}%", 100 * p.mfu) : "-");
    fmt::print(
        "{:>3}  {:>9}  {:>10}{}  {:>8}  {:>8} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>6}  {}\n      "
        "{}\n",
        shown, t(p.step_s), p.timed ? fmt::format("{:.0f}", p.tokens_per_s()) : "-", mfu,
        gib(p.memory.total()), t(b.compute), t(b.tp_comm), t(b.cp_comm), t(b.ep_comm), t(b.bubble),
        t(b.pp_comm), t(b.dp_exposed), t(b.optimizer), t(b.checkpoint), p.layout.flags(), why);
  }
}

// SIGINT and SIGTERM end the search at the next layout (or within a simulation): one line, exit
// 128 + signal. A second signal ends the process at once (collectives/core/stop_signal.h).

// The search's hooks: the stop flag, and a progress line on stderr at most once a second once
// the search has run for a second.
plan::Search search_hooks() {
  plan::Search s;
  s.stop = [] { return stop_signal::received() != 0; };
  const auto start = std::chrono::steady_clock::now();
  auto last = std::make_shared<std::chrono::steady_clock::time_point>(start);
  s.progress = [start, last](size_t done, size_t total) {
    const auto now = std::chrono::steady_clock::now();
    if (now - *last < std::chrono::seconds(1)) return;
    *last = now;
    fmt::print(stderr, "trn-plan: {} of {} layouts evaluated in {:.0f} s\n", done, total,
               std::chrono::duration<double>(now - start).count());
  };
  return s;
}

// The one line for a search that found layouts but none that fits: the closest one's need.
std::string none_fits(const std::vector<plan::Prediction>& ps, const plan::Cluster& cl) {
  const plan::Prediction& least = ps.front();  // the plan ranks what does not fit by memory
  return fmt::format(
      "none of the {} layouts fits in a rank's memory ({} GiB): the least, {}, needs {} GiB; use more "
      "nodes, a shorter --seq-len or a smaller --global-batch",
      ps.size(), gib(cl.rank_memory(least.layout.world())), least.layout.flags(), gib(least.memory.total()));
}

int run(const std::vector<std::string>& argv, const char* self) {
  Args a;
  // trn-train's model and batch flags go to its parser; the rest are trn-plan's.
  std::vector<std::string> mine, model_args;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& w = argv[i];
    const std::string name = w.substr(0, w.find('='));
    if (kModelFlags.count(name)) {
      model_args.push_back(w);
      if (w.find('=') == std::string::npos && i + 1 < argv.size()) model_args.push_back(argv[++i]);
    } else {
      mine.push_back(w);
    }
  }
  if (!flags::parse(table(&a), mine)) return 0;
  const bool calibrating = !a.positional.empty() && a.positional[0] == "calibrate";
  const bool probing = !a.positional.empty() && a.positional[0] == "probe-link";
  if (!a.positional.empty() && !calibrating && !probing)
    throw usage_error("unknown command '{}': trn-plan calibrate, trn-plan probe-link, or flags only",
                      a.positional[0]);
  if (a.positional.size() > 1)
    throw usage_error("{} takes flags only, got '{}'", a.positional[0], a.positional[1]);

  train::Options base;
  std::vector<std::string> job_args = model_args;
  if (!calibrating && !probing) {
    if (a.global_batch == 0) throw usage_error("--global-batch is required (sequences per step)");
    job_args.insert(job_args.end(), {"--batch-size", std::to_string(a.global_batch)});
  }
  train::parse_options(job_args, &base);
  if (base.model.precision == model::Precision::kBf16)
    kernels::set_bf16_path(kernels::parse_bf16_path(base.bf16_kernels));

  if ((calibrating || probing) && !a.moe_loads.empty())
    throw usage_error("--moe-loads is a plan's (the routing it waits for): {} measures the machine",
                      calibrating ? "calibrate" : "probe-link");
  if (a.behind && !probing)
    throw usage_error("--behind is probe-link's (how it times an all-reduce), not {}",
                      calibrating ? "calibrate's" : "a plan's");
  if (probing) {
    plan::probe_link(base.model, base.seq_len, 20, a.behind);
    return 0;
  }
  if (calibrating) {
    if (a.out.empty()) throw usage_error("calibrate needs --out FILE (the local cluster file to write)");
    plan::CalibrateOptions co;
    co.max_tp = a.max_tp;
    co.max_batch = a.max_batch;
    co.repeats = a.repeats;
    char exe[4096];
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
      exe[n] = 0;
      co.prober = exe;
      std::string dir(exe);
      dir = dir.substr(0, dir.find_last_of('/') + 1);
      if (access((dir + "trn-train").c_str(), X_OK) == 0 && access((dir + "trnrun").c_str(), X_OK) == 0)
        co.trn_train = dir + "trn-train";
    }
    const plan::Calibration cal = plan::calibrate(base.model, base.seq_len, co);
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    const double memory = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
    plan::save_local_cluster(a.out, cal, int(cores), memory);
    fmt::print("wrote {} ({}, sequence length {}, {}; use --cluster local:{})\n", a.out, cal.model,
               cal.seq_len, cal.precision, a.out);
    return 0;
  }

  if (a.cluster.empty()) throw usage_error("--cluster is required: NAME:NODES or local:FILE");
  const plan::Cluster cl = plan::load_cluster(a.cluster, plan::clusters_dir(self));
  plan::Job job;
  job.model = base.model;
  job.global_batch = a.global_batch;
  job.seq_len = base.seq_len;
  job.threads = base.threads;
  job.checkpoint_every = a.checkpoint_every;
  job.snapshot_every = a.snapshot_every;
  if (!a.moe_loads.empty()) {
    if (!job.model.moe())
      throw usage_error("--moe-loads: the model has no experts (--arch {})", job.model.arch);
    job.moe_loads = plan::MoeLoads::read(a.moe_loads, job.model.n_layer, job.model.n_experts);
  }
  if (cl.local) {
    const plan::Calibration& cal = cl.calibration;
    model::Config c = job.model;
    if (cal.model != c.describe() || cal.seq_len != job.seq_len ||
        cal.precision != (c.precision == model::Precision::kBf16 ? "bf16" : "fp32"))
      throw usage_error(
          "{} was calibrated for {} at sequence length {} ({}), not this job's {} at {} ({}); run "
          "trn-plan calibrate for it",
          cl.source, cal.model, cal.seq_len, cal.precision, c.describe(), job.seq_len,
          c.precision == model::Precision::kBf16 ? "bf16" : "fp32");
  }

  const auto t0 = std::chrono::steady_clock::now();
  std::vector<plan::Prediction> ps;
  if (!a.layout.empty()) {
    std::vector<std::string> largs = job_args;
    for (const std::string& w : split_words(a.layout)) largs.push_back(w);
    train::Options lo;
    train::parse_options(largs, &lo);
    const int world = cl.world() > 0 ? cl.world() : lo.plan.world();
    if (!lo.dp_given) train::resolve_layout(&lo, world);
    // The fp8 wire's format is the cluster's unless the layout names one.
    if (!lo.flags_given.count("--fp8-format")) lo.plan.fp8_format = cl.fp8_format;
    ps.push_back(plan::predict(job, lo.plan, cl));
    if (!ps[0].runs) throw usage_error("--layout \"{}\": {}", a.layout, ps[0].why_not);
  } else {
    stop_signal::install();
    try {
      plan::Search s = search_hooks();
      s.max_cp = a.max_cp;
      s.max_ep = a.max_ep;
      ps = plan::plan(job, cl, s);
    } catch (const Error& e) {
      const int sig = stop_signal::received();
      if (e.kind() != ErrorKind::kAborted || sig == 0) throw;
      fmt::print(stderr, "trn-plan: stopped by {}: {}\n", sig == SIGINT ? "SIGINT" : "SIGTERM", e.what());
      return 128 + sig;
    }
  }
  const bool searched = a.layout.empty();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int ranks = cl.world() > 0 ? cl.world() : ps.empty() ? 0 : ps[0].layout.world();
  if (a.json) {
    json out = {{"model", job.model.describe()},
                {"precision", job.model.precision == model::Precision::kBf16 ? "bf16" : "fp32"},
                {"cluster", cl.name},
                {"nodes", cl.nodes},
                {"ranks", ranks},
                {"global_batch", job.global_batch},
                {"seq_len", job.seq_len},
                {"considered", ps.size()},
                {"plan_seconds", seconds},
                {"fp8_format", to_string(cl.fp8_format)},
                {"moe_loads", job.moe_loads.source},
                {"layouts", json::array()}};
    const plan::Prediction* best = best_of(ps);
    size_t shown = 0;
    for (const auto& p : ps) {
      if (shown++ == size_t(a.top)) break;
      out["layouts"].push_back(to_json(p, best && best != &p ? best : nullptr));
    }
    fmt::print("{}\n", out.dump(2));
    if (searched && !best) {
      std::fflush(stdout);  // the layouts, then the error line
      throw usage_error("{}", none_fits(ps, cl));
    }
    return 0;
  }
  fmt::print("{} {}, global batch {} x {} tokens, on {}{}: {} layouts considered in {:.2f} s\n",
             job.model.describe(), job.model.precision == model::Precision::kBf16 ? "bf16" : "fp32",
             job.global_batch, job.seq_len, cl.local ? "" : fmt::format("{} x ", cl.nodes),
             cl.local ? fmt::format("this machine ({} host(s))", cl.nodes) : cl.name, ps.size(), seconds);
  if (cl.world() > 0) fmt::print("{} ranks, {} per node\n", cl.world(), cl.ranks_per_node);
  if (!job.moe_loads.empty()) {
    std::string busiest;
    for (int ep = 2; ep <= job.model.n_experts; ep *= 2)
      if (job.model.n_experts % ep == 0)
        busiest += fmt::format("{}ep {}: {:.2f} ({:.2f} at the peak)", busiest.empty() ? "" : ", ", ep,
                               job.moe_loads.busiest(ep, false), job.moe_loads.busiest(ep, true));
    fmt::print("routing from {} ({} steps), the busiest ep rank's rows over the mean's: {}\n",
               job.moe_loads.source, job.moe_loads.steps.size(), busiest);
  }
  fmt::print("--grad-comm fp8 on this cluster: --fp8-format {} (E4M3, largest value {:g}){}\n",
             to_string(cl.fp8_format), e4m3_max(cl.fp8_format),
             cl.local ? "" : fmt::format(", from {}", cl.source));
  fmt::print(
      "times per step in ms; memory per rank in GiB (weights, gradients, AdamW, bf16 copy, activations, "
      "buffers{})\n\n",
      cl.local ? ", the process's base" : "");
  print_table(ps, size_t(a.top), cl);
  size_t wont_fit = 0;
  for (const auto& p : ps) wont_fit += p.runs && !p.fits;
  if (searched && wont_fit == ps.size()) {
    std::fflush(stdout);  // the table, then the error line
    throw usage_error("{}", none_fits(ps, cl));
  }
  if (wont_fit) fmt::print("\n{} of {} layouts do not fit in a rank's memory\n", wont_fit, ps.size());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return trn::run_main("trn-plan",
                       [&] { return run(std::vector<std::string>(argv + 1, argv + argc), argv[0]); });
}
