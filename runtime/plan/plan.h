// Planning a job before running it (trn-plan): for a model, a global batch and a cluster, the
// predicted step time and memory per rank of every layout (dp, tp, pp, cp and its exchange, ep,
// micro-batches, schedule, virtual stages, ZeRO, recomputation, sequence parallelism), ranked.
//
// A prediction is built from parts that are measured or published, never from a constant fitted
// to the answer:
//   - compute: on a cluster of this machine's kind (local), the real Stage bodies timed at the
//     layout's shapes by `trn-plan calibrate` (Calibration); on a cluster of devices, FLOPs and
//     bytes of the same pieces over the device's published rates (cluster.h);
//   - communication: the collectives' own cost model (collectives/cost_model.h: the algorithm the
//     runtime would pick, on the hosts the group's ranks sit on) with the cluster's links; the
//     tensor-parallel calls of a piece are those its bodies make (tp_calls, checked against the
//     bodies' own calls by a unit test);
//   - the pipeline: the schedule functions themselves (pipeline_parallel/schedule.h), run through
//     an event simulation of one step (simulate_step): every forward, backward, weight pass,
//     activation transfer and data-parallel bucket is an event on a rank's compute, its link or
//     its data-parallel engine (and under ZeRO-3 each weight gather on its gather engine);
//   - memory: parallel::memory, the one count the memory check before a run uses too (the
//     parameter layout, Stage::activation_bytes, the communication buffers), plus the process's
//     measured base.
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "collectives/cost_model.h"
#include "runtime/model/config.h"
#include "runtime/parallel/plan.h"
#include "runtime/plan/cluster.h"
#include "runtime/plan/moe_loads.h"

