#include "runtime/train/trainer.h"

#include <cblas.h>
#include <fmt/format.h>

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>

#include "collectives/communicator.h"
#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "collectives/core/settings.h"
#include "runtime/checkpoint/checkpoint.h"
#include "runtime/io/atomic_file.h"
#include "runtime/io/safetensors.h"
#include "runtime/kernels/bf16.h"
#include "runtime/parallel/gather.h"
#include "runtime/pipeline_parallel/pipeline.h"
#include "runtime/train/zero_sync.h"
#include "runtime/util/trace.h"

namespace trn::train {
namespace {

using log::Subsys;

std::string format_eta(double seconds) {
  const long s = std::lround(std::max(0.0, seconds));
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60);
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

// Rank 0's s on every rank of comm (null: alone).
void share(const std::shared_ptr<Communicator>& comm, std::string& s) {
  if (!comm) return;
  int64_t n = int64_t(s.size());
  comm->broadcast(&n, 1, DataType::kI64, 0)->wait();
  s.resize(size_t(n));
  if (n > 0) comm->broadcast(s.data(), s.size(), DataType::kU8, 0)->wait();
}

// Runs fn on rank 0 only (a decision about shared files) and throws whatever it threw, with its
// kind, on every rank of comm, so no rank waits in a later collective for one that left.
void on_rank0(const std::shared_ptr<Communicator>& comm, bool rank0, const std::function<void()>& fn) {
  std::string error;
  int64_t kind = -1;
  if (rank0) {
    try {
      fn();
    } catch (const Error& e) {
      error = e.what();
      kind = int64_t(e.kind());
    } catch (const std::exception& e) {
      error = e.what();
      kind = int64_t(ErrorKind::kInternal);
    }
  }
  if (comm) comm->broadcast(&kind, 1, DataType::kI64, 0)->wait();
  share(comm, error);
  if (kind >= 0) throw Error(ErrorKind(kind), error);
}

std::string random_run_id() {
  uint64_t x = 0;
  if (std::FILE* f = std::fopen("/dev/urandom", "rb")) {
    if (std::fread(&x, sizeof x, 1, f) != 1) x = 0;
    std::fclose(f);
  }
  if (x == 0)
    x = uint64_t(std::chrono::system_clock::now().time_since_epoch().count()) ^ (uint64_t(getpid()) << 32);
  return fmt::format("{:016x}", x);
}

// The settings a resume must match (checkpoint::State::settings), as this run has them.
std::vector<std::pair<std::string, std::string>> resume_settings(const Options& o) {
  return {{"--batch-size", fmt::format("{}", o.batch_size)},
          {"--seq-len", fmt::format("{}", o.seq_len)},
          {"--steps", fmt::format("{}", o.steps)},
          {"--lr", fmt::format("{}", o.lr)},
          {"--lr-schedule", o.schedule == optim::Schedule::Kind::kConstant ? "constant" : "cosine"},
          {"--warmup-steps", fmt::format("{}", o.warmup_steps)},
          {"--min-lr", o.min_lr < 0 ? std::string("lr/10") : fmt::format("{}", o.min_lr)},
          {"--weight-decay", fmt::format("{}", o.weight_decay)},
          {"--beta1", fmt::format("{}", o.beta1)},
          {"--beta2", fmt::format("{}", o.beta2)},
          {"--grad-clip", fmt::format("{}", o.grad_clip)},
          {"--seed", fmt::format("{}", o.seed)}};
}

}  // namespace

Trainer::Trainer(const Options& opt, const parallel::ProcessGrid* grid, GradientSync* sync)
    : opt_(opt), grid_(grid), sync_(sync) {
  const parallel::GridShape shape{opt_.dp, opt_.tp, opt_.pp};
  parallel::check_layout(shape, grid_ ? grid_->shape().world() : 1);
  if (grid_ && !(grid_->shape().dp == shape.dp && grid_->shape().tp == shape.tp && grid_->shape().pp == shape.pp))
    throw internal_error("trainer options {} differ from the grid {}", shape.describe(), grid_->shape().describe());
  if ((sync_ ? sync_->size() : 1) != opt_.dp)
    throw internal_error("a data-parallel sync of {} ranks for --dp {}", sync_ ? sync_->size() : 1, opt_.dp);
  zero_ = sync_ ? sync_->zero() : nullptr;
  model::check_tensor_parallel(opt_.model, opt_.tp);
  // The bf16 kernels are chosen before anything runs (a bad --bf16-kernels is a usage error).
  if (opt_.model.precision == model::Precision::kBf16) kernels::set_bf16_path(kernels::parse_bf16_path(opt_.bf16_kernels));
  const parallel::Coords me = grid_ ? grid_->coords() : parallel::Coords{};
  dp_rank_ = me.dp;
  rank0_ = !grid_ || grid_->rank() == 0;
  // Every output path is checked before step 1, so a bad one never costs a run.
  if (rank0_) {
    if (!opt_.save.empty()) io::check_writable("--save", opt_.save);
    if (!opt_.metrics_jsonl.empty()) io::check_writable("--metrics-jsonl", opt_.metrics_jsonl);
    if (!opt_.dump_batches.empty()) io::check_writable("--dump-batches", opt_.dump_batches);
  }
  if (!opt_.trace.empty()) {
    const auto at = opt_.trace.find("{rank}");
    const bool per_rank = at != std::string::npos;
    if (per_rank || rank0_)
      io::check_writable("--trace", per_rank ? std::string(opt_.trace).replace(at, 6, std::to_string(grid_ ? grid_->rank() : 0))
                                             : opt_.trace);
  }
  if (!opt_.init.empty()) io::check_readable_file("--init", opt_.init);
  if (!opt_.checkpoint_dir.empty()) open_checkpoint_dir();
  check_memory(me.tp);
  tokens_ = opt_.data.empty() ? data::Tokens::builtin() : data::Tokens::load(opt_.data, opt_.model.vocab);
  if (opt_.data.empty() && opt_.model.vocab < 256)
    throw usage_error("the built-in corpus is bytes and needs --vocab 256 or more (got {})",
                      opt_.model.vocab);
  sampler_ = std::make_unique<data::Sampler>(tokens_, opt_.seq_len, opt_.seed);
  const int local_batch = opt_.batch_size / opt_.dp / opt_.micro_batches;
  // The compute threads split the batch; OpenBLAS stays on one thread per call unless there are
  // more threads than sequences to split.
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  if (cores > 0 && opt_.threads > cores)
    log::warn(Subsys::kTrain, "--threads {} is more than the {} processors here: compute threads will share cores",
              opt_.threads, cores);
  if (opt_.pp == 1 && opt_.threads > local_batch)
    log::warn(Subsys::kTrain,
              "--threads {}: each rank's micro-batch has {} sequences, so {} compute threads split it "
              "(OpenBLAS gets the rest)",
              opt_.threads, local_batch, local_batch);
  if (opt_.pp > 1) {
    // A pipeline stage: one compute thread runs the schedule; OpenBLAS and the optimizer's
    // loops get the threads.
    openblas_set_num_threads(std::max(1, opt_.threads));
    if (opt_.tp > 1) {
      regions_.push_back(std::make_unique<tp::CommRegion>(grid_->tp()));
    }
    pipe_ = std::make_unique<pipeline::PipelineModel>(
        opt_.model, pipeline::parse_kind(opt_.pipeline_schedule),
        pipeline::Shape{opt_.pp, opt_.micro_batches, opt_.virtual_stages}, me.pp, opt_.tp, me.tp, local_batch,
        opt_.seq_len, opt_.threads, regions_.empty() ? nullptr : regions_[0].get(), grid_->pp());
    pipe_->init(opt_.seed);
  } else {
    const int model_threads = model::Gpt::threads_for(std::min(opt_.threads, local_batch), local_batch);
    openblas_set_num_threads(std::max(1, opt_.threads / model_threads));
    model::Placement placement;
    placement.tp = opt_.tp;
    placement.tp_rank = me.tp;
    std::vector<tp::Region*> regions;
    if (opt_.tp > 1) {
      // Thread 0 uses the grid's tp communicator; every further thread a split of its own, so the
      // k-th threads of the tp ranks pair up in one issue order.
      for (int k = 0; k < model_threads; ++k) {
        auto comm = k == 0 ? grid_->tp() : grid_->tp()->split(0, grid_->tp()->rank());
        regions_.push_back(std::make_unique<tp::CommRegion>(comm));
        regions.push_back(regions_.back().get());
      }
    }
    model_ = std::make_unique<model::Gpt>(opt_.model, local_batch, opt_.seq_len, model_threads, placement, regions);
    model_->init(opt_.seed);
  }
  if (!opt_.init.empty()) io::load_gpt2(opt_.init, layout(), params());
  const optim::AdamWConfig adamw_cfg{opt_.beta1, opt_.beta2, 1e-8f, opt_.weight_decay};
  if (zero_) {
    TRN_CHECK(zero_->plan().size() == num_params());
    adamw_ = std::make_unique<optim::AdamW>(layout(), adamw_cfg, zero_->owned());
  } else {
    adamw_ = std::make_unique<optim::AdamW>(layout(), adamw_cfg);
  }
  schedule_ = optim::Schedule{opt_.schedule, opt_.lr, opt_.min_lr, opt_.warmup_steps, opt_.steps};
  resume_from_checkpoint();
  if (!opt_.checkpoint_dir.empty() && grid_ && grid_->world()) ckpt_comm_ = grid_->world()->split(0, grid_->rank());
  inputs_.resize(size_t(local_batch) * opt_.seq_len);
  targets_.resize(inputs_.size());
  if (rank0_ && !opt_.dump_batches.empty()) dump_batches(opt_.dump_batches);
  if (rank0_ && !opt_.metrics_jsonl.empty()) {
    metrics_ = std::fopen(opt_.metrics_jsonl.c_str(), next_step_ > 0 ? "a" : "w");  // a resumed run appends
    if (!metrics_)
      throw usage_error("cannot write --metrics-jsonl {}: {}", opt_.metrics_jsonl,
                        std::strerror(errno));
  }
  log::info(Subsys::kTrain, "optimizer state: {} bytes on this rank (AdamW m and v of {} of its {} parameters{})",
            adamw_->state_bytes(), adamw_->state_bytes() / (2 * sizeof(float)), num_params(),
            zero_ ? fmt::format("; ZeRO-1 over {} data-parallel ranks", opt_.dp) : "");
  log::info(Subsys::kTrain, "model {} ({}), {} parameters on this rank, {:.1f} MB activations",
            opt_.model_name, opt_.model.describe(), num_params(),
            (pipe_ ? pipe_->activation_bytes() : model_->activation_bytes()) / 1e6);
  if (opt_.model.precision == model::Precision::kBf16)
    log::info(Subsys::kTrain, "precision bf16: {}; fp32 master weights and AdamW state, a {:.1f} MB bf16 weight copy{}",
              kernels::bf16_kernel_description(),
              (pipe_ ? pipe_->bf16_weight_bytes() : model_->bf16_weight_bytes()) / 1e6,
              kernels::bf16_path() == kernels::Bf16Path::kEmulated ? " (held widened to fp32, read by sgemm in place)"
                                                                   : "");
  else
    log::info(Subsys::kTrain, "precision fp32: CPU features: {}; fp32 matmuls through cblas_sgemm", kernels::cpu_features());
  log::info(Subsys::kTrain,
            "data {} ({} tokens), batch {} x {} tokens (dp {}, tp {}, pp {}{}, micro-batches {}), {} threads",
            tokens_.source(), tokens_.size(), opt_.batch_size, opt_.seq_len, opt_.dp, opt_.tp, opt_.pp,
            opt_.pp > 1 ? fmt::format(" {}{}", opt_.pipeline_schedule,
                                      opt_.virtual_stages > 1 ? fmt::format(" x {} chunks", opt_.virtual_stages) : "")
                        : "",
            opt_.micro_batches, pipe_ ? opt_.threads : model_->threads());
}

Trainer::~Trainer() {
  // Only an error leaves a save in flight here: it is aborted rather than left to wait out its
  // deadline for ranks that are leaving too.
  if (saver_.joinable() && !save_done_.load() && ckpt_comm_) ckpt_comm_->abort("the trainer is stopping on an error");
  if (saver_.joinable()) saver_.join();
  if (metrics_) std::fclose(metrics_);
}

void Trainer::dump_batches(const std::string& path) const {
  const int B = opt_.batch_size, T = opt_.seq_len;
  std::vector<int32_t> out(size_t(opt_.steps) * B * (T + 1));
  std::vector<int32_t> in(size_t(B) * T), tg(size_t(B) * T);
  for (int64_t s = 0; s < opt_.steps; ++s) {
    sampler_->fill(s, 0, B, in.data(), tg.data());
    for (int b = 0; b < B; ++b) {
      int32_t* row = out.data() + (size_t(s) * B + b) * (T + 1);
      std::memcpy(row, in.data() + size_t(b) * T, sizeof(int32_t) * T);
      row[T] = tg[size_t(b) * T + T - 1];
    }
  }
  io::write_file_atomic(path, std::string_view(reinterpret_cast<const char*>(out.data()),
                                               out.size() * sizeof(int32_t)));
}

void Trainer::check_memory(int tp_rank) const {
  const int local_batch = opt_.batch_size / opt_.dp / opt_.micro_batches;  // sequences per micro-batch
  const pipeline::Shape shape{opt_.pp, opt_.micro_batches, opt_.virtual_stages};
  // AdamW's moments are 2 floats per parameter, or per owned parameter under ZeRO-1.
  const double moments = 2.0 / (opt_.zero ? opt_.dp : 1);
  // The pipeline's message buffers.
  const double N = double(local_batch) * opt_.seq_len, C = opt_.model.d_model;
  const double buffers = opt_.pp > 1 ? 4.0 * 4.0 * opt_.virtual_stages * opt_.micro_batches * N * C : 0.0;
  // Per pipeline rank (the one that needs the most counts): parameters, gradients and AdamW's
  // moments, plus the activation slots and scratch its stages hold, as they count them.
  double need = 0;
  for (int r = 0; r < opt_.pp; ++r) {
    model::Placement placement{opt_.tp, tp_rank, {}};
    std::vector<int> slots{1};
    if (opt_.pp > 1) {
      placement.chunks = pipeline::chunks_of(opt_.model, shape, r);
      slots = pipeline::plan_slots(pipeline::parse_kind(opt_.pipeline_schedule), r, shape).slots_needed;
    }
    const model::ParamLayout lay(opt_.model, placement);
    double activations = 0;
    for (size_t c = 0; c < slots.size(); ++c)
      activations += double(model::Stage<float>::activation_bytes(lay, local_batch, opt_.seq_len, slots[c], int(c)));
    need = std::max(need, 4.0 * (2.0 + moments) * double(lay.total()) + activations + buffers);
  }
  const double have = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
  if (have > 0 && need > have)
    throw usage_error("{} with micro-batches of {} x {} needs about {:.1f} GB per rank (weights, gradients, AdamW "
                      "state, activations) but this host has {:.1f} GB; use a smaller model or batch, "
                      "more --micro-batches{}, or shard it with --tp or --pp",
                      opt_.model.describe(), local_batch, opt_.seq_len, need / 1e9, have / 1e9,
                      opt_.pp > 1 ? " under --schedule 1f1b" : "");
}

StepStats Trainer::step() {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t s = next_step_++;
  trace::Span step_span("step", "step", {{"step", s + 1}});
  const int mb_batch = opt_.batch_size / opt_.dp / opt_.micro_batches;
  const int first = dp_rank_ * (opt_.batch_size / opt_.dp);
  const float scale = 1.0f / float(size_t(mb_batch) * opt_.micro_batches * opt_.seq_len);
  double loss = 0.0;
  if (pipe_) {
    pipe_->zero_grad();
    model::GradReadyFn ready;
    if (sync_) ready = [&](size_t b, size_t e) { sync_->grads_ready(grads(), b, e); };
    auto fill = [&](int mb, int32_t* in, int32_t* tg) { sampler_->fill(s, first + mb * mb_batch, mb_batch, in, tg); };
    loss = pipe_->step(fill, scale, ready);
    if (sync_) sync_->finish(grads(), num_params());
    // The tied wte: the first stage's copy took the embedding's gradient, the last stage's the
    // head's; both need the sum.
    if (const model::TensorSpec* tied = layout().tied(); tied && grid_->embedding()) {
      trace::Span span("embedding all-reduce", "pp");
      const model::TensorSpec& wte = *tied;
      if (!zero_) {
        grid_->embedding()->all_reduce(grads() + wte.offset, grads() + wte.offset, wte.numel, DataType::kF32,
                                       ReduceOp::kSum)->wait();
      } else {
        // Only this rank's slices hold the data-parallel mean; the other stage slices wte alike
        // (its buckets start and end at wte), so the sum goes slice by slice.
        std::vector<WorkPtr> works;
        for (const optim::Range& r : zero_->owned()) {
          const size_t b = std::max(r.begin, wte.offset), e = std::min(r.end, wte.offset + wte.numel);
          if (b < e)
            works.push_back(grid_->embedding()->all_reduce(grads() + b, grads() + b, e - b, DataType::kF32, ReduceOp::kSum));
        }
        for (auto& w : works) w->wait();
      }
    }
    // The loss lives on the last stage.
    grid_->pp()->all_reduce(&loss, &loss, 1, DataType::kF64, ReduceOp::kSum)->wait();
    loss /= double(mb_batch) * opt_.micro_batches * opt_.seq_len;
    if (sync_) loss = sync_->mean(loss);
  } else {
    model::Gpt& m = *model_;
    m.zero_grad();
    for (int mb = 0; mb < opt_.micro_batches; ++mb) {
      sampler_->fill(s, first + mb * mb_batch, mb_batch, inputs_.data(), targets_.data());
      model::GradReadyFn ready;
      if (sync_ && mb + 1 == opt_.micro_batches)
        ready = [&](size_t b, size_t e) { sync_->grads_ready(m.grads(), b, e); };
      trace::Span span("forward + backward", "compute", {{"mb", mb}});
      loss += m.forward_backward(inputs_.data(), targets_.data(), scale, ready);
    }
    loss /= opt_.micro_batches;
    if (sync_) {
      sync_->finish(m.grads(), m.num_params());
      loss = sync_->mean(loss);
    }
  }
  StepStats st;
  st.step = s + 1;
  st.loss = loss;
  {
    trace::Span span("gradient norm", "optimizer");
    st.grad_norm = global_grad_norm();
  }
  if (!std::isfinite(st.loss) || !std::isfinite(st.grad_norm))
    throw usage_error("step {}: the {} is {}: training diverged, so it stops before the optimizer "
                      "writes non-finite weights (nothing is saved); lower --lr, raise --warmup-steps or "
                      "check --init",
                      st.step, std::isfinite(st.loss) ? "gradient norm" : "loss",
                      std::isfinite(st.loss) ? st.grad_norm : st.loss);
  st.lr = schedule_.at(s);
  update(st.grad_norm, st.lr);
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  elapsed_s_ += dt;
  st.elapsed_s = elapsed_s_;
  st.tokens_per_s = double(opt_.batch_size) * opt_.seq_len / dt;
  return st;
}

void Trainer::update(double grad_norm, float lr) {
  ThreadPool& pool = this->pool();
  trace::Span span("optimizer", "optimizer");
  if (!zero_) {
    optim::clip_to_norm(grads(), num_params(), grad_norm, opt_.grad_clip, pool);
    adamw_->step(params(), grads(), lr, pool);
    return;
  }
  for (const optim::Range& r : zero_->owned()) optim::clip_to_norm(grads() + r.begin, r.size(), grad_norm, opt_.grad_clip, pool);
  adamw_->step(params(), grads(), lr, pool);
  zero_->gather_params(params());
}

double Trainer::global_grad_norm() {
  if (zero_) {
    // The same piece sums, added in the same order, as below: only the averaged shard is here.
    double local = zero_->pieces().combine(zero_->piece_sums(grads(), pool()));
    if (opt_.tp > 1 || opt_.pp > 1)
      grid_->model_parallel()->all_reduce(&local, &local, 1, DataType::kF64, ReduceOp::kSum)->wait();
    return std::sqrt(local);
  }
  if (opt_.tp == 1 && opt_.pp == 1) return std::sqrt(optim::sum_of_squares(grads(), num_params(), pool()));
  // Each tensor's sum of squares, in buffer order, counting every global element once: a tensor
  // replicated over the tp group on tp rank 0 only, the tied wte on the first stage only (after
  // the embedding group's sum both copies hold the same gradient). Then the sum over the model-
  // parallel group (every tp and pp rank of this data-parallel replica).
  const bool replicas = grid_->coords().tp == 0, embedding_copy = grid_->coords().pp == 0;
  double local = 0.0;
  for (const model::TensorSpec& t : layout().tensors()) {
    if (t.replicated() && !replicas) continue;
    if (t.tied && !embedding_copy) continue;
    local += optim::sum_of_squares(grads() + t.offset, t.numel, pool());
  }
  grid_->model_parallel()->all_reduce(&local, &local, 1, DataType::kF64, ReduceOp::kSum)->wait();
  return std::sqrt(local);
}

double Trainer::tp_seconds() const { return regions_.empty() ? 0.0 : regions_[0]->seconds(); }

void Trainer::write_metrics(const StepStats& s) {
  if (!metrics_) return;
  const std::string line = fmt::format(
      "{{\"step\": {}, \"loss\": {:.9g}, \"lr\": {:.9g}, \"grad_norm\": {:.9g}, "
      "\"tokens_per_s\": {:.1f}, \"elapsed_s\": {:.6f}{}}}\n",
      s.step, s.loss, s.lr, s.grad_norm, s.tokens_per_s, s.elapsed_s,
      s.checkpoint_blocked_s >= 0 ? fmt::format(", \"checkpoint_blocked_s\": {:.6f}", s.checkpoint_blocked_s) : "");
  // A line that cannot be written whole (a full disk) stops the run: metrics are part of its
  // result, and a cut line would break every reader of the file.
  if (std::fwrite(line.data(), 1, line.size(), metrics_) != line.size() || std::fflush(metrics_) != 0)
    throw usage_error("cannot write --metrics-jsonl {} at step {}: {}", opt_.metrics_jsonl, s.step,
                      std::strerror(errno));
}

void Trainer::write_metrics_line(const std::string& json) {
  if (!metrics_) return;
  const std::string line = json + "\n";
  if (std::fwrite(line.data(), 1, line.size(), metrics_) != line.size() || std::fflush(metrics_) != 0)
    throw usage_error("cannot write --metrics-jsonl {}: {}", opt_.metrics_jsonl, std::strerror(errno));
}

void Trainer::run() {
  double window_s = 0.0;
  int64_t window_steps = 0;
  while (next_step_ < opt_.steps) {
    check_checkpoint(false);  // a failed background save stops the run at the next step
    if (stop_requested && stop_requested()) {
      wait_for_checkpoint();  // a save in flight is finished, not abandoned half-written
      throw Stopped{next_step_, committed_step_, committed_dir_};
    }
    const double before = elapsed_s_;
    StepStats s = step();
    window_s += s.elapsed_s - before;
    ++window_steps;
    if (on_step) on_step(s);
    if (!opt_.checkpoint_dir.empty() &&
        ((opt_.checkpoint_every > 0 && s.step % opt_.checkpoint_every == 0) || s.step == opt_.steps))
      s.checkpoint_blocked_s = save_checkpoint();
    if (rank0_) write_metrics(s);
    if (rank0_ && (s.step % opt_.log_every == 0 || s.step == opt_.steps || s.step == 1)) {
      const double tps = double(opt_.batch_size) * opt_.seq_len * window_steps / window_s;
      const double eta = (opt_.steps - s.step) * window_s / window_steps;
      log::info(Subsys::kTrain,
                "step {}/{} | loss {:.4f} | lr {:.2e} | grad norm {:.3f} | {:.0f} tok/s | ETA {}",
                s.step, opt_.steps, s.loss, s.lr, s.grad_norm, tps, format_eta(eta));
      window_s = 0.0;
      window_steps = 0;
    }
  }
  wait_for_checkpoint();  // the last one is committed before the run ends
  if (dp_rank_ == 0 && !opt_.save.empty()) {
    save(opt_.save);
    if (rank0_) log::info(Subsys::kTrain, "saved weights to {}", opt_.save);
  }
}

double Trainer::save_checkpoint() {
  trace::Span span("checkpoint (blocking part)", "checkpoint", {{"step", next_step_}});
  const auto t0 = std::chrono::steady_clock::now();
  wait_for_checkpoint();
  // The snapshot: what the background writer saves while training goes on (under ZeRO-1 the
  // parameters this rank owns, beside their moments).
  if (zero_) {
    snap_p_.clear();
    for (const optim::Range& r : zero_->owned()) snap_p_.insert(snap_p_.end(), params() + r.begin, params() + r.end);
  } else {
    snap_p_.assign(params(), params() + num_params());
  }
  snap_m_ = adamw_->m();
  snap_v_ = adamw_->v();
  const checkpoint::State st{next_step_, adamw_->steps_taken(), opt_.seed, run_id_, resume_settings(opt_)};
  const checkpoint::Layout lo{opt_.dp, opt_.tp, opt_.pp, opt_.virtual_stages};
  const parallel::Coords me = grid_ ? grid_->coords() : parallel::Coords{};
  save_done_ = false;
  saver_ = std::thread([this, st, lo, me] {
    try {
      trace::Span write("checkpoint (background write)", "checkpoint", {{"step", st.step}});
      const auto w0 = std::chrono::steady_clock::now();
      const std::string dir = checkpoint::save(opt_.checkpoint_dir, st, lo, layout(), snap_p_.data(), snap_m_.data(),
                                               snap_v_.data(), me, ckpt_comm_, opt_.keep_checkpoints, report_shard,
                                               zero_ ? &zero_->owned() : nullptr);
      committed_step_ = st.step;
      committed_dir_ = dir;
      if (rank0_)
        log::info(Subsys::kTrain, "checkpoint of step {} committed to {} ({:.0f} ms in the background)", st.step, dir,
                  1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count());
    } catch (...) {
      save_error_ = std::current_exception();
    }
    save_done_.store(true, std::memory_order_release);
  });
  const double blocked = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (rank0_) log::info(Subsys::kTrain, "step {} blocked {:.1f} ms for its checkpoint", next_step_, blocked * 1e3);
  return blocked;
}

void Trainer::check_checkpoint(bool wait) {
  if (!saver_.joinable()) return;  // alike on every rank: all start and join their saves together
  const std::shared_ptr<Communicator> world = grid_ ? grid_->world() : nullptr;
  const int size = world ? world->size() : 1, rank = world ? world->rank() : 0;
  auto nap = std::chrono::milliseconds(1);
  for (;;) {
    // {the lowest rank whose save failed, as size - rank (0: none), whether any save still runs}
    const bool done = save_done_.load(std::memory_order_acquire);
    const bool failed = done && save_error_;
    int32_t agreed[2] = {failed ? size - rank : 0, done ? 0 : 1};
    if (world) world->all_reduce(agreed, agreed, 2, DataType::kI32, ReduceOp::kMax)->wait();
    if (agreed[0] == 0 && agreed[1] == 0) {
      saver_.join();
      return;
    }
    if (agreed[0] != 0) {
      const int root = size - agreed[0];
      // The failing rank's error goes to every rank, so each stops with the save's own message.
      char msg[1024] = {};
      int32_t kind = static_cast<int32_t>(ErrorKind::kInternal);
      if (rank == root) {
        std::string what = "unknown error";
        try {
          std::rethrow_exception(save_error_);
        } catch (const Error& e) {
          what = e.what();
          kind = static_cast<int32_t>(e.kind());
        } catch (const std::exception& e) {
          what = e.what();
        }
        std::memcpy(msg, what.data(), std::min(what.size(), sizeof msg - 1));
      }
      if (world) {
        world->broadcast(msg, sizeof msg, DataType::kU8, root)->wait();
        world->broadcast(&kind, 1, DataType::kI32, root)->wait();
        // Once every rank has the message, the saves still blocked on the failed rank are
        // aborted; a peer's abort may fail this barrier, which changes nothing now.
        try {
          world->barrier()->wait();
        } catch (const Error&) {
        }
        if (!save_done_.load() && ckpt_comm_) ckpt_comm_->abort("a checkpoint save failed on another rank");
      }
      saver_.join();
      if (failed) std::rethrow_exception(std::exchange(save_error_, nullptr));
      save_error_ = nullptr;
      throw Error(static_cast<ErrorKind>(kind), fmt::format("{} (the checkpoint save on rank {})", msg, root));
    }
    if (!wait) return;
    std::this_thread::sleep_for(nap);
    nap = std::min(2 * nap, std::chrono::milliseconds(20));
  }
}

void Trainer::open_checkpoint_dir() {
  io::make_writable_dir("--checkpoint-dir", opt_.checkpoint_dir);
  const auto& world = grid_ ? grid_->world() : nullptr;
  on_rank0(world, rank0_, [&] {
    const char* env = std::getenv("TRN_RUN_ID");
    run_id_ = env && *env ? env : random_run_id();
    dir_lock_ = std::make_unique<checkpoint::DirLock>(opt_.checkpoint_dir, run_id_);
  });
  share(world, run_id_);
}

void Trainer::resume_from_checkpoint() {
  // A worker that trnrun restarted (a generation after the first) resumes the newest checkpoint
  // of its own run; without one it does what the first generation did, except that it never
  // refuses (--resume never: a fresh start). Rank 0 chooses and every rank loads its choice, so
  // the ranks agree even while the directory changes under them.
  const bool restarted = settings::is_set("TRN_GENERATION") && settings::get_int("TRN_GENERATION") > 0;
  const std::string& dir = opt_.checkpoint_dir;
  std::string path;
  const auto& world = grid_ ? grid_->world() : nullptr;
  on_rank0(world, rank0_, [&] {
    if (restarted && !dir.empty()) path = checkpoint::latest(dir, &run_id_).value_or("");
    if (!path.empty()) {
    } else if (opt_.resume == "never") {
      // A first start never writes beside another run's checkpoints: its saves would prune them
      // and a later --resume auto would mix the two runs. Nothing is moved or deleted.
      if (!restarted && !dir.empty())
        if (const auto other = checkpoint::newest_committed(dir))
          throw usage_error("--resume never, but --checkpoint-dir {} already holds committed checkpoints (the newest: "
                            "{}); use --resume auto to continue it, or an empty directory",
                            dir, *other);
    } else if (opt_.resume == "auto") {
      if (!dir.empty()) path = checkpoint::latest(dir).value_or("");
    } else {
      checkpoint::verify(opt_.resume);  // a bad explicit checkpoint is an error, not a fallback
      path = opt_.resume;
    }
  });
  share(world, path);
  if (path.empty()) return;
  const auto t0 = std::chrono::steady_clock::now();
  const checkpoint::State st =
      checkpoint::load(path, layout(), params(), adamw_->mutable_m().data(), adamw_->mutable_v().data(),
                       zero_ ? &zero_->owned() : nullptr);
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Settings that change what the resumed steps compute (batch, data, schedule, optimizer) must
  // match the checkpoint's unless the run says it means it.
  const auto mine = resume_settings(opt_);
  std::vector<std::string> was, now;
  for (const auto& [flag, value] : st.settings)
    for (const auto& [f, v] : mine)
      if (f == flag && v != value) {
        was.push_back(flag + " " + value);
        now.push_back(f + " " + v);
      }
  auto join = [](const std::vector<std::string>& parts) {
    std::string out;
    for (size_t i = 0; i < parts.size(); ++i) out += (i == 0 ? "" : i + 1 == parts.size() ? " and " : ", ") + parts[i];
    return out;
  };
  if (!was.empty() && !opt_.allow_changed_settings)
    throw usage_error("checkpoint {} was saved with {}, this run has {}: pass the checkpoint's values to continue it, "
                      "or --allow-changed-settings to resume with this run's",
                      path, join(was), join(now));
  if (rank0_)
    for (size_t i = 0; i < was.size(); ++i)
      log::warn(Subsys::kTrain, "resuming {} with {} (it was saved with {}): --allow-changed-settings", path, now[i],
                was[i]);
  if (st.step > opt_.steps && !opt_.allow_changed_settings)
    throw usage_error("checkpoint {} is at step {}, past --steps {}: raise --steps or resume an earlier checkpoint", path,
                      st.step, opt_.steps);
  next_step_ = st.step;
  adamw_->set_steps_taken(st.optimizer_step);
  if (!rank0_) return;
  if (st.step >= opt_.steps)
    log::info(Subsys::kTrain, "checkpoint {} is at step {} of --steps {}: training is already complete, nothing to do",
              path, st.step, opt_.steps);
  else
    log::info(Subsys::kTrain, "resumed from {} at step {} (loaded in {:.0f} ms)", path, st.step, load_s * 1e3);
}

void Trainer::save(const std::string& path) const {
  const std::map<std::string, std::string> meta{{"trn.model", opt_.model.describe()},
                                                {"trn.steps", std::to_string(next_step_)}};
  if (layout().whole()) {
    if (rank0_) io::save_gpt2(path, layout(), params(), meta);
    return;
  }
  const std::vector<float> full = parallel::gather_whole(layout(), params(), grid_->coords(), grid_->model_parallel());
  if (rank0_) io::save_gpt2(path, model::ParamLayout(opt_.model), full.data(), meta);
}

}  // namespace trn::train
