#include "runtime/train/dp_sync.h"

#include "runtime/util/trace.h"

#include <algorithm>
#include <chrono>

#include "collectives/core/error.h"
#include "collectives/dtype.h"

namespace trn::train {

DataParallelSync::DataParallelSync(std::shared_ptr<Communicator> comm, size_t num_params,
                                   DataParallelOptions opt)
    : comm_(std::move(comm)), opt_(opt) {
  if (opt_.bucket_bytes < sizeof(float))
    throw usage_error("--bucket-mb gives buckets of {} bytes, less than one fp32 gradient (4 bytes)",
                      opt_.bucket_bytes);
  const size_t per_bucket = std::max<size_t>(1, opt_.bucket_bytes / sizeof(float));
  // Segments alternate between dense and expert ranges; each is cut into buckets on its own.
  auto cut = [&](size_t begin, size_t end, bool expert) {
    for (size_t b = begin; b < end; b += per_bucket) {
      bounds_.push_back(b);
      expert_.push_back(expert);
    }
  };
  size_t at = 0;
  for (const DataParallelOptions::Range& r : opt_.expert_ranges) {
    TRN_CHECK(r.begin >= at && r.end >= r.begin && r.end <= num_params);
    cut(at, r.begin, false);
    cut(r.begin, r.end, true);
    at = r.end;
  }
  cut(at, num_params, false);
  bounds_.push_back(num_params);
  pending_.resize(num_buckets());
  if (opt_.wire == GradWire::kBF16) staging_.resize(num_params);
}

void DataParallelSync::start(float* grads, size_t k) {
  const size_t b = bounds_[k], n = bounds_[k + 1] - b;
  Communicator* comm = expert_[k] ? opt_.experts.get() : comm_.get();
  if (!comm) return;  // an expert bucket no other replica holds: finish() scales it
  if (opt_.wire == GradWire::kBF16) {
    uint16_t* s = staging_.data() + b;
    for (size_t i = 0; i < n; ++i) s[i] = f32_to_bf16(grads[b + i]);
    pending_[k] = comm->all_reduce(s, s, n, DataType::kBF16, ReduceOp::kAvg);
  } else if (opt_.wire == GradWire::kFP8) {
    pending_[k] = comm->all_reduce_e4m3(grads + b, grads + b, n, ReduceOp::kAvg, nullptr, opt_.fp8_format);
  } else {
    pending_[k] = comm->all_reduce(grads + b, grads + b, n, DataType::kF32, ReduceOp::kAvg);
  }
}

void DataParallelSync::grads_ready(float* grads, size_t /*begin*/, size_t end) {
  while (next_ < num_buckets() && bounds_[next_ + 1] <= end) {
    start(grads, next_++);
    ++stats_.buckets_started_in_backward;
  }
}

void DataParallelSync::finish(float* grads, size_t n) {
  TRN_CHECK(n == bounds_.back());
  for (size_t k = 0; k < next_; ++k)
    if (!pending_[k] || pending_[k]->test()) stats_.reduced_in_backward += bounds_[k + 1] - bounds_[k];
  stats_.reduced += n;
  while (next_ < num_buckets()) {
    start(grads, next_++);
    ++stats_.buckets_started_in_finish;
  }
  const auto t0 = std::chrono::steady_clock::now();
  trace::Span span("dp all-reduce wait", "dp", {{"buckets", int64_t(num_buckets())}});
  for (size_t k = 0; k < num_buckets(); ++k) {
    if (pending_[k]) {
      pending_[k]->wait();
      if (opt_.wire == GradWire::kBF16)
        for (size_t i = bounds_[k]; i < bounds_[k + 1]; ++i) grads[i] = bf16_to_f32(staging_[i]);
      pending_[k].reset();
    }
    if (expert_[k])
      for (size_t i = bounds_[k]; i < bounds_[k + 1]; ++i) grads[i] *= opt_.expert_scale;
  }
  stats_.exposed_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ++stats_.steps;
  next_ = 0;
}

void DataParallelSync::sum(double* v, size_t n) {
  if (n) comm_->all_reduce(v, v, n, DataType::kF64, ReduceOp::kSum)->wait();
}

double DataParallelSync::mean(double value) {
  double v = value;
  comm_->all_reduce(&v, &v, 1, DataType::kF64, ReduceOp::kAvg)->wait();
  return v;
}

}  // namespace trn::train
