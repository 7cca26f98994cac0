#include "runtime/context_parallel/group.h"

#include "collectives/communicator.h"
#include "collectives/core/error.h"

namespace trn::cp {

Comm parse_comm(const std::string& name) {
  if (name == "ring") return Comm::kRing;
  if (name == "all-to-all") return Comm::kAllToAll;
  throw usage_error("--cp-comm {}: the choices are ring (keys and values passed around the cp ranks) and "
                    "all-to-all (the tokens' split swapped for a split of the heads around attention)",
                    name);
}

const char* to_string(Comm c) { return c == Comm::kRing ? "ring" : "all-to-all"; }

struct Group::Op {
  WorkPtr work;
  std::chrono::steady_clock::time_point posted;
  bool done = false, receive = false;
};

Group::Group(std::shared_ptr<Communicator> comm, Comm mode) : comm_(std::move(comm)), mode_(mode) {
  if (!comm_) throw internal_error("a context-parallel group needs a communicator");
}
Group::~Group() = default;

int Group::size() const { return comm_->size(); }
int Group::rank() const { return comm_->rank(); }

int Group::send_next(const float* send, size_t n) {
  auto op = std::make_unique<Op>();
  op->posted = std::chrono::steady_clock::now();
  op->work = comm_->send(send, n, DataType::kF32, (rank() + 1) % size());
  ops_.push_back(std::move(op));
  return int(ops_.size()) - 1;
}

int Group::recv_prev(float* recv, size_t n) {
  auto op = std::make_unique<Op>();
  op->posted = std::chrono::steady_clock::now();
  op->work = comm_->recv(recv, n, DataType::kF32, (rank() + size() - 1) % size());
  op->receive = true;
  ops_.push_back(std::move(op));
  return int(ops_.size()) - 1;
}

void Group::wait(int i) {
  Op& op = *ops_.at(size_t(i));
  if (op.done) return;
  const auto t0 = std::chrono::steady_clock::now();
  op.work->wait();
  const auto t1 = std::chrono::steady_clock::now();
  op.done = true;
  exposed_s_ += std::chrono::duration<double>(t1 - t0).count();
  if (op.receive) in_flight_s_ += std::chrono::duration<double>(t1 - op.posted).count();
}

void Group::wait_all() {
  for (size_t i = 0; i < ops_.size(); ++i) wait(int(i));
  ops_.clear();
}

float* Group::buffer(int i, size_t n) {
  if (size_t(i) >= buffers_.size()) buffers_.resize(size_t(i) + 1);
  std::vector<float>& b = buffers_[size_t(i)];
  if (b.size() < n) b.resize(n);
  return b.data();
}

void Group::all_to_all(const float* in, float* out, size_t n) {
  const auto t0 = std::chrono::steady_clock::now();
  comm_->all_to_all(in, out, n, DataType::kF32)->wait();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  exposed_s_ += s;
  in_flight_s_ += s;
}

}  // namespace trn::cp
