#include "runtime/dist/train_main.h"

#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstring>
#include <vector>

#include "collectives/core/stop_signal.h"
#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include <algorithm>
#include <chrono>

#include "runtime/model/config.h"
#include "runtime/parallel/grid.h"
#include "runtime/parallel/plan.h"
#include "runtime/io/atomic_file.h"
#include "runtime/util/trace.h"
#include "runtime/pipeline_parallel/schedule.h"
#include "runtime/train/grad_sync.h"
#include "runtime/train/metrics.h"
#include "runtime/dist/world.h"
#include "runtime/train/snapshot.h"
#include "runtime/train/trainer.h"

namespace trn::dist {
namespace {

using log::Subsys;

// FNV-1a over the parameter bytes: equal on every rank when the weights are bit-identical.
uint64_t fingerprint(const float* p, size_t n) {
  const auto* b = reinterpret_cast<const unsigned char*>(p);
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n * sizeof(float); ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

// Every member of comm holds bit-identical params (what: "data-parallel replicas").
void check_weights_identical(Communicator& comm, const char* what, const float* params, size_t n) {
  const uint64_t mine = fingerprint(params, n);
  std::vector<uint64_t> all(comm.size());
  comm.all_gather(&mine, all.data(), 1, DataType::kI64)->wait();
  for (int r = 0; r < comm.size(); ++r)
    if (all[r] != all[0])
      throw internal_error("{} diverged: rank 0 of the group has weights {:016x}, rank {} {:016x}", what, all[0], r,
                           all[r]);
  log::info(Subsys::kTrain, "final weights identical on all {} {} (fingerprint {:016x})", comm.size(), what, all[0]);
}

// Seconds one blocking all-reduce of n gradients takes here (median of 5): the communication
// the overlap has to hide.
double measure_allreduce_s(Communicator& comm, size_t n) {
  std::vector<float> buf(n, 1.0f);
  std::vector<double> times;
  for (int i = 0; i < 5; ++i) {
    comm.barrier()->wait();
    const auto t0 = std::chrono::steady_clock::now();
    comm.all_reduce(buf.data(), buf.data(), n, DataType::kF32, ReduceOp::kAvg)->wait();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// SIGINT and SIGTERM (collectives/core/stop_signal.h) stop a running trainer at the next step
// boundary, or the next batch of an evaluation (Trainer::stop_requested; one line, exit 128 +
// signal); a second one ends the process at once. Stops are deferred only while a trainer runs:
// outside it (start-up: data loading and hashing, the model's build, a checkpoint or snapshot
// restore; a recovery's rejoin) nothing would read the flag for as long as those take, and none
// of them writes anything a signal could leave half-done, so a signal there ends the process at
// once, by that signal. Installed after the fabric is up, replacing any handler a libfabric
// provider installed.

// Each stage's measured bubble (the share of its step spent waiting for a neighbouring stage)
// beside the theory, on rank 0's log and as the last line of --metrics-jsonl.
void report_bubble(const parallel::ProcessGrid& grid, const parallel::Plan& plan, double mine, train::Trainer& trainer) {
  std::vector<double> all(plan.pp);
  grid.pp()->all_gather(&mine, all.data(), 1, DataType::kF64)->wait();
  const double theory = pipeline::theoretical_bubble(plan.schedule, plan.pipeline());
  if (grid.rank() != 0) return;
  std::string text, json;
  for (int s = 0; s < plan.pp; ++s) {
    text += fmt::format("{}{:.1f}%", s ? " " : "", 100 * all[s]);
    json += fmt::format("{}{:.6f}", s ? ", " : "", all[s]);
  }
  const char* schedule = pipeline::to_string(plan.schedule);
  log::info(Subsys::kTrain, "pipeline: {} over {} stages{}, {} micro-batches: bubble per stage {} (theory {:.1f}%)",
            schedule, plan.pp, plan.virtual_stages > 1 ? fmt::format(" x {} chunks", plan.virtual_stages) : "",
            plan.micro_batches, text, 100 * theory);
  trainer.write_metrics_line(fmt::format("{{\"pipeline\": \"{}\", \"stages\": {}, \"virtual_stages\": {}, "
                                         "\"micro_batches\": {}, \"bubble\": [{}], \"bubble_theory\": {:.6f}}}",
                                         schedule, plan.pp, plan.virtual_stages, plan.micro_batches, json, theory));
}

// Writes the --trace timeline: each rank's own file when the name holds {rank}, otherwise rank 0
// gathers every rank's events over the world communicator into one file.
void write_trace(const train::Options& opt, const World& world, const parallel::ProcessGrid& grid) {
  const parallel::Coords c = grid.coords();
  std::string mine = fmt::format(
      "{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{},\"args\":{{\"name\":\"rank {} (dp {}, tp {}, pp {})\"}}}}",
      world.rank(), world.rank(), c.dp, c.tp, c.pp);
  const std::string events = trace::events_json();
  if (!events.empty()) mine += ",\n" + events;
  const auto at = opt.trace.find("{rank}");
  if (at != std::string::npos) {
    io::write_file_atomic(std::string(opt.trace).replace(at, 6, std::to_string(world.rank())),
                          "{\"traceEvents\": [\n" + mine + "\n]}\n");
    return;
  }
  std::string all = mine;
  if (const auto& comm = world.comm()) {
    const int64_t len = int64_t(mine.size());
    std::vector<int64_t> lens(comm->size());
    comm->all_gather(&len, lens.data(), 1, DataType::kI64)->wait();
    if (comm->rank() == 0) {
      for (int r = 1; r < comm->size(); ++r) {
        std::string part(size_t(lens[r]), '\0');
        comm->recv(part.data(), part.size(), DataType::kU8, r)->wait();
        all += ",\n" + part;
      }
    } else {
      comm->send(mine.data(), mine.size(), DataType::kU8, 0)->wait();
      return;
    }
  }
  io::write_file_atomic(opt.trace, "{\"traceEvents\": [\n" + all + "\n]}\n");
  log::info(Subsys::kTrain, "wrote the timeline of {} rank(s) to {}", world.size(), opt.trace);
}

int64_t unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The accounting of in-place recoveries and of goodput. A surviving rank notes when it saw the
// failure and when its node joined the next generation; once the new generation restored its
// state every rank agrees on those times (the earliest failure seen, the latest re-join) and on
// the steps lost (the newest step any survivor had completed, minus the step restored), and rank
// 0 reports them at the first step the new generation completes: in its log and as a
// {"recovery": ...} line of --metrics-jsonl. Goodput is the time of the steps the final run kept
// (a repeated step counts once) over the wall time since the process started.
class Recovery {
 public:
  void failed(const std::string& why, int64_t generation) {
    failed_ms_ = unix_ms();
    log::warn(Subsys::kTrain, "generation {} failed ({}); recovering in place", generation, why);
  }
  void rejoined(int64_t generation) {
    rejoined_ms_ = unix_ms();
    log::info(Subsys::kTrain, "rebuilt the fabric in generation {} in {} ms", generation, rejoined_ms_ - failed_ms_);
  }
  // Collective over the world: every rank of a generation, survivors and replacements alike, so
  // the counts, the start time and the kept steps' times are the job's, not this process's.
  void restored(int64_t step, const std::shared_ptr<Communicator>& world, bool rank0) {
    last_elapsed_ = 0;
    if (!world) return;
    const bool survivor = failed_ms_ > 0;
    int64_t lo[3] = {survivor ? failed_ms_ : INT64_MAX, start_ms_, 0};  // earliest failure, start
    int64_t hi[5] = {survivor ? rejoined_ms_ : 0, completed_, count_, lost_total_, survivor ? 0 : 1};
    world->all_reduce(lo, lo, 2, DataType::kI64, ReduceOp::kMin)->wait();
    world->all_reduce(hi, hi, 4, DataType::kI64, ReduceOp::kMax)->wait();
    world->all_reduce(hi + 4, hi + 4, 1, DataType::kI64, ReduceOp::kSum)->wait();
    // The kept steps' times: a replaced process has none of them, a survivor all.
    step_s_.resize(size_t(step), 0.0);
    if (step > 0) world->all_reduce(step_s_.data(), step_s_.data(), size_t(step), DataType::kF64, ReduceOp::kMax)->wait();
    start_ms_ = lo[1];
    failed_ms_ = rejoined_ms_ = 0;
    count_ = int(hi[2]);
    lost_total_ = hi[3];
    if (lo[0] == INT64_MAX) return;  // a first start: nobody failed
    pending_ = rank0;
    ++count_;
    detect_ms_ = lo[0];
    rejoin_ms_ = hi[0];
    restored_ms_ = unix_ms();
    restored_step_ = step;
    lost_ = std::max<int64_t>(0, hi[1] - step);
    lost_total_ += lost_;
    replaced_ = hi[4];
  }
  void step_done(int64_t step, double elapsed_s, train::Trainer* trainer, World& world) {
    if (step_s_.size() < size_t(step)) step_s_.resize(size_t(step), 0.0);
    step_s_[size_t(step) - 1] = elapsed_s - last_elapsed_;
    last_elapsed_ = elapsed_s;
    completed_ = std::max(completed_, step);
    if (!pending_) return;
    pending_ = false;
    const int64_t now = unix_ms();
    log::info(Subsys::kTrain,
              "recovery {}: failure seen at {} (unix ms); new generation {:.2f} s later, state of step {} restored "
              "at {:.2f} s, step {} done at {:.2f} s; {} step{} lost, {} process{} replaced",
              count_, detect_ms_, (rejoin_ms_ - detect_ms_) / 1e3, restored_step_,
              (restored_ms_ - detect_ms_) / 1e3, step, (now - detect_ms_) / 1e3, lost_, lost_ == 1 ? "" : "s",
              replaced_, replaced_ == 1 ? "" : "es");
    last_first_step_s_ = (now - detect_ms_) / 1e3;
    world.report_recovery(report());
    trainer->write_metrics_line(fmt::format(
        "{{\"recovery\": {}, \"failed_unix_ms\": {}, \"generation_s\": {:.3f}, \"restored_s\": {:.3f}, "
        "\"first_step_s\": {:.3f}, \"restored_step\": {}, \"steps_lost\": {}, \"replaced\": {}}}",
        count_, detect_ms_, (rejoin_ms_ - detect_ms_) / 1e3, (restored_ms_ - detect_ms_) / 1e3,
        (now - detect_ms_) / 1e3, restored_step_, lost_, replaced_));
  }
  // What the coordinator shows (trnctl status, /metrics): the newest recovery and the totals.
  control::RecoveryReport report() const {
    control::RecoveryReport r;
    r.recoveries = count_;
    r.detect_to_generation_s = (rejoin_ms_ - detect_ms_) / 1e3;
    r.detect_to_restored_s = (restored_ms_ - detect_ms_) / 1e3;
    r.detect_to_first_step_s = last_first_step_s_;
    r.restored_step = restored_step_;
    r.steps_lost = lost_;
    r.steps_lost_total = lost_total_;
    r.replaced = replaced_;
    r.goodput = goodput();
    return r;
  }
  // Seconds of the kept steps over the wall seconds since the job started.
  double goodput() const {
    double useful = 0;
    for (double s : step_s_) useful += s;
    const double wall = (unix_ms() - start_ms_) / 1e3;
    return wall > 0 ? std::min(1.0, useful / wall) : -1;
  }
  void summary(train::Trainer& trainer, World& world, bool in_place) const {
    if (!in_place && count_ == 0) return;
    double useful = 0;
    for (double s : step_s_) useful += s;
    const double wall = (unix_ms() - start_ms_) / 1e3;
    if (in_place) world.report_recovery(report());  // with the final goodput
    log::info(Subsys::kTrain, "goodput {:.1f}%: {:.2f} s of kept steps in {:.2f} s since start; {} recover{} in place, "
                              "{} step{} lost",
              100 * useful / wall, useful, wall, count_, count_ == 1 ? "y" : "ies", lost_total_,
              lost_total_ == 1 ? "" : "s");
    if (in_place)
      trainer.write_metrics_line(fmt::format("{{\"goodput\": {:.6f}, \"useful_s\": {:.3f}, \"wall_s\": {:.3f}, "
                                           "\"recoveries\": {}, \"steps_lost\": {}}}",
                                           useful / wall, useful, wall, count_, lost_total_));
  }

 private:
  int64_t start_ms_ = unix_ms();  // the job's: the earliest start of any of its processes
  int count_ = 0;                  // recoveries so far, job-wide
  int64_t failed_ms_ = 0, rejoined_ms_ = 0;
  bool pending_ = false;
  int64_t detect_ms_ = 0, rejoin_ms_ = 0, restored_ms_ = 0, restored_step_ = 0, lost_ = 0, lost_total_ = 0,
          replaced_ = 0, completed_ = 0;
  double last_elapsed_ = 0;
  double last_first_step_s_ = 0;
  std::vector<double> step_s_;
};

// One generation's training: the trainer over this generation's grid, restoring from in-memory
// snapshots when it recovers, then the end-of-run checks and reports. Returns the exit code.
int run_generation(const train::Options& opt, World& world, const parallel::ProcessGrid& grid,
                   train::Snapshots* snaps, Recovery& rec) {
  int stop_signal = 0;  // agreed by every rank (below)
  try {
    train::Trainer::RestoreFn restore;
    if (snaps)
      restore = [&](model::LocalModel& m, optim::Optimizer& o) {
        // Expert ranks hold different experts: like ZeRO's shards, no replica mirrors another's state.
        snaps->attach(grid, opt.plan.sharded() || opt.plan.ep > 1, m, o);
        // Go on from no step past the metrics' last line: rank 0 writes a step's line before its
        // snapshot, but a replica may have finished a step whose collective then failed on rank 0.
        const int64_t bound =
            world.rank() == 0 && !opt.metrics_jsonl.empty() ? train::last_metrics_step(opt.metrics_jsonl) : -1;
        return snaps->restore(m, o, bound);
      };
    train::Trainer trainer(opt, &grid, restore);
    rec.restored(trainer.next_step(), world.comm(), world.rank() == 0);
    // Every rank stops at the same step boundary: the ranks agree on the signal (the largest
    // any of them got), so none starts a step the others will not run.
    trainer.stop_requested = [&] {
      int32_t sig = trn::stop_signal::received();
      if (world.comm()) world.comm()->all_reduce(&sig, &sig, 1, DataType::kI32, ReduceOp::kMax)->wait();
      stop_signal = sig;
      return sig != 0;
    };
    trainer.report_shard = [&](int64_t step, const std::string& path, uint64_t bytes) {
      world.report_shard(step, path, bytes);
    };
    trainer.on_step = [&](const train::StepStats& s) {
      if (s.val_loss >= 0) world.report_validation(s.val_loss);
      if (s.aux_loss >= 0)
        world.report_moe(control::MoeReport{s.aux_loss, s.moe_max_mean,
                                            std::vector<int32_t>(s.moe_dead.begin(), s.moe_dead.end()),
                                            s.moe_dropped});
      world.report_progress(s.step, s.loss, s.tokens_per_s);
      rec.step_done(s.step, s.elapsed_s, &trainer, world);
    };
    if (snaps)
      trainer.on_state = [&](int64_t step, const model::LocalModel& m, const optim::Optimizer& o) {
        snaps->take(step, m, o);
      };
    // Armed only once stop_requested is wired; disarmed when this generation's trainer is gone.
    struct Armed {
      Armed() { trn::stop_signal::set_deferred(true); }
      ~Armed() { trn::stop_signal::set_deferred(false); }
    } armed;
    trainer.run();
    // The peak of the training itself, before the checks below gather anything.
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    const auto& m = trainer;
    // Under ZeRO-3 the data-parallel ranks hold different shards by design: the checks read the
    // whole buffer they gather (collective over the data-parallel group).
    const bool weights_sharded = m.model().sharded() != nullptr;
    const std::vector<float> gathered = weights_sharded ? m.model().whole_params() : std::vector<float>{};
    const float* params = weights_sharded ? gathered.data() : m.params();
    if (grid.dp() && !weights_sharded && opt.plan.ep == 1)
      check_weights_identical(*grid.dp(), "data-parallel replicas", params, m.num_params());
    if (grid.dp() && opt.plan.ep > 1) {
      // Expert parallelism: the experts' tensors agree over the replicas holding them, the rest
      // over every replica.
      std::vector<float> dense, experts;
      for (const auto& t : m.layout().tensors())
        (t.expert ? experts : dense).insert((t.expert ? experts : dense).end(), params + t.offset,
                                            params + t.offset + t.numel);
      check_weights_identical(*grid.dp(), "data-parallel replicas' non-expert tensors", dense.data(), dense.size());
      if (trainer.expert_replicas())
        check_weights_identical(*trainer.expert_replicas(), "replicas of the same experts", experts.data(),
                                experts.size());
    }
    if (grid.tp()) {
      // Replicated tensors (LayerNorms, row-parallel biases, wpe) must stay equal on every shard.
      std::vector<float> replicated;
      for (const auto& t : m.layout().tensors())
        if (t.replicated()) replicated.insert(replicated.end(), params + t.offset, params + t.offset + t.numel);
      check_weights_identical(*grid.tp(), "tensor-parallel ranks' replicated tensors", replicated.data(),
                              replicated.size());
    }
    if (const model::TensorSpec* tied = m.layout().tied(); tied && grid.embedding()) {
      const auto& wte = *tied;
      check_weights_identical(*grid.embedding(), "copies of the tied wte (first and last stage)",
                              params + wte.offset, wte.numel);
    }
    if (opt.plan.pp > 1) report_bubble(grid, opt.plan, trainer.model().pipeline_wait_share(), trainer);
    if (!opt.trace.empty()) write_trace(opt, world, grid);
    log::info(Subsys::kTrain, "peak RSS {:.0f} MB", ru.ru_maxrss / 1024.0);
    // Beside the setup's count: the MoE layer's activations and scratch grow past it when an
    // expert (or, under ep, a rank's experts) gets more rows than a balanced load.
    log::info(Subsys::kTrain, "activations held at the end: {:.1f} MB", trainer.model().activation_bytes() / 1e6);
    // A model-parallel group's communication as a share of the run's step time, and per step.
    auto share = [&](const std::string& what, double seconds) {
      const double step_s = trainer.elapsed_s();
      log::info(Subsys::kTrain, "{} took {:.1f}% of the step time ({:.2f} ms per step)", what,
                step_s > 0 ? 100.0 * seconds / step_s : 0.0, opt.steps ? 1e3 * seconds / double(opt.steps) : 0.0);
    };
    if (grid.tp() && world.rank() == 0)
      share(fmt::format("tensor parallel: {} ranks per shard group; TP all-reduces", opt.plan.tp), trainer.tp_seconds());
    if (opt.plan.ep > 1 && world.rank() == 0)
      share(fmt::format("expert parallel: {} ranks per expert group; the MoE all-to-alls", opt.plan.ep),
            trainer.ep_seconds());
    if (grid.cp()) {
      // Every rank says its own: the attention work per cp rank is the balance check.
      const train::Trainer::CpStats cs = trainer.cp_stats();
      log::info(Subsys::kTrain,
                "context parallel: cp rank {} of {}: {:.4g} attention products (query row x key, per head, "
                "forward and backward); its exchange's messages took {:.2f} ms per step to arrive (summed) and "
                "attention waited {:.2f} ms per step for them ({:.0f}% hidden behind attention)",
                grid.coords().cp, opt.plan.cp, cs.products, opt.steps ? 1e3 * cs.in_flight_s / double(opt.steps) : 0.0,
                opt.steps ? 1e3 * cs.exposed_s / double(opt.steps) : 0.0,
                cs.in_flight_s > 0 ? 100.0 * (1.0 - cs.exposed_s / cs.in_flight_s) : 0.0);
    }
    if (train::GradientSync* sync = trainer.sync()) {
      const double comm_s = measure_allreduce_s(*grid.dp(), m.num_params());
      const bool zero = opt.plan.sharded();
      const train::GradientSync::Stats& st = sync->stats();
      const double waited = st.steps ? st.exposed_s / double(st.steps) : 0.0;
      const double hidden = st.reduced ? double(st.reduced_in_backward) / double(st.reduced) : 0.0;
      if (world.rank() == 0)
        log::info(Subsys::kTrain,
                  "data parallel{}: {} ranks, {} buckets of {} MiB ({}); {:.0f}% of gradients were {} "
                  "before backward ended; after backward the step waited {:.2f} ms for the rest and for "
                  "slower ranks (one blocking f32 all-reduce of all gradients: {:.2f} ms)",
                  zero ? fmt::format(" (ZeRO-{})", opt.plan.zero_stage()) : "", opt.plan.replicas(),
                  sync->num_buckets(), opt.plan.bucket_mb,
                  opt.plan.grad_wire == parallel::GradWire::kFP8
                      ? fmt::format("fp8 {}", to_string(opt.plan.fp8_format))
                      : std::string(parallel::to_string(opt.plan.grad_wire)),
                  hidden * 100, zero ? "reduce-scattered" : "all-reduced", waited * 1e3, comm_s * 1e3);
    }
    if (const model::ShardedWeights* sw = m.model().sharded(); sw && world.rank() == 0 && m.steps_run() > 0) {
      // Counts per step over the run; times over the steps after the first (restart_timing).
      const model::ShardedWeights::Stats& gs = sw->stats();
      const double steps = double(m.steps_run()), timed = double(std::max<int64_t>(1, m.steps_run() - 1));
      log::info(Subsys::kTrain,
                "ZeRO-3: {:.0f} weight gathers per step ({:.1f} MB), {} ahead; {:.0f}% of gather time hidden behind "
                "compute; compute waited {:.2f} ms per step for gathers to arrive",
                double(gs.gathers) / steps, gs.bytes / 1e6 / steps, opt.plan.prefetch, 100.0 * gs.hidden(),
                1e3 * gs.exposed_s / timed);
    }
    if (snaps && world.rank() == 0 && snaps->taken() > 0)
      log::info(Subsys::kTrain,
                "snapshots: {} taken; each blocked the step {:.2f} ms ({:.2f}% of the mean step) and sent {:.1f} MB "
                "to a buddy",
                snaps->taken(), 1e3 * snaps->blocked_s() / double(snaps->taken()),
                trainer.elapsed_s() > 0 ? 100.0 * snaps->blocked_s() / trainer.elapsed_s() : 0.0,
                snaps->bytes_sent() / 1e6 / double(snaps->taken()));
    if (world.rank() == 0) rec.summary(trainer, world, world.recovers_in_place());
    // Nobody leaves while a peer may still be finishing its part of the last collective: over
    // tcp a rank whose receive completed can exit before its own acknowledgement of the peer's
    // send went out, and the peer, its send still pending, would take the exit for a loss.
    if (world.comm()) world.comm()->barrier()->wait();
  } catch (const train::Trainer::Stopped& s) {
    const int sig = std::max(stop_signal, 1);
    if (s.checkpoint_step >= 0)
      fmt::print(stderr, "trn-train: stopped by {} after step {} of {}; the checkpoint of step {} is committed in {}\n",
                 strsignal(sig), s.steps_done, opt.steps, s.checkpoint_step, s.checkpoint_dir);
    else
      fmt::print(stderr, "trn-train: stopped by {} after step {} of {}; nothing saved{}\n", strsignal(sig),
                 s.steps_done, opt.steps,
                 opt.checkpoint_dir.empty() ? " (no --checkpoint-dir)" : " (no checkpoint was due yet in this run)");
    return 128 + sig;
  }
  return 0;
}

}  // namespace

int train_main(const train::Options& options) {
  // The layout is checked against the job's size before any rank connects: each rank computes
  // the same verdict from its flags and the launcher's world size, so on a bad layout every
  // rank prints the one line and exits, and no rank is left in a collective (the world
  // communicator's start-up agreement, MPI_Finalize) waiting for ranks that already left.
  train::Options opt = options;
  const launch::WorkerIdentity id = launch::identity_from_environment();
  const int world_size = id.world_size;
  train::resolve_layout(&opt, world_size, id.local_world_size);
  parallel::GridShape shape = opt.plan.grid();
  parallel::check_layout(shape, world_size);
  auto world = World::from_environment();
  trn::stop_signal::install(/*deferred=*/false);
  if (!opt.trace.empty()) trace::enable(world->rank());
  if (world->rank() == 0)
    for (const std::string& w : train::ignored_flags(opt)) log::warn(Subsys::kTrain, "{}", w);
  if (world->rank() == 0 && world->recovers_in_place() && opt.snapshot_every == 0)
    log::warn(Subsys::kTrain, "trnrun --recovery in-place without --snapshot-every: a recovered generation resumes "
                              "from the newest checkpoint (or step 0), not from memory");
  // Snapshots cost a copy and a buddy exchange each (about two steps' time on the tiny model),
  // and only an in-place recovery ever reads them.
  if (world->rank() == 0 && opt.snapshot_every > 0 && !world->recovers_in_place())
    log::warn(Subsys::kTrain, "--snapshot-every {} without trnrun --recovery in-place (TRN_RECOVERY=in-place): "
                              "nothing restores from the snapshots, which still cost their copies; run under "
                              "trnrun --recovery in-place or drop the flag",
              opt.snapshot_every);
  std::unique_ptr<train::Snapshots> snaps;
  if (opt.snapshot_every > 0) snaps = std::make_unique<train::Snapshots>(opt.snapshot_every);
  Recovery rec;
  while (true) {
    opt.generation = world->generation();
    std::string failure;
    try {
      parallel::ProcessGrid grid(world->comm(), shape);
      // The heartbeat's dp coordinate is the rank's replica (dp x cp): with (tp, pp) it names the rank.
      world->set_coordinates(grid.shape().replica(grid.coords()), grid.coords().tp, grid.coords().pp);
      try {
        return run_generation(opt, *world, grid, snaps.get(), rec);
      } catch (...) {
        if (snaps) snaps->detach();  // before the grid's communicators go
        throw;
      }
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kUsage && !world->told_to_stop()) world->report_failure(e.what());
      if (!world->recovers_in_place() || !recoverable(e)) throw;
      failure = e.what();
    }
    // In place: this process goes on in the next generation, its trainer and grid already gone.
    rec.failed(failure, world->generation());
    world->abort("recovering in place");
    world->rejoin();
    rec.rejoined(world->generation());
    if (world->size() != shape.world()) {
      // An elastic job went on with other nodes: the data-parallel size follows the world (the
      // global batch stays), as a restarted generation's would.
      const int was = opt.plan.dp;
      train::resolve_layout(&opt, world->size(), id.local_world_size);
      shape = opt.plan.grid();
      parallel::check_layout(shape, world->size());
      if (world->rank() == 0)
        log::info(Subsys::kTrain, "the job has {} workers now: data parallel {} -> {}, the global batch stays {}",
                  world->size(), was, opt.plan.dp, opt.batch_size);
    }
  }
}

}  // namespace trn::dist
