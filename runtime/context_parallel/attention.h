// Context parallelism (DESIGN.md "Context parallelism", --cp N): each sequence is cut into 2N
// equal chunks and cp rank r computes chunks r and 2N - 1 - r (model::Placement::position), so
// under the causal mask every rank does the same attention work (head-tail balancing). Everything
// but attention treats a token alone, so only attention communicates, over the thread's cp Group,
// in one of two ways (--cp-comm):
//
//   cp::Group group(cp_comm, cp::Comm::kRing);       // one per compute thread
//   cp::attention_forward(group, out, lse, qkv, B, Tn, H, K, hd);
//   cp::attention_backward(group, dqkv, dout, qkv, out, lse, B, Tn, H, K, hd);
//
// ring (ring attention, ring.cc). At step s = 0 .. N-1 rank r holds the keys and values of rank
// j = r - s (mod N): its chunks j and 2N-1-j. It posts them to rank r + 1 and the receive of
// rank r - 1's, computes its two query chunks against the two key chunks (a chunk after a query
// chunk is masked whole and skipped; the same chunk is causal; an earlier one is seen whole:
// kernels.h attention_block_forward), merges each into the running output by the log-sum-exps,
// then waits. Backward sends the keys and values around again, and behind them, one step later,
// each block's dk and dv: a rank adds its queries' share to the sum that arrives from rank r - 1
// and passes it on, so after N steps every block's gradient is home. Grouped-query attention
// sends the K KV heads only. Per link and layer: 2(N-1)/N of a rank's keys and values forward,
// twice that and their gradients backward.
//
// all-to-all (DeepSpeed's Ulysses, ulysses.cc). One all-to-all turns the split of the tokens into
// a split of the heads: rank j gets every token of its sequences for heads [j H/N, (j+1) H/N) and
// KV heads [j K/N, (j+1) K/N) (so N must divide the rank's KV heads), runs the ordinary attention
// over whole sequences, and a second all-to-all returns the outputs; backward redistributes q, k,
// v, the output and its gradient the same way and returns dq, dk, dv. Each (sequence, head) is
// computed exactly as one process computes it.
//
// Every rank of a cp group posts the same messages in the same order (the communicator matches
// messages between two ranks in issue order), each wait under the communicator's deadline: a
// lost peer is an error naming it, never a hang.
#pragma once

#include "runtime/context_parallel/group.h"

namespace trn::cp {

// Causal attention of this rank's Tn = 2L tokens of B sequences (rows as kernels.h
// attention_forward: qkv (B, Tn, (H+2K) hd), out (B, Tn, H hd)), against the keys of every cp
// rank's chunks, by the group's mode. lse holds B H Tn floats the backward reads back: (B, H, Tn)
// log-sum-exps of this rank's rows (ring), or (B, H/N, T) of its heads' whole sequences
// (all-to-all).
void attention_forward(Group& group, float* out, float* lse, const float* qkv, int B, int Tn, int H, int K, int hd);
// dqkv (B, Tn, (H+2K) hd) overwritten from dout and the forward's qkv, out and lse.
void attention_backward(Group& group, float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int B, int Tn, int H, int K, int hd);

// Bytes of the scratch a group's attention holds for B sequences of Tn tokens (the memory count),
// with bf16 operands widened to fp32 (widened).
double scratch_bytes(Comm mode, int B, int Tn, int H, int K, int hd, bool widened);

// The modes (attention_forward and attention_backward choose by the group's).
void ring_attention_forward(Group& group, float* out, float* lse, const float* qkv, int B, int Tn, int H, int K,
                            int hd);
void ring_attention_backward(Group& group, float* dqkv, const float* dout, const float* qkv, const float* out,
                             const float* lse, int B, int Tn, int H, int K, int hd);
double ring_scratch_floats(int B, int Tn, int H, int K, int hd);
void ulysses_attention_forward(Group& group, float* out, float* lse, const float* qkv, int B, int Tn, int H, int K,
                               int hd);
void ulysses_attention_backward(Group& group, float* dqkv, const float* dout, const float* qkv, const float* out,
                                const float* lse, int B, int Tn, int H, int K, int hd);
double ulysses_scratch_floats(int B, int Tn, int H, int K, int hd);

// Group::buffer indices: the ring's, then the all-to-all's, then the policies' widened operands.
inline constexpr int kRingBuffers = 0, kUlyssesBuffers = 8, kWideQkv = 16, kWideOut = 17;

}  // namespace trn::cp
