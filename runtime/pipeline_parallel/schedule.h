// Pipeline schedules as data: a schedule is a pure function (kind, stage, P, M, V) -> the
// ordered list of actions one pipeline rank runs in a step (forward or backward of micro-batch
// m on chunk c, and the sends and receives around them). One executor runs any list
// (pipeline.h); the simulator here checks lists without a model: every send meets its receive,
// nothing deadlocks, and the live activations stay within what the schedule promises.
//
// Rank s of P holds V chunks; chunk c is virtual stage v = c * P + s of P * V, so with V > 1
// (interleaved) a rank holds non-contiguous ranges of layers. Activations flow v -> v + 1,
// their gradients v + 1 -> v. Sends are posted without blocking; a receive blocks until its
// message is there (the executor posts every receive of a step before computing).
//
//   gpipe        all M forwards, then all M backwards: M micro-batches live
//   1f1b         P - s - 1 warm-up forwards, then one forward one backward, then the rest of
//                the backwards: at most P - s live on stage s (PipeDream-flush, Megatron)
//   interleaved  1F1B over V chunks per rank in groups of P micro-batches (Megatron's
//                interleaved schedule): the bubble shrinks by V; needs M a multiple of P
//   zb           zero bubble (after ZB-H1, Qi et al. 2024) on 1F1B's order: each backward is split
//                into B, the input gradient, sent upstream at once, and W, the weight gradient,
//                run right after the send, so the gradient chain upstream runs at B's speed and W
//                fills time the stage would otherwise wait; activations live as in 1F1B. ZB-H1
//                also moves W's into the cool-down, which needs activations kept longer: not done
#pragma once

#include <string>
#include <vector>

