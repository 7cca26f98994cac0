#include "runtime/tensor_parallel/region.h"

#include <chrono>

#include "collectives/communicator.h"
#include "runtime/util/trace.h"

namespace trn::tp {
namespace {

class Single : public Region {
 public:
  int size() const override { return 1; }
  int rank() const override { return 0; }
  void sum(float*, size_t) override {}
  void sum(double*, size_t) override {}
  void max(float*, size_t) override {}
  void max(double*, size_t) override {}
  void gather(float*, size_t) override {}
  void gather(double*, size_t) override {}
  void scatter_sum(float*, size_t) override {}
  void scatter_sum(double*, size_t) override {}
};

}  // namespace

Region& single() {
  static Single s;
  return s;
}

std::unique_ptr<Region> solo() { return std::make_unique<Single>(); }

CommRegion::CommRegion(std::shared_ptr<Communicator> comm) : comm_(std::move(comm)) {}
int CommRegion::size() const { return comm_->size(); }
int CommRegion::rank() const { return comm_->rank(); }

// One blocking collective of n elements of T (none for n == 0), traced as `what` and timed into
// seconds_: call(data type) posts it.
template <typename T, class Post>
void CommRegion::timed(const char* what, size_t n, Post&& call) {
  if (n == 0) return;
  const auto t0 = std::chrono::steady_clock::now();
  trace::Span span(what, "tp", {{"elements", int64_t(n)}});
  call(sizeof(T) == 4 ? DataType::kF32 : DataType::kF64)->wait();
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <typename T>
void CommRegion::reduce(T* x, size_t n, bool max) {
  timed<T>(max ? "tp all-reduce (max)" : "tp all-reduce", n,
           [&](DataType t) { return comm_->all_reduce(x, x, n, t, max ? ReduceOp::kMax : ReduceOp::kSum); });
}

template <typename T>
void CommRegion::gather_in_place(T* full, size_t n) {
  T* mine = full + size_t(comm_->rank()) * n;
  timed<T>("tp all-gather", n, [&](DataType t) { return comm_->all_gather(mine, full, n, t); });
}

template <typename T>
void CommRegion::scatter_in_place(T* full, size_t n) {
  T* mine = full + size_t(comm_->rank()) * n;
  timed<T>("tp reduce-scatter", n, [&](DataType t) { return comm_->reduce_scatter(full, mine, n, t, ReduceOp::kSum); });
}

void CommRegion::gather(float* full, size_t n) { gather_in_place(full, n); }
void CommRegion::gather(double* full, size_t n) { gather_in_place(full, n); }
void CommRegion::scatter_sum(float* full, size_t n) { scatter_in_place(full, n); }
void CommRegion::scatter_sum(double* full, size_t n) { scatter_in_place(full, n); }

void CommRegion::sum(float* x, size_t n) { reduce(x, n, false); }
void CommRegion::sum(double* x, size_t n) { reduce(x, n, false); }
void CommRegion::max(float* x, size_t n) { reduce(x, n, true); }
void CommRegion::max(double* x, size_t n) { reduce(x, n, true); }

}  // namespace trn::tp
