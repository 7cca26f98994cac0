#include "runtime/pipeline_parallel/pipeline.h"

#include <algorithm>
#include <cstring>

#include "collectives/communicator.h"
#include "collectives/core/error.h"
#include "runtime/util/trace.h"

#include <fmt/format.h>

namespace trn::pipeline {

std::vector<model::Chunk> chunks_of(const model::Config& c, const Shape& shape, int stage) {
  const int vs = shape.virtual_stages();
  if (c.n_layer % vs != 0)
    throw usage_error("--pp {}{}: {} virtual stages do not divide n_layer {}; every stage holds the same number of "
                      "blocks, so use a --pp{} that divides {}",
                      shape.P, shape.V > 1 ? fmt::format(" --virtual-stages {}", shape.V) : "", vs, c.n_layer,
                      shape.V > 1 ? " x --virtual-stages" : "", c.n_layer);
  const int per = c.n_layer / vs;
  std::vector<model::Chunk> out;
  for (int ch = 0; ch < shape.V; ++ch) {
    const int v = shape.virtual_stage(stage, ch);
    out.push_back(model::Chunk{v * per, (v + 1) * per, v == 0, v == vs - 1});
  }
  return out;
}

namespace {

model::Placement placement(const model::Config& c, const Shape& shape, int stage, int tp, int tp_rank, int cp,
                           int cp_rank, int ep, int ep_rank) {
  model::Placement p;
  p.tp = tp;
  p.tp_rank = tp_rank;
  p.cp = cp;
  p.cp_rank = cp_rank;
  p.ep = ep;
  p.ep_rank = ep_rank;
  p.chunks = chunks_of(c, shape, stage);
  return p;
}

}  // namespace

PipelineModel::PipelineModel(const model::Config& c, Kind kind, Shape shape, int stage, int tp, int tp_rank,
                             int mb_batch, int seq_len, int threads, tp::Region* tp_region,
                             std::shared_ptr<Communicator> pp, std::shared_ptr<Communicator> embedding, int cp,
                             int cp_rank, int ep, int ep_rank)
    : LocalModel(c, placement(c, shape, stage, tp, tp_rank, cp, cp_rank, ep, ep_rank), threads),
      c_(c),
      kind_(kind),
      shape_(shape),
      stage_(stage),
      mb_batch_(mb_batch),
      seq_len_(seq_len),
      pp_(std::move(pp)),
      embedding_(std::move(embedding)) {
  check(kind, shape);
  if (!pp_ || pp_->size() != shape.P || pp_->rank() != stage)
    throw internal_error("pipeline stage {} of {} needs a pp communicator of that size", stage, shape.P);
  slots_ = plan_slots(kind, stage, shape);
  for (int ch = 0; ch < shape.V; ++ch)
    stages_.push_back(std::make_unique<model::Stage<float>>(layout(), mb_batch, seq_len,
                                                            std::max(slots_.slots_needed[ch], 1), tp_region, ch));
  actions_ = actions(kind, stage, shape);
  forward_actions_ = forward_actions(stage, shape);
  step_actions_ = with_reduce_grad(actions_, kind, shape);
  chunk_gather_.assign(size_t(shape.V), kNoGather);
  // What a stage sends on: its rows of a micro-batch's hidden states (all of them, or this tp
  // rank's share under sequence parallelism).
  const size_t n = model::SeqRows(layout(), mb_batch, seq_len).local * c.d_model;
  auto grid = [&](std::vector<std::vector<AlignedVector<float>>>& b) {
    b.assign(shape.V, {});
    for (auto& per_chunk : b) per_chunk.assign(shape.M, AlignedVector<float>(n));
  };
  grid(recv_f_), grid(recv_b_), grid(send_f_), grid(send_b_);
  recv_f_work_.assign(shape.V, std::vector<std::shared_ptr<Work>>(shape.M));
  recv_b_work_.assign(shape.V, std::vector<std::shared_ptr<Work>>(shape.M));
  inputs_.resize(size_t(mb_batch) * seq_len);
  targets_.resize(inputs_.size());
}

PipelineModel::~PipelineModel() = default;

size_t PipelineModel::activation_bytes() const {
  size_t n = 0;
  for (const auto& s : stages_) n += s->activation_bytes();
  return n + 4 * sizeof(float) * size_t(shape_.V) * shape_.M * recv_f_[0][0].size();
}

std::string PipelineModel::describe() const {
  return fmt::format("pp {} {}{}", shape_.P, to_string(kind_),
                     shape_.V > 1 ? fmt::format(" x {} chunks", shape_.V) : "");
}

double PipelineModel::after_sync(double loss, const std::vector<optim::Range>* averaged) {
  if (const model::TensorSpec* tied = layout().tied(); tied && embedding_) {
    trace::Span span("embedding all-reduce", "pp");
    float* g = grads();
    const size_t begin = tied->offset, end = tied->offset + tied->numel;
    if (!averaged) {
      embedding_->all_reduce(g + begin, g + begin, end - begin, DataType::kF32, ReduceOp::kSum)->wait();
    } else {
      std::vector<std::shared_ptr<Work>> works;
      for (const optim::Range& r : *averaged) {
        const size_t b = std::max(r.begin, begin), e = std::min(r.end, end);
        if (b < e) works.push_back(embedding_->all_reduce(g + b, g + b, e - b, DataType::kF32, ReduceOp::kSum));
      }
      for (auto& w : works) w->wait();
    }
  }
  pp_->all_reduce(&loss, &loss, 1, DataType::kF64, ReduceOp::kSum)->wait();
  return loss / (double(mb_batch_) * shape_.M * seq_len_);
}

model::MoeCounts PipelineModel::take_moe_counts() {
  model::MoeCounts m;
  for (const auto& st : stages_) st->take_moe_counts(m);
  // Each stage reported its own layers: the sum over the pipeline is every layer's.
  m.loads.resize(size_t(layout().config().n_layer) * size_t(layout().config().n_experts + 1), 0.0);
  std::vector<double> v{m.aux};
  v.insert(v.end(), m.loads.begin(), m.loads.end());
  pp_->all_reduce(v.data(), v.data(), v.size(), DataType::kF64, ReduceOp::kSum)->wait();
  m.aux = v[0];
  std::copy(v.begin() + 1, v.end(), m.loads.begin());
  return m;
}

void PipelineModel::post_receives(bool forward_only) {
  // From each neighbour, in the order it sends to this rank: its own action list says.
  const int P = shape_.P;
  std::vector<int> peers{(stage_ + P - 1) % P};
  if ((stage_ + 1) % P != peers[0]) peers.push_back((stage_ + 1) % P);
  for (int q : peers) {
    if (q == stage_) continue;
    for (const Action& a : forward_only ? forward_actions(q, shape_) : actions(kind_, q, shape_)) {
      if (a.op != Op::kSendF && a.op != Op::kSendB) continue;
      const int v = shape_.virtual_stage(q, a.chunk) + (a.op == Op::kSendF ? 1 : -1);
      if (shape_.stage_of(v) != stage_) continue;
      const int ch = shape_.chunk_of(v);
      const size_t n = recv_f_[ch][a.mb].size();
      // Posted a whole step ahead: the receive's own deadline covers every action of the step
      // (each may take up to the communicator's timeout); wait_for applies that timeout from the
      // moment the message is needed.
      const Duration ahead = pp_->options().timeout * int64_t(actions_.size() + 1);
      if (a.op == Op::kSendF)
        recv_f_work_[ch][a.mb] = pp_->recv(recv_f_[ch][a.mb].data(), n, DataType::kF32, q, ahead);
      else
        recv_b_work_[ch][a.mb] = pp_->recv(recv_b_[ch][a.mb].data(), n, DataType::kF32, q, ahead);
    }
  }
}

void PipelineModel::wait_for(std::shared_ptr<Work>& w, const char* what, int mb, int chunk) {
  trace::Span span(what, "pp wait", {{"mb", mb}, {"chunk", chunk}});
  const auto t0 = std::chrono::steady_clock::now();
  w->wait(Deadline::after(pp_->options().timeout));
  wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  w.reset();
}

double PipelineModel::step(const model::StepBatches& batches) {
  if (batches.micro_batches != shape_.M)
    throw internal_error("a step of {} micro-batches on a pipeline scheduled for {}", batches.micro_batches, shape_.M);
  try {
    return run_step(batches.fill, batches.loss_scale, batches.ready);
  } catch (const std::exception& e) {
    abort_step(e);
    throw;
  }
}

void PipelineModel::abort_step(const std::exception& e) {
  // Receives and sends may still be posted into this model's buffers: abort the transport so
  // nothing writes or reads them any more, and the neighbours fail at once instead of waiting.
  pp_->abort(fmt::format("pipeline stage {} failed: {}", stage_, e.what()));
  for (auto& per_chunk : recv_f_work_) std::fill(per_chunk.begin(), per_chunk.end(), nullptr);
  for (auto& per_chunk : recv_b_work_) std::fill(per_chunk.begin(), per_chunk.end(), nullptr);
  sends_.clear();
  if (model::ShardedWeights* sw = sharded_weights()) {
    // The chunks' gathers are waited out and freed; the next step unshards afresh.
    sw->abandon();
    std::fill(chunk_gather_.begin(), chunk_gather_.end(), kNoGather);
  }
}

const std::vector<Action>& PipelineModel::list_for(bool forward_only) {
  const model::ShardedWeights* sw = sharded_weights();
  if (!sw) return forward_only ? forward_actions_ : step_actions_;
  std::vector<Action>& out = forward_only ? sharded_forward_ : sharded_actions_;
  if (out.empty()) {
    out = with_sharding(forward_only ? forward_actions_ : actions_, kind_, stage_, shape_, sw->prefetch());
    if (!forward_only) out = with_reduce_grad(out, kind_, shape_);
  }
  return out;
}

void PipelineModel::unshard(int chunk) {
  model::ShardedWeights* sw = sharded_weights();
  size_t& g = chunk_gather_.at(size_t(chunk));
  if (!sw || g != kNoGather) throw internal_error("UNSHARD of chunk {}, which is unsharded or not sharded", chunk);
  trace::Span span("unshard", "dp", {{"chunk", chunk}});
  const auto [begin, end] = layout().chunk_range(chunk);
  g = sw->issue_range(begin, end);
}

void PipelineModel::reshard(int chunk) {
  model::ShardedWeights* sw = sharded_weights();
  size_t& g = chunk_gather_.at(size_t(chunk));
  if (!sw || g == kNoGather) throw internal_error("RESHARD of chunk {}, which is not unsharded", chunk);
  sw->free(g);
  g = kNoGather;
}

const model::WeightView<float>& PipelineModel::chunk_weights(int chunk) {
  const size_t g = chunk_gather_.at(size_t(chunk));
  if (g == kNoGather) throw internal_error("F or B of chunk {} while it is sharded", chunk);
  return sharded_weights()->wait(g);
}

double PipelineModel::evaluate(const model::StepBatches& batches) {
  if (batches.micro_batches != shape_.M)
    throw internal_error("an evaluation of {} micro-batches on a pipeline scheduled for {}", batches.micro_batches,
                         shape_.M);
  double loss = 0.0;
  try {
    loss = run_forward(batches.fill, batches.logits);
  } catch (const std::exception& e) {
    abort_step(e);
    throw;
  }
  pp_->all_reduce(&loss, &loss, 1, DataType::kF64, ReduceOp::kSum)->wait();
  return loss / (double(mb_batch_) * shape_.M * seq_len_);
}

double PipelineModel::run_forward(const Fill& fill, const LogitsFn& logits) {
  // Under ZeRO-3 each chunk's weights come and go with its UNSHARD and RESHARD.
  const bool sharded = sharded_weights() != nullptr;
  model::WeightView<float> whole;
  if (!sharded) whole = weights_for_forward();
  post_receives(true);
  const int last_v = shape_.virtual_stages() - 1;
  double loss = 0.0;
  for (const Action& a : list_for(true)) {
    model::Stage<float>& st = *stages_[a.chunk];
    const int v = shape_.virtual_stage(stage_, a.chunk);
    switch (a.op) {
      case Op::kUnshard: unshard(a.chunk); break;
      case Op::kReshard: reshard(a.chunk); break;
      case Op::kRecvF: wait_for(recv_f_work_[a.chunk][a.mb], "wait: receive activations", a.mb, a.chunk); break;
      case Op::kForward: {
        const model::WeightView<float>& params = sharded ? chunk_weights(a.chunk) : whole;
        trace::Span span("forward (eval)", "compute", {{"mb", a.mb}, {"chunk", a.chunk}});
        if (v == 0 || v == last_v) fill(a.mb, inputs_.data(), targets_.data());
        loss += st.forward(0, params, inputs_.data(), recv_f_[a.chunk][a.mb].data(),
                           v == last_v && !logits ? targets_.data() : nullptr);
        if (v == last_v && logits) logits(a.mb, 0, mb_batch_, st.logits(0));
        break;
      }
      case Op::kSendF: {
        auto& buf = send_f_[a.chunk][a.mb];
        std::memcpy(buf.data(), st.output(0), buf.size() * sizeof(float));
        sends_.push_back(pp_->send(buf.data(), buf.size(), DataType::kF32, shape_.stage_of(v + 1)));
        break;
      }
      default: throw internal_error("{} in a forward-only action list", to_string(a.op));
    }
  }
  for (auto& w : sends_) wait_for(w, "wait: sends delivered", -1, -1);
  sends_.clear();
  return loss;
}

double PipelineModel::run_step(const Fill& fill, float loss_scale, const model::GradReadyFn& ready) {
  const auto t0 = std::chrono::steady_clock::now();
  // Under ZeRO-3 each chunk's weights come and go with its UNSHARD and RESHARD.
  const bool sharded = sharded_weights() != nullptr;
  model::WeightView<float> whole;
  if (!sharded) whole = weights_for_forward();
  const model::GradView<float> grads = grad_view();
  post_receives(false);
  const int last_v = shape_.virtual_stages() - 1;
  double loss = 0.0;
  size_t reported = 0;
  for (const Action& a : list_for(false)) {
    model::Stage<float>& st = *stages_[a.chunk];
    const int v = shape_.virtual_stage(stage_, a.chunk);
    if (a.op == Op::kUnshard) {
      unshard(a.chunk);
      continue;
    }
    if (a.op == Op::kReshard) {
      reshard(a.chunk);
      continue;
    }
    if (a.op == Op::kReduceGrad) {
      // The chunk's gradients are final: the buffer up to its end is (chunks sit last to first
      // and finish in that order, check_reduce_grad), so the sync may start on the rest of it.
      const size_t end = layout().chunk_range(a.chunk).second;
      if (ready && end > reported) ready(reported, end);
      reported = std::max(reported, end);
      continue;
    }
    const int slot = slots_.slot_of[a.chunk][a.mb];
    switch (a.op) {
      case Op::kRecvF: wait_for(recv_f_work_[a.chunk][a.mb], "wait: receive activations", a.mb, a.chunk); break;
      case Op::kRecvB: wait_for(recv_b_work_[a.chunk][a.mb], "wait: receive gradients", a.mb, a.chunk); break;
      case Op::kUnshard:
      case Op::kReshard:
      case Op::kReduceGrad: break;  // above
      case Op::kForward: {
        const model::WeightView<float>& params = sharded ? chunk_weights(a.chunk) : whole;
        trace::Span span("forward", "compute", {{"mb", a.mb}, {"chunk", a.chunk}});
        if (v == 0 || v == last_v) fill(a.mb, inputs_.data(), targets_.data());
        loss += st.forward(slot, params, inputs_.data(), recv_f_[a.chunk][a.mb].data(),
                           v == last_v ? targets_.data() : nullptr);
        break;
      }
      case Op::kBackward: {
        // The gradients of a chunk are final with its last micro-batch's backward: its tensors
        // are reported as they finish (under zb with its last W, at the chunk's REDUCE_GRAD).
        const bool split = kind_ == Kind::kZeroBubble;
        const model::WeightView<float>& params = sharded ? chunk_weights(a.chunk) : whole;
        trace::Span span(split ? "backward (input)" : "backward", "compute", {{"mb", a.mb}, {"chunk", a.chunk}});
        std::function<void(size_t)> done;
        if (ready && !split && a.mb == shape_.M - 1)
          done = [&](size_t end) {
            if (end > reported) ready(reported, end);
            reported = std::max(reported, end);
          };
        st.backward(slot, params, grads, loss_scale, recv_b_[a.chunk][a.mb].data(), done,
                    split ? model::BackwardPart::kInput : model::BackwardPart::kFull);
        break;
      }
      case Op::kWeight: {
        trace::Span span("backward (weights)", "compute", {{"mb", a.mb}, {"chunk", a.chunk}});
        st.backward_weights(slot, grads);
        break;
      }
      case Op::kSendF: {
        auto& buf = send_f_[a.chunk][a.mb];
        std::memcpy(buf.data(), st.output(slot), buf.size() * sizeof(float));
        sends_.push_back(pp_->send(buf.data(), buf.size(), DataType::kF32, shape_.stage_of(v + 1)));
        break;
      }
      case Op::kSendB: {
        auto& buf = send_b_[a.chunk][a.mb];
        std::memcpy(buf.data(), st.input_grad(), buf.size() * sizeof(float));
        sends_.push_back(pp_->send(buf.data(), buf.size(), DataType::kF32, shape_.stage_of(v - 1)));
        break;
      }
    }
  }
  for (auto& w : sends_) wait_for(w, "wait: sends delivered", -1, -1);
  sends_.clear();
  if (ready && reported < num_params()) ready(reported, num_params());
  step_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return loss;
}

}  // namespace trn::pipeline
