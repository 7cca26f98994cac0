#include "runtime/model/one_stage.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "collectives/core/error.h"
#include "runtime/util/trace.h"

namespace trn::model {

OneStageModel::OneStageModel(const Config& c, int batch, int seq_len, int threads, Placement placement,
         std::vector<tp::Region*> tp)
    : LocalModel((c.validate(), c), placement, threads_for(threads, batch)), B_(batch), T_(seq_len) {
  if (batch < 1) throw usage_error("batch of {} sequences: need at least 1", batch);
  if (seq_len < 1 || seq_len > c.ctx)
    throw usage_error("sequence length {} must be between 1 and the context {}", seq_len, c.ctx);
  const ParamLayout& lay = layout();
  const int n = this->threads();
  if (!tp.empty() && int(tp.size()) != n)
    throw internal_error("{} tensor-parallel regions for {} compute threads", tp.size(), n);
  for (int k = 0; k < n; ++k) {
    const int first = k * B_ / n, last = (k + 1) * B_ / n;
    first_seq_.push_back(first);
    cores_.push_back(std::make_unique<Stage<float>>(lay, last - first, T_, 1, tp.empty() ? nullptr : tp[k]));
    if (k > 0) extra_grads_.emplace_back(lay.total(), 0.0f);
  }
  first_seq_.push_back(B_);
  progress_ = std::make_unique<Progress[]>(n);
  inputs_.resize(size_t(B_) * T_);
  targets_.resize(inputs_.size());
}

OneStageModel::~OneStageModel() = default;

void OneStageModel::fold_and_report(size_t begin, size_t end, const GradReadyFn& ready) {
  if (end <= begin) return;
  const int n = threads();
  for (int k = 1; k < n; ++k) {
    std::atomic<size_t>& prog = progress_[k].prefix;
    for (size_t seen = prog.load(std::memory_order_acquire); seen < end;
         seen = prog.load(std::memory_order_acquire))
      prog.wait(seen, std::memory_order_acquire);
  }
  if (n > 1) {
    float* g = grads();
    for (int k = 1; k < n; ++k) {
      const float* e = extra_grads_[k - 1].data();
      for (size_t i = begin; i < end; ++i) g[i] += e[i];
    }
  }
  if (ready) ready(begin, end);
}

WeightView<float> OneStageModel::begin_pass(bool backward) {
  ShardedWeights* sw = sharded_weights();
  if (!sw) return weights_for_forward();
  sw->begin(sw->order_for(backward));
  return WeightView<float>::sourced(sw);
}

template <class Fn>
void OneStageModel::run_pass(Fn&& fn) {
  ShardedWeights* sw = sharded_weights();
  try {
    pool().run(fn);
  } catch (...) {
    if (sw) sw->abandon();
    throw;
  }
  if (sw) sw->end();
}

double OneStageModel::forward_backward(const int32_t* inputs, const int32_t* targets, float loss_scale,
                             const GradReadyFn& ready) {
  const WeightView<float> p = begin_pass(true);
  const GradView<float> grad = grad_view();
  const int n = threads();
  std::vector<double> sums(n, 0.0);
  for (int k = 0; k < n; ++k) progress_[k].prefix.store(0, std::memory_order_relaxed);
  run_pass([&](int k) {
    Stage<float>& core = *cores_[k];
    const size_t off = size_t(first_seq_[k]) * T_;
    if (k == 0) {
      sums[0] = core.forward(0, p, inputs + off, nullptr, targets + off);
      size_t reported = 0;
      core.backward(0, p, grad, loss_scale, nullptr, [&](size_t end) {
        fold_and_report(reported, end, ready);
        reported = std::max(reported, end);
      });
      return;
    }
    std::atomic<size_t>& prog = progress_[k].prefix;
    try {
      std::vector<float>& g = extra_grads_[k - 1];
      std::fill(g.begin(), g.end(), 0.0f);
      sums[k] = core.forward(0, p, inputs + off, nullptr, targets + off);
      core.backward(0, p, GradView<float>::whole(g.data(), g.size()), loss_scale, nullptr, [&](size_t end) {
        prog.store(end, std::memory_order_release);
        prog.notify_all();
      });
    } catch (...) {
      prog.store(std::numeric_limits<size_t>::max(), std::memory_order_release);  // never block 0
      prog.notify_all();
      throw;
    }
  });
  double total = 0.0;
  for (double s : sums) total += s;
  return total / (double(B_) * T_);
}

double OneStageModel::forward(const int32_t* inputs, const int32_t* targets) {
  const WeightView<float> p = begin_pass(false);
  const int n = threads();
  std::vector<double> sums(n, 0.0);
  run_pass([&](int k) {
    const size_t off = size_t(first_seq_[k]) * T_;
    sums[k] = cores_[k]->forward(0, p, inputs + off, nullptr, targets ? targets + off : nullptr);
  });
  double total = 0.0;
  for (double s : sums) total += s;
  return total / (double(B_) * T_);
}

double OneStageModel::step(const StepBatches& batches) {
  const GradReadyFn none;
  double loss = 0.0;
  for (int mb = 0; mb < batches.micro_batches; ++mb) {
    batches.fill(mb, inputs_.data(), targets_.data());
    trace::Span span("forward + backward", "compute", {{"mb", mb}});
    loss += forward_backward(inputs_.data(), targets_.data(), batches.loss_scale,
                             mb + 1 == batches.micro_batches ? batches.ready : none);
  }
  return loss / batches.micro_batches;
}

double OneStageModel::evaluate(const StepBatches& batches) {
  double loss = 0.0;
  for (int mb = 0; mb < batches.micro_batches; ++mb) {
    batches.fill(mb, inputs_.data(), targets_.data());
    trace::Span span("forward (eval)", "compute", {{"mb", mb}});
    if (!batches.logits) {
      loss += forward(inputs_.data(), targets_.data());
      continue;
    }
    forward(inputs_.data(), nullptr);
    for (size_t k = 0; k < cores_.size(); ++k)
      batches.logits(mb, first_seq_[k], cores_[k]->batch(), cores_[k]->logits(0));
  }
  return loss / batches.micro_batches;
}

MoeCounts OneStageModel::take_moe_counts() {
  MoeCounts m;
  for (const auto& c : cores_) c->take_moe_counts(m);
  return m;
}

size_t OneStageModel::activation_bytes() const {
  size_t total = 0;
  for (const auto& c : cores_) total += c->activation_bytes();
  return total + sizeof(float) * extra_grads_.size() * num_params();
}

}  // namespace trn::model
