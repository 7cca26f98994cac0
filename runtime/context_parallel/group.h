// The context-parallel group of one compute thread (DESIGN.md "Context parallelism"): the cp
// ranks holding the other chunks of its sequences, with what attention exchanges over them (a
// ring's sends and receives, or all-to-alls), the scratch it reuses and its counters. The model
// reaches it through its tp::Region (Region::cp_group); attention.h runs attention over it.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace trn {
class Communicator;
}

namespace trn::cp {

// How attention exchanges a sequence's chunks (--cp-comm).
enum class Comm {
  kRing,      // keys and values around the ring, overlapped with the blocks (ring attention)
  kAllToAll,  // an all-to-all from a split of the tokens to a split of the heads and back (Ulysses)
};
// "ring", "all-to-all"; anything else is a usage error naming the choices.
Comm parse_comm(const std::string& name);
const char* to_string(Comm c);

class Group {
 public:
  Group(std::shared_ptr<Communicator> comm, Comm mode);
  ~Group();
  Comm mode() const { return mode_; }
  int size() const;
  int rank() const;

  // Posts a send of n floats of `send` to the next rank, or a receive of n floats from the
  // previous one into `recv`; returns its index for wait(), valid until wait_all().
  int send_next(const float* send, size_t n);
  int recv_prev(float* recv, size_t n);
  // Waits for a posted operation (timed: the wait is the exchange left exposed).
  void wait(int op);
  // Waits for every posted operation (the end of an attention call).
  void wait_all();
  // Blocking: block j of size() blocks of n floats of in goes to rank j, out gets rank j's block
  // for this rank at block j (timed: all of it exposed).
  void all_to_all(const float* in, float* out, size_t n);

  // Seconds spent waiting in wait() (exposed), and the time from each receive's post to its
  // arrival, summed (in flight): 1 - exposed / in_flight is the share of the exchange hidden
  // behind compute. An all-to-all counts whole in both.
  double exposed_seconds() const { return exposed_s_; }
  double in_flight_seconds() const { return in_flight_s_; }
  // Attention work done here: (query row, key) products, counted per head (the balance counter).
  double& products() { return products_; }

  // Scratch buffer i, at least n floats, reused across calls (the attention's blocks, partial
  // results, widened operands; attention.h numbers them).
  float* buffer(int i, size_t n);

 private:
  struct Op;
  std::shared_ptr<Communicator> comm_;
  Comm mode_;
  std::vector<std::unique_ptr<Op>> ops_;
  std::vector<std::vector<float>> buffers_;
  double exposed_s_ = 0, in_flight_s_ = 0, products_ = 0;
};

}  // namespace trn::cp
