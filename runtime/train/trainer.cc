#include "runtime/train/trainer.h"

#include "runtime/context_parallel/attention.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "collectives/communicator.h"
#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "runtime/io/atomic_file.h"
#include "runtime/io/hf_dir.h"
#include "runtime/io/safetensors.h"
#include "runtime/kernels/bf16.h"
#include "runtime/kernels/kernels.h"
#include "runtime/kernels/moe.h"
#include "runtime/parallel/gather.h"
#include "runtime/util/trace.h"

namespace trn::train {
namespace {

using log::Subsys;

// Mixed into --seed for the validation sampler, so held-out batches are not drawn in training's
// order (a constant: the same for every run and layout with that seed).
constexpr uint64_t kValidationSeed = 0x76616c6964617465ull;  // "validate"

std::string format_eta(double seconds) {
  const long s = std::lround(std::max(0.0, seconds));
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60);
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

// The log line's MoE part: the balancing loss, the least balanced layer's max/mean tokens per
// expert, the dead experts over all layers, the dropped choices.
std::string moe_summary(const StepStats& s) {
  if (s.aux_loss < 0) return "";
  size_t worst = 0;
  int dead = 0;
  for (size_t l = 0; l < s.moe_max_mean.size(); ++l) {
    if (s.moe_max_mean[l] > s.moe_max_mean[worst]) worst = l;
    dead += s.moe_dead[l];
  }
  return fmt::format(" | aux loss {:.4f} | experts max/mean {:.2f} (layer {}), {} dead{}", s.aux_loss,
                     s.moe_max_mean.empty() ? 0.0 : s.moe_max_mean[worst], worst, dead,
                     s.moe_dropped > 0 ? fmt::format(", {:.0f} dropped", s.moe_dropped) : "");
}

}  // namespace

Trainer::Trainer(const Options& opt, const parallel::ProcessGrid* grid, const RestoreFn& restore)
    : opt_(opt), grid_(grid) {
  check_options(opt_, grid_);
  const parallel::Coords me = grid_ ? grid_->coords() : parallel::Coords{};
  dp_rank_ = me.dp;
  replica_ = me.dp * opt_.plan.cp + me.cp;
  rank0_ = !grid_ || grid_->rank() == 0;
  check_output_paths();
  checkpoints_ = std::make_unique<Checkpointer>(opt_, grid_);
  check_memory(opt_, me.tp);
  tokens_ = opt_.data.empty() ? data::Tokens::builtin() : data::Tokens::load(opt_.data, opt_.model.vocab);
  if (opt_.data.empty() && opt_.model.vocab < 256)
    throw usage_error("the built-in corpus is bytes and needs --vocab 256 or more (got {})",
                      opt_.model.vocab);
  sampler_ = std::make_unique<data::Sampler>(tokens_, opt_.seq_len, opt_.seed);
  if (!opt_.val_data.empty()) {
    // A shard directory's val-* shards (trn-data tokenize's held-out documents), or any format
    // --data takes.
    val_tokens_ = data::Tokens::load(opt_.val_data, opt_.model.vocab, "--val-data", "val");
    val_sampler_ = std::make_unique<data::Sampler>(val_tokens_, opt_.seq_len, opt_.seed ^ kValidationSeed);
    clamp_eval_batches();
  }
  parts_ = build(opt_, grid_);
  schedule_ = optim::Schedule{opt_.schedule, opt_.lr, opt_.min_lr, opt_.warmup_steps, opt_.steps};
  const std::optional<int64_t> restored = restore ? restore(*parts_.model, *parts_.optimizer) : std::nullopt;
  next_step_ = restored ? checkpoints_->resumed_at(*restored) : checkpoints_->resume(*parts_.model, *parts_.optimizer);
  if (rank0_ && !opt_.dump_batches.empty()) dump_batches(opt_.dump_batches);
  if (!opt_.dump_logits.empty()) dump_logits();
  if (rank0_ && !opt_.metrics_jsonl.empty()) metrics_ = MetricsFile(opt_.metrics_jsonl, next_step_ > 0);  // a resumed run appends
  log_setup();
}

Trainer::~Trainer() = default;

void Trainer::check_output_paths() const {
  // Every output path is checked before step 1, so a bad one never costs a run.
  if (rank0_) {
    if (!opt_.save.empty()) io::check_writable("--save", opt_.save);
    if (!opt_.save_hf.empty()) io::check_hf_output("--save-hf", opt_.save_hf);
    if (!opt_.metrics_jsonl.empty()) io::check_writable("--metrics-jsonl", opt_.metrics_jsonl);
    if (!opt_.dump_batches.empty()) io::check_writable("--dump-batches", opt_.dump_batches);
    if (!opt_.dump_logits.empty()) io::check_writable("--dump-logits", opt_.dump_logits);
  }
  if (!opt_.trace.empty()) {
    const auto at = opt_.trace.find("{rank}");
    const bool per_rank = at != std::string::npos;
    if (per_rank || rank0_)
      io::check_writable("--trace", per_rank ? std::string(opt_.trace).replace(at, 6, std::to_string(grid_ ? grid_->rank() : 0))
                                             : opt_.trace);
  }
  if (!opt_.init.empty()) io::check_readable_file("--init", opt_.init);
}

// --eval-batches is at most the global batches --val-data holds (its tokens over batch x
// seq_len, at least 1). A validation is a pass over held-out data, as torchtitan's ends at the
// end of its validation set whatever its step count: more batches than the set holds would
// only draw the same tokens again, so a larger count is clamped, with one warning, rather than
// refused or run without bound.
void Trainer::clamp_eval_batches() {
  const size_t per_batch = size_t(opt_.batch_size) * size_t(opt_.seq_len);
  const size_t held = std::max<size_t>(1, val_tokens_.size() / per_batch);
  if (size_t(opt_.eval_batches) <= held) return;
  if (rank0_)
    log::warn(Subsys::kTrain,
              "--eval-batches {} is more than the {} global batches --val-data {} holds ({} tokens / {} x {}); "
              "each validation uses those {}",
              opt_.eval_batches, held, val_tokens_.source(), val_tokens_.size(), opt_.batch_size, opt_.seq_len, held);
  opt_.eval_batches = int(held);
}

void Trainer::log_setup() const {
  const model::LocalModel& m = model();
  const optim::Optimizer& o = optimizer();
  log::info(Subsys::kTrain, "optimizer state: {} bytes on this rank ({})", o.state_bytes(), o.describe());
  if (const model::GradWindow* w = m.grad_window())
    log::info(Subsys::kTrain,
              "gradients: a window of {:.1f} MB over the buffer and {:.1f} MB for the tied embedding during the "
              "backward, each bucket reduce-scattered into this rank's shard as it is final",
              4e-6 * double(w->capacity()), 4e-6 * double(w->pinned_size()));
  else if (opt_.plan.zero_stage() >= 2)
    log::info(Subsys::kTrain,
              "gradients: the whole buffer during a step ({}), this rank's shard between steps",
              opt_.plan.pp > 1 ? "a pipeline adds every micro-batch into it"
              : opt_.plan.micro_batches > 1 ? "every micro-batch adds into it"
                                            : "more than one compute thread adds into it");
  if (const model::ShardedWeights* sw = m.sharded())
    log::info(Subsys::kTrain,
              "fp32 master weights: {} of the {} parameters on this rank (ZeRO-3: each {}'s weights gathered "
              "from the {} data-parallel ranks when it computes, {} ahead)",
              sw->master_size(), num_params(), opt_.plan.pp > 1 ? "pipeline chunk" : "block", sw->plan().dp(),
              opt_.plan.prefetch);
  {
    // The plan's count (parallel::memory, what check_memory compared with the host) beside the
    // peak RSS the run logs at its end.
    const parallel::MemoryCount mc = memory_need(opt_, grid_ ? grid_->coords().tp : 0);
    log::info(Subsys::kTrain,
              "memory plan: {:.1f} MB per rank (weights {:.1f}, gradients {:.1f}, AdamW {:.1f}, bf16 copy {:.1f}, "
              "activations {:.1f}, buffers {:.1f})",
              mc.total() / 1e6, mc.weights / 1e6, mc.gradients / 1e6, mc.optimizer / 1e6, mc.bf16_copy / 1e6,
              mc.activations / 1e6, mc.buffers / 1e6);
  }
  log::info(Subsys::kTrain, "model {} ({}), {} parameters on this rank, {:.1f} MB activations",
            opt_.model_name, opt_.model.describe(), num_params(), m.activation_bytes() / 1e6);
  if (opt_.model.precision == model::Precision::kBf16)
    log::info(Subsys::kTrain, "precision bf16: {}; fp32 master weights and AdamW state, a {:.1f} MB bf16 weight copy{}",
              kernels::bf16_kernel_description(), m.bf16_weight_bytes() / 1e6,
              kernels::bf16_path() == kernels::Bf16Path::kEmulated ? " (held widened to fp32, read by sgemm in place)"
                                                                   : "");
  else
    log::info(Subsys::kTrain, "precision fp32: CPU features: {}; fp32 matmuls through {}, attention through cblas_sgemm",
              kernels::cpu_features(), kernels::fp32_matmul_description());
  if (val_sampler_)
    log::info(Subsys::kTrain, "validation data {} ({} tokens): {} batches of {} x {} tokens, {}", val_tokens_.source(),
              val_tokens_.size(), opt_.eval_batches, opt_.batch_size, opt_.seq_len,
              opt_.eval_every > 0 ? fmt::format("every {} steps and after the last", opt_.eval_every)
                                  : std::string("after the last step"));
  log::info(Subsys::kTrain, "data {} ({} tokens), batch {} x {} tokens (dp {}, tp {}{}, {}, micro-batches {}), {} threads",
            tokens_.source(), tokens_.size(), opt_.batch_size, opt_.seq_len, opt_.plan.dp, opt_.plan.tp,
            opt_.plan.cp > 1 ? fmt::format(", cp {}: {} tokens of each sequence per rank", opt_.plan.cp,
                                           opt_.plan.local_seq_len(opt_.seq_len))
                             : "",
            m.describe(), opt_.plan.micro_batches, m.threads());
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

void Trainer::dump_logits() {
  trace::Span span("dump logits", "step");
  model::LocalModel& m = *parts_.model;
  const std::vector<int32_t>& prompt = opt_.logits_tokens;
  const size_t n = prompt.size(), T = size_t(opt_.seq_len), V = size_t(opt_.model.vocab);
  const size_t local = size_t(layout().local_vocab()), first_col = size_t(layout().vocab_begin());
  const size_t cols = first_col < V ? std::min(local, V - first_col) : 0;  // past V: padding rows
  // Every sequence of every micro-batch is the prompt, padded with id 0 to seq_len: attention is
  // causal, so the prompt's positions see none of the padding, and every rank runs the forward
  // the layout runs in training (pipeline sends, tp sums, ZeRO-3 gathers) on real tokens.
  const int mb_batch = opt_.plan.micro_batch(opt_.batch_size);
  std::vector<float> out(n * V, 0.0f);
  model::StepBatches batches;
  batches.micro_batches = opt_.plan.micro_batches;
  batches.fill = [&](int, int32_t* in, int32_t* tg) {
    for (int s = 0; s < mb_batch; ++s)
      for (size_t t = 0; t < T; ++t) in[size_t(s) * T + t] = t < n ? prompt[t] : 0;
    std::fill(tg, tg + size_t(mb_batch) * T, 0);
  };
  // The first sequence of micro-batch 0: this rank's columns of each prompt position's row.
  batches.logits = [&](int mb, int first_seq, int, const float* rows) {
    if (mb != 0 || first_seq != 0) return;
    for (size_t t = 0; t < n; ++t) std::memcpy(&out[t * V + first_col], rows + t * local, sizeof(float) * cols);
  };
  m.evaluate(batches);
  if (opt_.model.moe()) m.take_moe_counts();  // the dump trains nothing (collective, as after a validation)
  if (replica_ != 0) return;
  // Each last-stage tp rank wrote its own columns into zeros, every other rank left zeros: the sum
  // over the model-parallel group adds each logit to zeros only, so it arrives exactly.
  if (grid_ && grid_->model_parallel())
    grid_->model_parallel()->all_reduce(out.data(), out.data(), out.size(), DataType::kF32, ReduceOp::kSum)->wait();
  if (!rank0_) return;
  io::write_file_atomic(opt_.dump_logits,
                        std::string_view(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(float)));
  log::info(Subsys::kTrain, "wrote the logits of {} prompt tokens ({} x {} float32) to {}", n, n, V,
            opt_.dump_logits);
}

void Trainer::fill(const data::Sampler& sampler, int64_t step, int first, int count, int32_t* in, int32_t* tg) {
  if (opt_.plan.cp == 1) return sampler.fill(step, first, count, in, tg);
  const int T = opt_.seq_len, Tn = opt_.plan.local_seq_len(T);
  whole_in_.resize(size_t(count) * T);
  whole_tg_.resize(whole_in_.size());
  sampler.fill(step, first, count, whole_in_.data(), whole_tg_.data());
  const model::Placement& place = model().layout().placement();
  for (int b = 0; b < count; ++b)
    for (int t = 0; t < Tn; ++t) {
      const size_t from = size_t(b) * T + size_t(place.position(t, Tn)), to = size_t(b) * Tn + t;
      in[to] = whole_in_[from];
      tg[to] = whole_tg_[from];
    }
}

StepStats Trainer::step() {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t s = next_step_++;
  trace::Span step_span("step", "step", {{"step", s + 1}});
  model::LocalModel& m = *parts_.model;
  GradientSync* sync = parts_.sync.get();
  const int mb_batch = opt_.plan.micro_batch(opt_.batch_size);
  const int first = dp_rank_ * (opt_.batch_size / opt_.plan.dp);
  model::StepBatches batches;
  batches.micro_batches = opt_.plan.micro_batches;
  // The mean over this rank's tokens; the sync's mean over the replicas (dp x cp, each with as
  // many tokens) makes it the batch's.
  batches.loss_scale =
      1.0f / float(size_t(mb_batch) * opt_.plan.micro_batches * opt_.plan.local_seq_len(opt_.seq_len));
  batches.fill = [&](int mb, int32_t* in, int32_t* tg) { fill(*sampler_, s, first + mb * mb_batch, mb_batch, in, tg); };
  if (sync) batches.ready = [&](size_t b, size_t e) { sync->grads_ready(m.grads(), b, e); };
  m.zero_grad();
  double loss = m.step(batches);
  if (sync) sync->finish(m.grads(), m.num_params());
  loss = m.after_sync(loss, sync ? sync->averaged() : nullptr);
  // ZeRO-2 and 3 keep only the averaged shard; the whole buffer returns with the next zero_grad.
  if (sync && opt_.plan.zero_stage() >= 2) m.keep_owned_grads(*sync->averaged());
  if (sync) loss = sync->mean(loss);
  StepStats st;
  st.step = s + 1;
  st.loss = loss;
  if (opt_.model.moe()) moe_stats(st, m.take_moe_counts(), size_t(mb_batch) * opt_.plan.micro_batches);
  {
    trace::Span span("gradient norm", "optimizer");
    st.grad_norm = parts_.optimizer->grad_norm(m.grads(), m.pool());
  }
  if (!std::isfinite(st.loss) || !std::isfinite(st.grad_norm))
    throw usage_error("step {}: the {} is {}: training diverged, so it stops before the optimizer "
                      "writes non-finite weights (nothing is saved); lower --lr, raise --warmup-steps or "
                      "check --init",
                      st.step, std::isfinite(st.loss) ? "gradient norm" : "loss",
                      std::isfinite(st.loss) ? st.grad_norm : st.loss);
  st.lr = schedule_.at(s);
  {
    trace::Span span("optimizer", "optimizer");
    parts_.optimizer->update(m.params(), m.grads(), st.grad_norm, st.lr, m.pool());
    if (parts_.optimizer->clears_grads()) m.grads_cleared();
  }
  // The balancing bias moves after the optimizer, from this step's global loads (moe_stats).
  if (opt_.model.moe_bias) update_moe_bias();
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  elapsed_s_ += dt;
  st.elapsed_s = elapsed_s_;
  st.tokens_per_s = double(opt_.batch_size) * opt_.seq_len / dt;
  return st;
}

void Trainer::moe_stats(StepStats& st, model::MoeCounts counts, size_t sequences) {
  const int E = opt_.model.n_experts, L = opt_.model.n_layer;
  counts.loads.resize(size_t(L) * size_t(E + 1), 0.0);
  std::vector<double> v{counts.aux, double(sequences)};
  v.insert(v.end(), counts.loads.begin(), counts.loads.end());
  if (parts_.sync) parts_.sync->sum(v.data(), v.size());  // over the replicas: the global batch's
  st.aux_loss = v[0] / v[1];
  moe_loads_.assign(v.begin() + 2, v.end());
  for (int l = 0; l < L; ++l) {
    const double* load = v.data() + 2 + size_t(l) * size_t(E + 1);
    double total = 0, most = 0;
    int dead = 0;
    for (int e = 0; e < E; ++e) {
      total += load[e];
      most = std::max(most, load[e]);
      dead += load[e] == 0;
    }
    st.moe_max_mean.push_back(total > 0 ? most / (total / E) : 0.0);
    if (opt_.metrics_moe_loads) st.moe_loads.emplace_back(load, load + E);
    st.moe_dead.push_back(dead);
    st.moe_dropped += load[E];
  }
}

void Trainer::update_moe_bias() {
  model::LocalModel& m = *parts_.model;
  const int E = opt_.model.n_experts;
  // Under ZeRO-3 the master is this rank's owned ranges one after another (the sync's averaged
  // ranges): a whole-buffer offset is found there, or is another rank's to move.
  const std::vector<optim::Range>* owned =
      m.param_storage() == optim::Storage::kCompact && parts_.sync ? parts_.sync->averaged() : nullptr;
  float* params = m.params();
  auto at = [&](size_t off) -> float* {
    if (!owned) return params + off;
    size_t compact = 0;
    for (const optim::Range& r : *owned) {
      if (off >= r.begin && off < r.end) return params + compact + (off - r.begin);
      compact += r.end - r.begin;
    }
    return nullptr;
  };
  std::vector<float> bias(static_cast<size_t>(E));
  std::vector<int64_t> loads(static_cast<size_t>(E));
  for (int l = 0; l < opt_.model.n_layer; ++l) {
    const model::TensorSpec* t =
        m.layout().find_or_null(fmt::format("model.layers.{}.block_sparse_moe.gate.e_score_correction_bias", l));
    if (!t) continue;
    for (int e = 0; e < E; ++e) {
      const float* b = at(t->offset + size_t(e));
      bias[size_t(e)] = b ? *b : 0.0f;
      loads[size_t(e)] = int64_t(moe_loads_[size_t(l) * size_t(E + 1) + size_t(e)]);
    }
    kernels::moe::update_bias(bias.data(), loads.data(), E, float(opt_.model.moe_bias_rate));
    for (int e = 0; e < E; ++e)
      if (float* b = at(t->offset + size_t(e))) *b = bias[size_t(e)];
  }
}

double Trainer::evaluate() {
  if (!val_sampler_) throw usage_error("evaluation needs --val-data PATH (held-out tokens)");
  trace::Span eval_span("evaluate", "step");
  model::LocalModel& m = *parts_.model;
  const int mb_batch = opt_.plan.micro_batch(opt_.batch_size);
  const int first = dp_rank_ * (opt_.batch_size / opt_.plan.dp);
  double total = 0.0;
  for (int k = 0; k < opt_.eval_batches; ++k) {
    // An evaluation is as long as --eval-batches makes it: a stop is honoured between its
    // batches as between steps (every rank asks at the same batch, so none is left in one).
    stop_if_requested();
    model::StepBatches batches;
    batches.micro_batches = opt_.plan.micro_batches;
    batches.fill = [&](int mb, int32_t* in, int32_t* tg) {
      fill(*val_sampler_, k, first + mb * mb_batch, mb_batch, in, tg);
    };
    double loss = m.evaluate(batches);
    if (opt_.model.moe()) m.take_moe_counts();  // validation's forwards train nothing and report the loss alone
    if (parts_.sync) loss = parts_.sync->mean(loss);
    total += loss;
  }
  return total / opt_.eval_batches;
}

void Trainer::stop_if_requested() {
  if (!stop_requested || !stop_requested()) return;
  checkpoints_->wait();  // a save in flight is finished, not abandoned half-written
  throw Stopped{next_step_, checkpoints_->committed_step(), checkpoints_->committed_dir()};
}

Trainer::CpStats Trainer::cp_stats() const {
  CpStats st;
  auto add = [&](const tp::Region& r) {
    if (cp::Group* g = r.cp_group()) {
      st.products += g->products();
      st.exposed_s += g->exposed_seconds();
      st.in_flight_s += g->in_flight_seconds();
    }
  };
  for (const auto& r : parts_.regions) add(*r);
  for (const auto& r : parts_.solo_regions) add(*r);
  return st;
}

double Trainer::ep_seconds() const {
  const tp::Region* r = !parts_.regions.empty() ? static_cast<const tp::Region*>(parts_.regions[0].get())
                        : !parts_.solo_regions.empty() ? parts_.solo_regions[0].get()
                                                       : nullptr;
  return r && r->ep_group() ? r->ep_group()->seconds : 0.0;
}

double Trainer::tp_seconds() const { return parts_.regions.empty() ? 0.0 : parts_.regions[0]->seconds(); }

void Trainer::run() {
  double window_s = 0.0;
  int64_t window_steps = 0;
  while (next_step_ < opt_.steps) {
    checkpoints_->check(false);  // a failed background save stops the run at the next step
    stop_if_requested();
    const double before = elapsed_s_;
    StepStats s = step();
    if (++steps_run_ == 1) parts_.model->restart_gather_timing();  // the log's gather times leave it out
    window_s += s.elapsed_s - before;
    ++window_steps;
    if (val_sampler_ && ((opt_.eval_every > 0 && s.step % opt_.eval_every == 0) || s.step == opt_.steps))
      s.val_loss = evaluate();
    if (on_step) on_step(s);
    if (!opt_.checkpoint_dir.empty() &&
        ((opt_.checkpoint_every > 0 && s.step % opt_.checkpoint_every == 0) || s.step == opt_.steps))
      s.checkpoint_blocked_s = checkpoints_->save(next_step_, model(), optimizer(), report_shard);
    if (rank0_) metrics_.write(s);
    // Last: a step whose state a snapshot keeps has its metrics line. A failure before this
    // point (an evaluation, a checkpoint, the snapshot's own exchange) leaves the previous
    // snapshot, so an in-place recovery runs the step again and its line again (the later wins).
    if (on_state) on_state(s.step, model(), optimizer());
    if (rank0_ && (s.step % opt_.log_every == 0 || s.step == opt_.steps || s.step == 1)) {
      const double tps = double(opt_.batch_size) * opt_.seq_len * window_steps / window_s;
      const double eta = (opt_.steps - s.step) * window_s / window_steps;
      log::info(Subsys::kTrain,
                "step {}/{} | loss {:.4f}{} | lr {:.2e} | grad norm {:.3f} | {:.0f} tok/s | ETA {}", s.step,
                opt_.steps, s.loss, moe_summary(s), s.lr, s.grad_norm, tps, format_eta(eta));
      window_s = 0.0;
      window_steps = 0;
    }
    if (rank0_ && s.val_loss >= 0)
      log::info(Subsys::kTrain, "eval at step {} | val loss {:.4f} | ppl {:.2f}", s.step, s.val_loss,
                std::exp(s.val_loss));
  }
  checkpoints_->wait();  // the last one is committed before the run ends
  if ((!opt_.save.empty() || !opt_.save_hf.empty()) && (opt_.plan.ep_group(replica_) == 0 || model().sharded())) {
    save();
    if (rank0_ && !opt_.save.empty()) log::info(Subsys::kTrain, "saved weights to {}", opt_.save);
    if (rank0_ && !opt_.save_hf.empty())
      log::info(Subsys::kTrain, "saved the model as a Hugging Face directory ({}) to {}", opt_.save_dtype,
                opt_.save_hf);
  }
}

void Trainer::save() const {
  const std::map<std::string, std::string> meta{{"trn.model", opt_.model.describe()},
                                                {"trn.steps", std::to_string(next_step_)}};
  // ZeRO-3: every data-parallel rank gives its shard of the buffer, then replica 0 goes on alone.
  std::vector<float> gathered;
  if (model().sharded()) gathered = model().whole_params();
  // Expert parallelism: the ep ranks of expert group 0 hold the experts between them.
  if (opt_.plan.ep_group(replica_) != 0) return;
  const float* p = model().sharded() ? gathered.data() : params();
  std::vector<float> full;
  if (!layout().whole()) {
    full = parallel::gather_whole(layout(), p, grid_->coords(), parts_.whole, opt_.plan.ep_rank(replica_));
    p = full.data();
  }
  if (!rank0_) return;
  const model::ParamLayout whole(opt_.model);  // the layout of p: layout() itself when it is whole
  if (!opt_.save.empty()) io::save_gpt2(opt_.save, whole, p, meta);
  if (!opt_.save_hf.empty()) {
    io::HfSave hf;
    hf.bf16 = opt_.save_dtype == "bf16";
    hf.shard_bytes = opt_.save_shard_size;
    hf.source_dir = opt_.init_hf;
    hf.metadata = meta;
    io::save_hf(opt_.save_hf, whole, p, hf);
  }
}

}  // namespace trn::train
