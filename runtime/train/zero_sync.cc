#include "runtime/train/zero_sync.h"

#include <chrono>

#include "collectives/core/error.h"
#include "collectives/dtype.h"
#include "runtime/optim/adamw.h"
#include "runtime/util/trace.h"

namespace trn::train {
namespace {

// The unsharded norm's inner loop (optim::sum_of_squares), continued from s: each square of a
// float is exact in double, so only the order of the additions matters, and it is the same.
double add_squares(double s, const float* g, size_t n) {
  for (size_t i = 0; i < n; ++i) s += double(g[i]) * g[i];
  return s;
}

}  // namespace

ZeroSync::ZeroSync(std::shared_ptr<Communicator> comm, size_t num_params, optim::NormPieces pieces,
                   DataParallelOptions opt, const std::vector<size_t>& forced,
                   std::shared_ptr<Communicator> replicate, std::shared_ptr<Communicator> all)
    : comm_(std::move(comm)),
      replicate_(std::move(replicate)),
      all_(all ? std::move(all) : comm_),
      opt_(opt),
      pieces_(std::move(pieces)),
      plan_(num_params, comm_->size(), std::max<size_t>(1, opt.bucket_bytes / sizeof(float)), pieces_.cuts(), forced) {
  if (opt_.bucket_bytes < sizeof(float))
    throw usage_error("--bucket-mb gives buckets of {} bytes, less than one fp32 gradient (4 bytes)",
                      opt_.bucket_bytes);
  TRN_CHECK(pieces_.cuts().back() == num_params);
  owned_ = plan_.owned(rank());
  fragments_ = optim::fragments(plan_, pieces_, rank());
  pending_.resize(num_buckets());
  pending_tail_.resize(num_buckets());
  replicated_.resize(2 * num_buckets());
  if (opt_.wire == GradWire::kBF16) staging_.resize(num_params);
  // Expert parallelism: buckets of experts' gradients (the caller cuts buckets at the ranges'
  // edges) are not averaged over the replicate group, whose ranks hold other experts.
  expert_.assign(num_buckets(), 0);
  for (size_t k = 0; k < num_buckets(); ++k) {
    const auto& b = plan_.buckets()[k];
    for (const DataParallelOptions::Range& r : opt_.expert_ranges)
      if (b.begin < r.end && r.begin < b.end) {
        TRN_CHECK(r.begin <= b.begin && b.end <= r.end);
        expert_[k] = 1;
      }
  }
}

ZeroSync::~ZeroSync() {
  for (auto* list : {&pending_, &pending_tail_, &replicated_})
    for (WorkPtr& w : *list) try {
        if (w) w->wait();
      } catch (...) {
        // Failed with the transport: it no longer touches the buffers.
      }
}

void ZeroSync::start(float* grads, size_t k) {
  if (window_) return start_window(k);
  const auto& b = plan_.buckets()[k];
  const size_t q = b.slice, tail = plan_.tail(k), at = b.begin + size_t(rank()) * q;
  const size_t tail_at = b.begin + q * size_t(size());
  // In place: this rank's slice of the bucket receives its mean.
  if (opt_.wire == GradWire::kBF16) {
    uint16_t* s = staging_.data();
    for (size_t i = b.begin; i < b.end; ++i) s[i] = f32_to_bf16(grads[i]);
    if (q) pending_[k] = comm_->reduce_scatter(s + b.begin, s + at, q, DataType::kBF16, ReduceOp::kAvg);
    if (tail)
      pending_tail_[k] = comm_->all_reduce(s + tail_at, s + tail_at, tail, DataType::kBF16, ReduceOp::kAvg);
  } else if (opt_.wire == GradWire::kFP8) {
    if (q)
      pending_[k] = comm_->reduce_scatter_e4m3(grads + b.begin, grads + at, q, ReduceOp::kAvg, nullptr,
                                               opt_.fp8_format);
    if (tail)
      pending_tail_[k] = comm_->all_reduce_e4m3(grads + tail_at, grads + tail_at, tail, ReduceOp::kAvg,
                                                nullptr, opt_.fp8_format);
  } else {
    if (q)
      pending_[k] = comm_->reduce_scatter(grads + b.begin, grads + at, q, DataType::kF32, ReduceOp::kAvg);
    if (tail)
      pending_tail_[k] =
          comm_->all_reduce(grads + tail_at, grads + tail_at, tail, DataType::kF32, ReduceOp::kAvg);
  }
}

void ZeroSync::grads_ready(float* grads, size_t /*begin*/, size_t end) {
  while (next_ < num_buckets() && plan_.buckets()[next_].end <= end) {
    start(grads, next_++);
    ++stats_.buckets_started_in_backward;
  }
  if (window_) {
    window_->set_first_unstarted(next_ < num_buckets() ? plan_.buckets()[next_].begin : plan_.size());
    // Free the copies whose reduce-scatter is done (in order: the tail copy precedes phase 2).
    while (!in_flight_.empty()) {
      const size_t k = in_flight_.front();
      const bool done = (!pending_[k] || pending_[k]->test()) && (!pending_tail_[k] || pending_tail_[k]->test());
      if (!done) break;
      retire(k);
    }
  }
  if (replicate_) replicate_ready(grads, false, num_buckets());
}

void ZeroSync::use_window(model::GradWindow* window, float* owned) {
  window_ = window;
  shard_ = owned;
  AlignedVector<uint16_t>().swap(staging_);
  if (opt_.wire == GradWire::kBF16) owned_h_.assign(plan_.owned_elements(rank()), 0);
  size_t largest = 0;
  for (const auto& b : plan_.buckets()) largest = std::max(largest, b.end - b.begin);
  const size_t slots = std::min(kMaxStaged, num_buckets());
  staged_.assign(opt_.wire == GradWire::kBF16 ? 0 : slots, AlignedVector<float>(largest));
  staged_h_.assign(opt_.wire == GradWire::kBF16 ? slots : 0, AlignedVector<uint16_t>(largest));
  free_slots_.clear();
  for (size_t i = 0; i < slots; ++i) free_slots_.push_back(slots - 1 - i);
  slot_of_.assign(num_buckets(), 0);
}

float* ZeroSync::slice_f32(float* grads, size_t k, bool tail) {
  const auto& b = plan_.buckets()[k];
  if (window_) return shard_ + plan_.owned_offset(k, rank()) + (tail ? b.slice : 0);
  return grads + b.begin + (tail ? b.slice * size_t(size()) : b.slice * size_t(rank()));
}

uint16_t* ZeroSync::slice_bf16(size_t k, bool tail) {
  const auto& b = plan_.buckets()[k];
  if (window_) return owned_h_.data() + plan_.owned_offset(k, rank()) + (tail ? b.slice : 0);
  return staging_.data() + b.begin + (tail ? b.slice * size_t(size()) : b.slice * size_t(rank()));
}

void ZeroSync::start_window(size_t k) {
  // Bounded copies in flight: wait for the oldest (its reduce-scatter) before making another.
  while (free_slots_.empty()) {
    const size_t old = in_flight_.front();
    for (WorkPtr* w : {&pending_[old], &pending_tail_[old]})
      if (*w) (*w)->wait();
    retire(old);
  }
  const auto& b = plan_.buckets()[k];
  const size_t q = b.slice, tail = plan_.tail(k), n = size_t(size());
  TRN_CHECK(!free_slots_.empty());
  const size_t slot = slot_of_[k] = free_slots_.back();
  free_slots_.pop_back();
  if (opt_.wire == GradWire::kBF16) {
    AlignedVector<uint16_t>& h = staged_h_[slot];
    window_->copy_bf16(b.begin, b.end, h.data());
    if (q) pending_[k] = comm_->reduce_scatter(h.data(), slice_bf16(k, false), q, DataType::kBF16, ReduceOp::kAvg);
    if (tail)
      pending_tail_[k] =
          comm_->all_reduce(h.data() + q * n, h.data() + q * n, tail, DataType::kBF16, ReduceOp::kAvg);
  } else {
    AlignedVector<float>& f = staged_[slot];
    window_->copy(b.begin, b.end, f.data());
    float* own = slice_f32(nullptr, k, false);
    if (opt_.wire == GradWire::kFP8) {
      if (q)
        pending_[k] = comm_->reduce_scatter_e4m3(f.data(), own, q, ReduceOp::kAvg, nullptr, opt_.fp8_format);
      if (tail)
        pending_tail_[k] = comm_->all_reduce_e4m3(f.data() + q * n, f.data() + q * n, tail, ReduceOp::kAvg,
                                                  nullptr, opt_.fp8_format);
    } else {
      if (q) pending_[k] = comm_->reduce_scatter(f.data(), own, q, DataType::kF32, ReduceOp::kAvg);
      if (tail)
        pending_tail_[k] = comm_->all_reduce(f.data() + q * n, f.data() + q * n, tail, DataType::kF32, ReduceOp::kAvg);
    }
  }
  in_flight_.push_back(k);
}

void ZeroSync::retire(size_t k) {
  TRN_CHECK(!in_flight_.empty() && in_flight_.front() == k);
  in_flight_.erase(in_flight_.begin());
  const auto& b = plan_.buckets()[k];
  const size_t q = b.slice, tail = plan_.tail(k), n = size_t(size());
  const size_t slot = slot_of_[k];
  if (tail && rank() == size() - 1) {
    if (opt_.wire == GradWire::kBF16) std::copy_n(staged_h_[slot].data() + q * n, tail, slice_bf16(k, true));
    else std::copy_n(staged_[slot].data() + q * n, tail, slice_f32(nullptr, k, true));
  }
  free_slots_.push_back(slot);
}

void ZeroSync::replicate_ready(float* grads, bool wait, size_t through) {
  auto done = [&](WorkPtr& w) {
    if (!w) return true;
    if (wait) w->wait();
    else if (!w->test()) return false;
    return true;
  };
  const int n = size();
  while (next_replicated_ < next_ && next_replicated_ < through) {
    const size_t k = next_replicated_;
    if (!done(pending_[k]) || !done(pending_tail_[k])) return;
    // This rank's slice (and, on the tail's owner, the tail) holds the shard group's mean: its
    // mean over the replicas makes it the data-parallel mean. The tail's owner is the shard
    // group's last rank, and so is every member of its replicate group.
    // In window mode the tail reaches the shard when its copy retires: retire first.
    if (window_)
      while (!in_flight_.empty() && in_flight_.front() <= k) retire(in_flight_.front());
    const auto& b = plan_.buckets()[k];
    const size_t q = b.slice, tail = rank() == n - 1 ? plan_.tail(k) : 0;
    WorkPtr* out = &replicated_[2 * k];
    if (expert_[k]) {  // held by this expert rank only: finish() scales it
      ++next_replicated_;
      continue;
    }
    if (opt_.wire == GradWire::kBF16) {
      uint16_t *s = slice_bf16(k, false), *t = slice_bf16(k, true);
      if (q) out[0] = replicate_->all_reduce(s, s, q, DataType::kBF16, ReduceOp::kAvg);
      if (tail) out[1] = replicate_->all_reduce(t, t, tail, DataType::kBF16, ReduceOp::kAvg);
    } else {
      float *s = slice_f32(grads, k, false), *t = slice_f32(grads, k, true);
      if (opt_.wire == GradWire::kFP8) {
        if (q) out[0] = replicate_->all_reduce_e4m3(s, s, q, ReduceOp::kAvg, nullptr, opt_.fp8_format);
        if (tail) out[1] = replicate_->all_reduce_e4m3(t, t, tail, ReduceOp::kAvg, nullptr, opt_.fp8_format);
      } else {
        if (q) out[0] = replicate_->all_reduce(s, s, q, DataType::kF32, ReduceOp::kAvg);
        if (tail) out[1] = replicate_->all_reduce(t, t, tail, DataType::kF32, ReduceOp::kAvg);
      }
    }
    ++next_replicated_;
  }
}

void ZeroSync::finish(float* grads, size_t n) {
  TRN_CHECK(n == plan_.size());
  auto done = [](const WorkPtr& w) { return !w || w->test(); };
  for (size_t k = 0; k < next_; ++k)
    if (done(pending_[k]) && done(pending_tail_[k]))
      stats_.reduced_in_backward += plan_.buckets()[k].end - plan_.buckets()[k].begin;
  stats_.reduced += n;
  while (next_ < num_buckets()) {
    start(grads, next_++);
    ++stats_.buckets_started_in_finish;
  }
  const auto t0 = std::chrono::steady_clock::now();
  trace::Span span("dp reduce-scatter wait", "dp", {{"buckets", int64_t(num_buckets())}});
  if (replicate_) replicate_ready(grads, true, num_buckets());
  for (size_t k = 0; k < num_buckets(); ++k) {
    for (WorkPtr* w : {&pending_[k], &pending_tail_[k]})
      if (*w) (*w)->wait();
    if (window_ && !in_flight_.empty() && in_flight_.front() == k) retire(k);
    for (WorkPtr* w : {&pending_[k], &pending_tail_[k], &replicated_[2 * k], &replicated_[2 * k + 1]}) {
      if (*w) (*w)->wait();
      w->reset();
    }
    if (opt_.wire == GradWire::kBF16) {
      const optim::Range mine = plan_.slice(k, rank());
      const uint16_t* from = window_ ? slice_bf16(k, false) : staging_.data() + mine.begin;
      float* to = window_ ? slice_f32(nullptr, k, false) : grads + mine.begin;
      for (size_t i = 0; i < mine.size(); ++i) to[i] = bf16_to_f32(from[i]);
    }
    if (expert_[k]) {
      // The shard group's mean of an expert's gradient, each rank's the sum over its expert
      // group's tokens: / ep makes it the data-parallel mean.
      const optim::Range mine = plan_.slice(k, rank());
      float* to = window_ ? slice_f32(nullptr, k, false) : grads + mine.begin;
      for (size_t i = 0; i < mine.size(); ++i) to[i] *= opt_.expert_scale;
    }
  }
  TRN_CHECK(in_flight_.empty());
  stats_.exposed_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ++stats_.steps;
  next_ = 0;
  next_replicated_ = 0;
}

void ZeroSync::sum(double* v, size_t n) {
  if (n) all_->all_reduce(v, v, n, DataType::kF64, ReduceOp::kSum)->wait();
}

double ZeroSync::mean(double value) {
  double v = value;
  all_->all_reduce(&v, &v, 1, DataType::kF64, ReduceOp::kAvg)->wait();
  return v;
}

std::vector<double> ZeroSync::piece_sums(const float* grads, ThreadPool& pool, optim::Storage storage) {
  const bool compact = storage == optim::Storage::kCompact;
  auto at = [&](const optim::Fragment& f) { return grads + (compact ? f.at : f.begin); };
  const size_t K = num_buckets();
  const int r = rank(), n = size();
  std::vector<double> sums(pieces_.pieces.size(), 0.0), carry_in(K, 0.0), carry_out(K, 0.0);
  WorkPtr in;
  if (r > 0) in = comm_->recv(carry_in.data(), K, DataType::kF64, r - 1);
  // Fragments that start a piece do not depend on the previous rank: sum them first, spread
  // over the threads.
  std::vector<std::pair<size_t, const optim::Fragment*>> starts;
  for (size_t k = 0; k < K; ++k)
    for (const optim::Fragment& f : fragments_[k])
      if (f.first) starts.emplace_back(k, &f);
  std::vector<double> start_sums(starts.size());
  const int nt = pool.size();
  pool.run([&](int t) {
    // Thread t: starts [S t / nt, S (t + 1) / nt), each its own loop (range_squares: several
    // side by side, the same bits as one at a time).
    const size_t lo = starts.size() * size_t(t) / size_t(nt), hi = starts.size() * size_t(t + 1) / size_t(nt);
    std::vector<optim::Range> ranges;
    for (size_t i = lo; i < hi; ++i) {
      const size_t b = size_t(at(*starts[i].second) - grads);
      ranges.push_back({b, b + (starts[i].second->end - starts[i].second->begin)});
    }
    optim::range_squares(grads, ranges.data(), ranges.size(), start_sums.data() + lo);
  });
  for (size_t i = 0; i < starts.size(); ++i) {
    const auto& [k, f] = starts[i];
    (f->last ? sums[f->piece] : carry_out[k]) = start_sums[i];
  }
  // Then the pieces the previous rank began: at most one per bucket, at the slice's start.
  if (in) in->wait();
  for (size_t k = 0; k < K; ++k)
    for (const optim::Fragment& f : fragments_[k]) {
      if (f.first) continue;
      const double s = add_squares(carry_in[k], at(f), f.end - f.begin);
      (f.last ? sums[f.piece] : carry_out[k]) = s;
    }
  if (r + 1 < n) comm_->send(carry_out.data(), K, DataType::kF64, r + 1)->wait();
  // Each piece's sum is on the one rank that holds its end, zeros elsewhere: the sum over the
  // ranks is exact (x + 0 = x), so every rank gets every piece's sum unchanged.
  comm_->all_reduce(sums.data(), sums.data(), sums.size(), DataType::kF64, ReduceOp::kSum)->wait();
  return sums;
}

void ZeroSync::gather_params(float* params) {
  trace::Span span("dp all-gather parameters", "dp", {{"buckets", int64_t(num_buckets())}});
  std::vector<WorkPtr> works;
  const int n = size();
  for (size_t k = 0; k < num_buckets(); ++k) {
    const auto& b = plan_.buckets()[k];
    const size_t q = b.slice, tail = plan_.tail(k);
    if (q) works.push_back(comm_->all_gather(params + b.begin + size_t(rank()) * q, params + b.begin, q, DataType::kF32));
    if (tail) works.push_back(comm_->broadcast(params + b.begin + q * size_t(n), tail, DataType::kF32, n - 1));
  }
  for (auto& w : works) w->wait();
}

}  // namespace trn::train