namespace trn::pipeline {

enum class Kind { kGpipe, k1F1B, kInterleaved, kZeroBubble };
Kind parse_kind(const std::string& name);  // usage error naming the choices
const char* to_string(Kind k);

// kBackward is the whole backward, or under zb only the input gradient (B); kWeight is zb's W.
// kUnshard / kReshard (with_sharding, ZeRO-3 only): start gathering chunk `chunk`'s weights from
// the data-parallel shards without waiting / free them; kReduceGrad (with_reduce_grad): chunk
// `chunk`'s gradients are final, its range may be synced. `mb` is -1 for these three.
enum class Op { kForward, kBackward, kWeight, kSendF, kRecvF, kSendB, kRecvB, kUnshard, kReshard, kReduceGrad };
const char* to_string(Op op);

struct Action {
  Op op;
  int mb;     // micro-batch
  int chunk;  // this rank's chunk
  bool operator==(const Action&) const = default;
};

struct Shape {
  int P = 1, M = 1, V = 1;
  int virtual_stages() const { return P * V; }
  int virtual_stage(int stage, int chunk) const { return chunk * P + stage; }
  int stage_of(int v) const { return v % P; }
  int chunk_of(int v) const { return v / P; }
};

// Usage error naming the values when kind cannot run this shape (V > 1 only for interleaved,
// which needs V >= 2, P >= 2 and M a multiple of P).
void check(Kind kind, const Shape& s);

// The forwards and backwards of `stage`, in order.
std::vector<Action> compute_order(Kind kind, int stage, const Shape& s);
// compute_order with each receive placed just before the computation that needs it and each
// send just after the computation that produced it.
std::vector<Action> actions(Kind kind, int stage, const Shape& s);

// A forward-only pass (evaluation) whatever the training schedule: stage's virtual stages in
// increasing order, each running micro-batches 0..M-1 as receive, forward, send. Every (virtual
// stage, micro-batch) then waits only on one that comes before it in that order on its
// neighbour, so with eager sends nothing deadlocks; no activation is kept between actions.
std::vector<Action> forward_actions(int stage, const Shape& s);

// ZeRO-3 on a pipeline stage (after torch.distributed.pipelining's UNSHARD / RESHARD): `list`
// (actions or forward_actions of `stage`) with a kUnshard(c) placed `lookahead` compute actions
// (F, B, W) before the first F or B of chunk c after c was resharded, and a kReshard(c) right
// after the last F or B of c with no further F or B of c within the next lookahead + 1 compute
// actions (resharding then would only gather c again at once); with V <= lookahead + 1, after the
// last F or B of c in the list (the promise below allows every chunk at once, so a chunk is
// gathered once a step instead of rotating for the same peak). W reads no weight: it neither
// needs c unsharded nor holds its reshard back. An UNSHARD goes right after the compute action
// before its place (after that action's RESHARDs, so memory is freed before it is taken), or at
// the head of the list; several at one place are in order of first use. Removing the two ops
// gives `list` back. With V = 1 (gpipe, 1f1b, zb) this is one UNSHARD at the head and one
// RESHARD after the last B; interleaved chunks rotate when V > lookahead + 1. Pure: the data-parallel
// replicas of a stage get one list, so they issue their gathers in one order.
std::vector<Action> with_sharding(const std::vector<Action>& list, Kind kind, int stage, const Shape& s,
                                  int lookahead = 1);
// Chunks unsharded at once on `stage` at most under with_sharding: every chunk held just before a
// compute action is one that the next lookahead + 1 compute actions use, so min(V, lookahead + 1).
int promised_unsharded(Kind kind, int stage, const Shape& s, int lookahead = 1);

struct ShardingCheck {
  bool ok = false;
  std::string error;  // the first violation
  int peak = 0;       // most chunks unsharded at once
};
// Checks a list with UNSHARD / RESHARD ops over V chunks: every F and B of chunk c runs while c is
// unsharded, UNSHARD and RESHARD alternate per chunk starting with UNSHARD, no chunk is left
// unsharded at the end, and at most `limit` chunks are unsharded at once.
ShardingCheck check_sharding(const std::vector<Action>& list, int V, int limit);

// `list` (a training list of `stage`, with or without with_sharding's ops) with a
// kReduceGrad(c) right after the action that finalises chunk c's gradients: its last B, or under
// zb its last W. Chunks sit in the buffer last to first, and every schedule's last backwards run
// chunk V - 1 first, so the REDUCE_GRADs come in buffer order and the ranges they finish form a
// growing prefix (GradReadyFn's contract). The executor runs it under every ZeRO stage.
std::vector<Action> with_reduce_grad(const std::vector<Action>& list, Kind kind, const Shape& s);
// Checks that every chunk has exactly one kReduceGrad, with none of its B or W after it, and that
// they come chunk V - 1 first down to chunk 0. Empty when right, else the first violation.
std::string check_reduce_grad(const std::vector<Action>& list, int V);

// Micro-batches live at once on `stage` at most (forwarded, not yet backwarded), as promised.
int promised_peak(Kind kind, int stage, const Shape& s);
// The idle share of a step when every forward and backward takes the same time:
// (P - 1) / (M + P - 1), divided by V when interleaved; zb, with F, B and W of equal time and W
// right after B: 2 (P - 1) / (3 M + 2 (P - 1)).
double theoretical_bubble(Kind kind, const Shape& s);

struct Simulation {
  bool ok = false;
  std::string error;               // what went wrong (deadlock, an unmatched message, ...)
  std::vector<int> peak;           // per stage: most micro-batches live at once
  std::vector<int> slots;          // per stage: activation slots a greedy assignment needs
  std::vector<int> unsharded;      // per stage, with lookahead >= 0: most chunks unsharded at once
};
// Runs every stage's list with eager sends and blocking receives, in lock step. lookahead >= 0:
// the lists the executor runs under ZeRO-3, with_reduce_grad(with_sharding(lookahead)), each
// also held to check_sharding with promised_unsharded as the limit and to check_reduce_grad.
Simulation simulate(Kind kind, const Shape& s, int lookahead = -1);

// Activation slot of each (chunk, micro-batch) on `stage`: a slot is free again once the
// micro-batch's backward ran. slot_of[chunk][mb]; slots_needed[chunk] per chunk.
struct SlotPlan {
  std::vector<std::vector<int>> slot_of;
  std::vector<int> slots_needed;
};
SlotPlan plan_slots(Kind kind, int stage, const Shape& s);

}  // namespace trn::pipeline
