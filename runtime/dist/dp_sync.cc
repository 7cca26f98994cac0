#include "runtime/dist/dp_sync.h"

#include <algorithm>
#include <chrono>

#include "collectives/core/error.h"

namespace trn::dist {

DataParallelSync::DataParallelSync(std::shared_ptr<Communicator> comm, size_t bucket_bytes, GradComm dtype)
    : comm_(std::move(comm)), bucket_elems_(std::max<size_t>(1, bucket_bytes / sizeof(float))), dtype_(dtype) {
  TRN_CHECK(comm_ != nullptr);
}

void DataParallelSync::launch(float* grads, size_t begin, size_t end) {
  Bucket b{begin, end, nullptr, {}};
  size_t n = end - begin;
  if (dtype_ == GradComm::kBF16) {
    b.staging.resize(n);
    for (size_t i = 0; i < n; ++i) b.staging[i] = f32_to_bf16(grads[begin + i]);
    b.work = comm_->all_reduce(b.staging.data(), b.staging.data(), n, DataType::kBF16, ReduceOp::kAvg);
  } else {
    b.work = comm_->all_reduce(grads + begin, grads + begin, n, DataType::kF32, ReduceOp::kAvg);
  }
  inflight_.push_back(std::move(b));
  launched_ = end;
  ++stats_.buckets;
}

void DataParallelSync::grads_ready(float* grads, size_t begin, size_t end) {
  (void)begin;
  // Launch every whole bucket below `end`; the tail waits for more gradients (or finish()).
  while (end - launched_ >= bucket_elems_) launch(grads, launched_, launched_ + bucket_elems_);
}

void DataParallelSync::finish(float* grads, size_t n) {
  auto t0 = std::chrono::steady_clock::now();
  if (launched_ < n) launch(grads, launched_, n);
  for (auto& b : inflight_) {
    b.work->wait();
    if (dtype_ == GradComm::kBF16)
      for (size_t i = b.begin; i < b.end; ++i) grads[i] = bf16_to_f32(b.staging[i - b.begin]);
  }
  inflight_.clear();
  launched_ = 0;
  stats_.exposed_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ++stats_.steps;
}

double DataParallelSync::mean(double value) {
  double v = value;
  comm_->all_reduce(&v, &v, 1, DataType::kF64, ReduceOp::kAvg)->wait();
  return v;
}

double DataParallelSync::measure_allreduce_s(size_t n, int repeats) {
  std::vector<float> buf(n, 1.0f);
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) {
    comm_->barrier()->wait();
    auto t0 = std::chrono::steady_clock::now();
    comm_->all_reduce(buf.data(), buf.data(), n, DataType::kF32, ReduceOp::kAvg)->wait();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace trn::dist