namespace trn::plan {

// One candidate: a trn-train layout, the job's parallel plan (parallel/plan.h: dp, tp, pp,
// micro-batches, schedule, virtual stages, zero, bucket and wire; the model and batch are the
// job's). Its flags() are the trn-train flags that run it.
using Layout = parallel::Plan;

// The job: what every layout trains.
struct Job {
  model::Config model;  // precision included
  int global_batch = 8;
  int seq_len = 0;
  int threads = 1;           // compute threads per rank (trn-train --threads)
  int checkpoint_every = 0;  // steps between checkpoints (0: none)
  int snapshot_every = 0;    // steps between in-memory snapshots (0: none)
  // A mixture of experts' measured routing (trn-plan --moe-loads): the busiest expert-parallel
  // rank's rows, waited for and held (moe_loads.h). Empty: routing taken as balanced.
  MoeLoads moe_loads;
};

// Where a step's time goes on the rank that finishes last (seconds).
struct Breakdown {
  double compute = 0;     // forward, backward and weight passes, without their waits
  double tp_comm = 0;     // tensor-parallel all-reduces inside them
  double cp_comm = 0;     // context parallelism's exchange inside them, beyond what attention hides
  double ep_comm = 0;     // expert parallelism's all-to-alls inside them (MoE blocks)
  double pp_comm = 0;     // activation transfers the compute stream waited for, beyond bubble
  double bubble = 0;      // waiting for a neighbour stage
  double dp_exposed = 0;  // data-parallel sync after the last backward, and ZeRO-3's gather waits
  double optimizer = 0;   // the step's other work: grad norm, AdamW, ZeRO's gather, tied sums
  double checkpoint = 0;  // checkpoint and snapshot writes, per step on average
  // Bytes a rank sends on its data-parallel links per step (a ring's share: an all-reduce of S
  // bytes over d ranks sends 2 (d - 1) / d x S, a reduce-scatter or an all-gather half that):
  // the gradients' sync, ZeRO's gather of the updated weights, ZeRO-3's gathers before compute.
  double dp_bytes = 0;
};

// Bytes per rank, on the rank that needs the most: parallel::memory, the count trn-train's
// check before a run makes, with the process's measured base added.
using Memory = parallel::MemoryCount;

struct Prediction {
  Layout layout;
  bool runs = true;     // false: the model, the batch or the schedule cannot take this layout
  bool fits = true;     // the memory fits a rank's share of the node
  std::string why_not;  // for !runs or !fits: the one-line reason
  bool timed = true;    // false: the search left its step unsimulated (it does not fit); step_s is 0
  double step_s = 0;
  Breakdown breakdown;
  Memory memory;
  double tokens_per_s() const;
  int global_batch = 0, seq_len = 0;
  // The model's FLOPs per step (model::flops_per_token x the batch's tokens: every matmul's
  // forward and two backward products, MoE at its active experts, and causal attention's scores
  // and mix, half of the T x T square; recomputation not counted), and their share of the ranks' peak
  // matmul rate over the step (device clusters; 0 on local ones or when not timed).
  double model_flops = 0;
  double mfu = 0;
};

// The prediction for one layout on the cluster. The layout is checked as trn-train checks it
// (a layout it would refuse gets runs = false and trn-train's reason).
Prediction predict(const Job& job, const Layout& layout, const Cluster& cluster);

// What a search evaluated: its cost, which depends on the layer count only through the layouts
// the layer count's divisors allow (each distinct stage shape is counted once, and only the
// layouts that fit are simulated).
struct SearchStats {
  size_t layouts = 0;       // layouts returned (each had its memory counted)
  size_t probed = 0;        // refinements whose memory was counted to choose one (recompute N, shard group)
  size_t stage_shapes = 0;  // distinct stage shapes whose parameters were counted
  size_t simulated = 0;     // layouts whose step was simulated
};

// How a search reports and ends early.
struct Search {
  size_t limit = 100000;  // predictions returned at most
  int max_cp = 0;         // the largest context-parallel size searched (0: every size the job takes)
  int max_ep = 0;         // the largest expert-parallel size searched (0: every size the job takes)
  // Called after each layout with the layouts done and their total (a long search's progress).
  std::function<void(size_t done, size_t total)> progress;
  // Asked before each layout and during a long simulation: true ends the search with an
  // aborted error (a signal arrived).
  std::function<bool()> stop;
  SearchStats* stats = nullptr;  // filled in when given
};

// Every layout of the cluster's ranks worth considering for the job (candidates in plan.cc: every
// dp x tp x pp x cp with its micro-batches, schedules, ZeRO stages, recomputation, sequence
// parallelism and cp exchange; cp > 1 only at one sequence per micro-batch; for a mixture of
// experts each ep, powers of two dividing the replicas and the experts; full recomputation on the
// fewest blocks per chunk that fit; under ZeRO a hybrid shard group, the replicas of a node or the
// smallest larger power of two that fits, beside sharding over all replicas), best first: those that fit
// by predicted step time, then those that do not by the memory they need (least first). Memory
// is counted first and only the layouts that fit have their step simulated (timed = false for the
// others), so a deep model whose deep pipelines cannot fit costs no simulation of them. A local
// cluster without a rank count considers every world of 1 to cores ranks per host. When no
// layout can use the ranks it is a usage error saying which constraint excluded them.
std::vector<Prediction> plan(const Job& job, const Cluster& cluster, const Search& search = {});

// Why a layout loses to the best: its reason when it does not fit or run, else the part of its
// step that grew the most, "pipeline bubble (18% of its step) (+9.9%)".
std::string why_slower(const Prediction& p, const Prediction& best);

// The tensor-parallel calls a piece's bodies run per micro-batch of n tokens (d_model C), in
// order; c.sequence_parallel's when set. Checked against the bodies by a unit test.
struct TpCalls {
  std::vector<TpCall> embedding_fwd, embedding_bwd, block_fwd, block_bwd, head_fwd, head_bwd;
};
TpCalls tp_calls(const model::Config& c, size_t n_tokens);

// Context parallelism's exchange (--cp, --cp-comm; runtime/context_parallel/attention.h) in one
// layer's attention, per micro-batch of B sequences of seq_len tokens, on one rank of a cp group.
// Every operand travels in fp32 (bf16 ones widened), 4 bytes an element.
//   ring: each forward step but the last sends the rank's keys and values held (one block:
//     2 x K/tp x head_dim x B x seq_len/cp elements) to the next cp rank, cp - 1 blocks; backward
//     sends the keys and values on cp - 1 times and a block's key and value gradients cp times.
//   all-to-all: forward two (q, k, v out; the output back), backward three (q, k, v; the output
//     and its gradient; dq, dk, dv back); each sends (cp - 1) / cp of the rank's tensor.
struct CpTraffic {
  double block = 0;                   // ring: one block of keys and values (bytes)
  std::vector<double> a2a_fwd, a2a_bwd;  // all-to-all: the rank's whole tensor of each (bytes)
  double fwd_bytes = 0, bwd_bytes = 0;   // what the rank sends per layer
};
CpTraffic cp_traffic(const model::Config& c, const Layout& l, int B, int seq_len);

// The time context parallelism adds to one layer's forward and backward (seconds), for the cp
// group's ranks placed by the grid (cp ranks tp apart: on one node while tp x cp fit on it) on the
// cluster's links. attn_fwd_s is the layer's attention compute per micro-batch on the rank
// (backward's is twice it): the ring posts each block's transfer before computing the block it
// holds, so a step costs the longer of the two and only the excess is charged, plus backward's last
// gradient block, which arrives after the last computation. An all-to-all is waited for: charged
// whole. link_*: the transfers' own time.
struct CpCost {
  double fwd_s = 0, bwd_s = 0;
  double link_fwd_s = 0, link_bwd_s = 0;
};
CpCost cp_cost(const Cluster& cl, const model::Config& c, const Layout& l, int B, int seq_len, double attn_fwd_s);

// Expert parallelism's token movement (--ep; runtime/kernels/moe_dispatch.h) in one MoE layer,
// per micro-batch of B sequences of seq_len tokens, on one rank of an ep group (every tp rank
// moves its own, 4 bytes an element). A token goes once to each ep rank holding any of its top_k
// choices: on routing uniform over the E experts, ep_rows_per_token = ep (1 - C(E - E/ep, k) /
// C(E, k)) rows a token (1 at ep 1, k at ep E), and on balanced routing (ep - 1)/ep of the rows
// leave the rank and as many arrive. Forward: the dispatch, rows of C + 2k (the token, its
// choices' weights and local experts), and the return, rows of C; backward: the output
// gradients, rows of C, and the return, rows of C + k (dx and the weights' gradients).
double ep_rows_per_token(int n_experts, int top_k, int ep);
struct EpTraffic {
  double rows_per_token = 0;
  std::vector<double> a2a_fwd, a2a_bwd;  // the rank's whole buffer of each all-to-all (bytes)
  double fwd_bytes = 0, bwd_bytes = 0;   // what the rank sends per layer
};
EpTraffic ep_traffic(const model::Config& c, const Layout& l, int B, int seq_len);

// The time expert parallelism's all-to-alls add to one MoE layer's forward and backward
// (seconds), waited for and so charged whole, pairwise on the links the grid puts the ep group
// on: ep consecutive replicas, tp x cp ranks apart (one node while tp x cp x ep fit on it),
// between nodes sharing the node's rails with every rank of it.
struct EpCost {
  double fwd_s = 0, bwd_s = 0;
};
EpCost ep_cost(const Cluster& cl, const model::Config& c, const Layout& l, int B, int seq_len);

// --- the event simulation of one step, exposed for tests ---

// The time of each piece per micro-batch on one rank of a stage (seconds), communication
// included where it is serial with the compute (tensor parallelism).
struct PieceCost : PieceTimes {
  double tp_fwd_block = 0, tp_bwd_block = 0, tp_fwd_ends = 0, tp_bwd_ends = 0;  // within the above
  double cp_fwd_block = 0, cp_bwd_block = 0;  // context parallelism's exposed exchange, within the above
  double ep_fwd_block = 0, ep_bwd_block = 0;  // expert parallelism's all-to-alls, within the above
};

struct StepInput {
  parallel::Schedule schedule = parallel::Schedule::k1F1B;
  int P = 1, M = 1, V = 1;
  int n_layer = 1;
  PieceCost cost;
  double transfer_s = 0;  // one activation (or its gradient) between neighbour stages
  // Cores the ranks share (0: each rank computes at full speed, as on a device): every stage
  // stands for ranks_per_stage ranks (its data- and tensor-parallel peers) of `threads` threads.
  double cores = 0;
  double ranks_per_stage = 1;
  int threads = 1;
  // Data-parallel buckets of each stage, in the order backward finishes them: the block whose
  // backward finishes each (INT_MAX: the head's, -1: the embedding's) and its all-reduce time.
  // Under zb every bucket waits for the end of the step's compute, as the executor reports them.
  struct Bucket {
    int after_block;
    double seconds;
  };
  std::vector<std::vector<Bucket>> buckets;  // per stage (empty: dp 1)
  // ZeRO-3 on one stage (P 1): the weight units each micro-batch's pass (its forward, then its
  // backward) all-gathers, in the order it asks for them (ShardedWeights::order_for, the head's
  // two uses sharing one gather), on the stage's own gather engine, `prefetch` units ahead of the
  // one computing; a unit's compute waits for its gather. Each pass starts with nothing in
  // flight, so at least its first unit's gather is exposed. Empty: the weights are whole.
  struct Gather {
    double seconds;   // the unit's all-gather
    double fwd_work;  // the forward compute that reads it (at a full core's speed)
    double bwd_work;  // the backward compute that reads it
  };
  std::vector<Gather> gathers;
  int prefetch = 1;
  // Asked every few thousand events: true ends the simulation with an aborted error.
  std::function<bool()> stop;
};

struct StepResult {
  double step_s = 0;                  // compute and sync of the slowest stage
  std::vector<double> busy_s;         // per stage: compute work (at a full core's speed)
  double wall_busy_s = 0;             // the slowest stage's computing time, slowed by shared cores
  std::vector<double> end_compute_s;  // per stage: when its last compute action ended
  std::vector<double> end_sync_s;     // per stage: when its last bucket's all-reduce ended
  double bubble_s = 0;                // idle share of the slowest stage before its compute ended,
                                      // its gather waits excluded
  double dp_exposed_s = 0;            // sync after compute on the slowest stage
  double gather_wait_s = 0;           // ZeRO-3: the slowest stage's compute waiting for its weights
};
StepResult simulate_step(const StepInput& in);

}  // namespace trn::plan
