// The communication points of Megatron-style tensor parallelism, as the model's pieces call them
// (runtime/model/stage.h): "reduce from the tensor-parallel region" is sum(), the all-reduce of a
// row-parallel layer's partial outputs in forward and of a column-parallel layer's partial input
// gradients in backward; the vocabulary-parallel cross-entropy also takes a max. The model never
// sees a communicator: one process uses the no-op region, a rank of a TP group one over its tp
// communicator (one per compute thread, so each thread's calls pair with the same thread's on the
// other ranks in the same order).
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>

namespace trn {
class Communicator;
namespace cp {
class Group;
}
}  // namespace trn

namespace trn::tp {

class Region {
 public:
  virtual ~Region() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // In place, over every rank of the region; blocking. The result is bit-identical on every rank.
  virtual void sum(float* x, size_t n) = 0;
  virtual void sum(double* x, size_t n) = 0;
  virtual void max(float* x, size_t n) = 0;
  virtual void max(double* x, size_t n) = 0;
  // Sequence parallelism's pair (Config::sequence_parallel), in place over size() * n elements of
  // full, rank r's part at full + r * n. gather: each rank's part to every rank (all-gather);
  // scatter_sum: each part summed over the ranks into that part's rank (reduce-scatter), the
  // other parts left unspecified. Blocking.
  virtual void gather(float* full, size_t n) = 0;
  virtual void gather(double* full, size_t n) = 0;
  virtual void scatter_sum(float* full, size_t n) = 0;
  virtual void scatter_sum(double* full, size_t n) = 0;

  // Context parallelism's group for this compute thread's sequences (runtime/context_parallel):
  // attention's one communication point, carried with the tensor-parallel ones so the model sees
  // a single object. Null without context parallelism.
  cp::Group* cp_group() const { return cp_.get(); }
  void set_cp_group(std::shared_ptr<cp::Group> group) { cp_ = std::move(group); }

  // Expert parallelism's group for this compute thread (the ranks holding the other experts of
  // each MoE layer, in expert-rank order: layers/moe.h sends tokens to them), carried likewise,
  // with the time its all-to-alls took. Null without expert parallelism.
  struct Experts {
    std::shared_ptr<Communicator> comm;
    double seconds = 0;  // in all-to-alls so far (counts and rows)
  };
  Experts* ep_group() const { return ep_.get(); }
  void set_ep_group(std::shared_ptr<Communicator> comm) {
    ep_ = std::make_shared<Experts>();
    ep_->comm = std::move(comm);
  }

 private:
  std::shared_ptr<cp::Group> cp_;
  std::shared_ptr<Experts> ep_;
};

// A region of one rank: every call is a no-op.
Region& single();
// A region of one rank of its own (one per compute thread), to carry a cp or ep group.
std::unique_ptr<Region> solo();

// A region over comm (its size and rank), with the time spent in its calls.
class CommRegion : public Region {
 public:
  explicit CommRegion(std::shared_ptr<Communicator> comm);
  int size() const override;
  int rank() const override;
  void sum(float* x, size_t n) override;
  void sum(double* x, size_t n) override;
  void max(float* x, size_t n) override;
  void max(double* x, size_t n) override;
  void gather(float* full, size_t n) override;
  void gather(double* full, size_t n) override;
  void scatter_sum(float* full, size_t n) override;
  void scatter_sum(double* full, size_t n) override;
  double seconds() const { return seconds_; }  // in calls so far

 private:
  template <typename T, class Post>
  void timed(const char* what, size_t n, Post&& call);
  template <typename T>
  void reduce(T* x, size_t n, bool max);
  template <typename T>
  void gather_in_place(T* full, size_t n);
  template <typename T>
  void scatter_in_place(T* full, size_t n);
  std::shared_ptr<Communicator> comm_;
  double seconds_ = 0.0;
};

}  // namespace trn::tp
