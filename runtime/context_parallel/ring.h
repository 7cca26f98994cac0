// Context parallelism (DESIGN.md "Context parallelism", --cp N): each sequence is cut into 2N
// equal chunks and cp rank r computes chunks r and 2N - 1 - r (model::Placement::position), so
// under the causal mask every rank does the same attention work (head-tail balancing). Everything
// but attention treats a token alone, so only attention communicates: its keys and values go
// around the ring of cp ranks (ring attention), each rank merging its queries' results over the
// blocks it meets with their log-sum-exps, while the next block is already on its way.
//
//   cp::Ring ring(cp_comm);                          // one per compute thread
//   cp::attention_forward(ring, out, lse, qkv, B, Tn, H, K, hd);
//   cp::attention_backward(ring, dqkv, dout, qkv, out, lse, B, Tn, H, K, hd);
//
// Forward, at step s = 0 .. N-1 rank r holds the keys and values of rank j = r - s (mod N): its
// chunks j and 2N-1-j. It posts them to rank r + 1 and the receive of rank r - 1's, computes its
// two query chunks against the two key chunks (a chunk after a query chunk is masked whole and
// skipped; the same chunk is causal; an earlier one is seen whole: kernels.h
// attention_block_forward), merges each into the running output, then waits. Backward sends the
// keys and values around again, and behind them, one step later, each block's dk and dv: a rank
// adds its queries' share to the sum that arrives from rank r - 1 and passes it on, so after N
// steps every block's gradient is home. Grouped-query attention sends the K KV heads only.
//
// Every rank of a cp group posts the same messages in the same order (the communicator matches
// messages between two ranks in issue order), each wait under the communicator's deadline: a
// lost peer is an error naming it, never a hang.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <vector>

namespace trn {
class Communicator;
}

namespace trn::cp {

class Ring {
 public:
  explicit Ring(std::shared_ptr<Communicator> comm);
  ~Ring();
  int size() const;
  int rank() const;

  // Posts a send of n floats of `send` to the next rank, or a receive of n floats from the
  // previous one into `recv` (either null: not posted), in that order; returns its index for wait().
  int send_next(const float* send, size_t n);
  int recv_prev(float* recv, size_t n);
  // Waits for a posted operation (timed: the wait is the exchange left exposed).
  void wait(int op);
  // Waits for every posted operation (the end of an attention call).
  void wait_all();

  // Seconds spent waiting in wait() (exposed), and the time from each post to its completion
  // summed over operations (in flight): 1 - exposed / in_flight is the share hidden behind compute.
  double exposed_seconds() const { return exposed_s_; }
  double in_flight_seconds() const { return in_flight_s_; }
  // Attention work done here: (query row, key) products, counted per head (the balance counter).
  double& products() { return products_; }

  // Scratch reused across calls (the attention's blocks, partial results, widened operands).
  std::vector<float>& buffer(int i);

 private:
  struct Op;
  std::shared_ptr<Communicator> comm_;
  std::vector<std::unique_ptr<Op>> ops_;
  std::vector<std::vector<float>> buffers_;
  double exposed_s_ = 0, in_flight_s_ = 0, products_ = 0;
};

// Causal attention of this rank's Tn = 2L tokens of B sequences (rows as kernels.h
// attention_forward: qkv (B, Tn, (H+2K) hd), out (B, Tn, H hd), lse (B, H, Tn)), against the keys
// of every cp rank's chunks. With a ring of one it is attention_forward.
void attention_forward(Ring& ring, float* out, float* lse, const float* qkv, int B, int Tn, int H, int K, int hd);
// dqkv (B, Tn, (H+2K) hd) overwritten from dout and the forward's qkv, out and lse.
void attention_backward(Ring& ring, float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int B, int Tn, int H, int K, int hd);

// Bytes of the scratch the ring attention holds for B sequences of Tn tokens (the memory count).
double scratch_bytes(int B, int Tn, int H, int K, int hd, bool widened);

}  // namespace trn::cp
