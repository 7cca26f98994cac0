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
};

}  // namespace

Region& single() {
  static Single s;
  return s;
}

CommRegion::CommRegion(std::shared_ptr<Communicator> comm) : comm_(std::move(comm)) {}
int CommRegion::size() const { return comm_->size(); }
int CommRegion::rank() const { return comm_->rank(); }

template <typename T>
void CommRegion::reduce(T* x, size_t n, bool max) {
  if (n == 0) return;
  const auto t0 = std::chrono::steady_clock::now();
  trace::Span span(max ? "tp all-reduce (max)" : "tp all-reduce", "tp", {{"elements", int64_t(n)}});
  const DataType t = sizeof(T) == 4 ? DataType::kF32 : DataType::kF64;
  comm_->all_reduce(x, x, n, t, max ? ReduceOp::kMax : ReduceOp::kSum)->wait();
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void CommRegion::sum(float* x, size_t n) { reduce(x, n, false); }
void CommRegion::sum(double* x, size_t n) { reduce(x, n, false); }
void CommRegion::max(float* x, size_t n) { reduce(x, n, true); }
void CommRegion::max(double* x, size_t n) { reduce(x, n, true); }

}  // namespace trn::tp
