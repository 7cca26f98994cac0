// The parallel plan of a job (DESIGN.md "Process grid"): how its ranks split the work, resolved
// once from the options (trn-train's flags, trn-plan's candidates) into one value that every
// other part reads. It holds the data-parallel size with its shard/replicate split, the tensor-
// and pipeline-parallel sizes, the pipeline's virtual stages, micro-batches and schedule, the
// ZeRO stage, the gradients' wire format and bucket size, and the fields of what comes next
// (sequence, context and expert parallelism, recomputation) at their only value today.
//
// From it come the rank placement (rank <-> dp/tp/pp coordinates, grid()), the pipeline's shape
// (pipeline()), each rank's share of the model (placement()), the micro-batch size and the one
// memory count per rank (memory()), which both the trainer's check before a run and trn-plan's
// search use. Names are parsed into the enums only where options are parsed (trn-train's flag
// table, which trn-plan's --layout goes through too); everything past it compares enums.
//
//   parallel::Plan p;                   // dp 1 x tp 1 x pp 1
//   p.dp = 4; p.zero = 1;               // ZeRO-1 over 4 replicas: dp_shard() 4, dp_replicate() 1
//   parallel::check(p, model, batch);   // one usage error line when the model or batch refuses it
//   parallel::MemoryCount m = parallel::memory(p, model, batch, seq_len);
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "collectives/fp8.h"
#include "runtime/context_parallel/group.h"
#include "runtime/model/config.h"
#include "runtime/parallel/grid.h"
#include "runtime/pipeline_parallel/schedule.h"

namespace trn::model {
class ParamLayout;
}

namespace trn::parallel {

// The pipeline schedule (--schedule): gpipe, 1f1b, interleaved, zb (pipeline_parallel/schedule.h
// has the schedules, pipeline::parse_kind the one parser of the names).
using Schedule = pipeline::Kind;

// The data-parallel gradients on the wire (--grad-comm; train/dp_sync.h runs them).
enum class GradWire { kF32, kBF16, kFP8 };
// "f32" (or "fp32"), "bf16", "fp8"; anything else is a usage error naming the choices.
GradWire parse_grad_wire(const std::string& name);
const char* to_string(GradWire w);  // "f32", "bf16", "fp8"

// Activation recomputation (--recompute): none keeps every activation a backward reads until
// it runs; selective keeps all but what is cheap to compute again and as large as its source
// (the norms' outputs and GPT-2's MLP activation), computed again at the start of the block's
// backward; full keeps only each block's output and reruns the block's forward at the start of
// its backward (Megatron's "full", on the first --recompute-layers blocks of each pipeline chunk:
// its "block" method). Recomputing gives exactly what the forward did, so results do not depend
// on the mode.
enum class Recompute { kNone, kSelective, kFull };
// "none", "selective", "full"; anything else is a usage error naming the choices.
Recompute parse_recompute(const std::string& name);
const char* to_string(Recompute r);

struct Plan {
  // The field order is the aggregate order trn-plan's callers use ({dp, tp, pp, micro_batches}).
  int dp = 1;  // data-parallel replicas in total: dp_shard() x dp_replicate()
  int tp = 1, pp = 1;
  int micro_batches = 1;   // M: pieces of each replica's batch (accumulation, the pipeline's M)
  int virtual_stages = 1;  // V: chunks per pipeline rank (interleaved)
  int zero = 0;            // ZeRO stage 0-3: AdamW's state, + gradients, + weights sharded
  int prefetch = 1;        // ZeRO-3: gather units issued ahead of the one computing
  Schedule schedule = Schedule::k1F1B;
  double bucket_mb = 25.0;  // data-parallel gradient bucket size (MiB)
  GradWire grad_wire = GradWire::kF32;
  // The E4M3 format of the fp8 wire (--fp8-format; collectives/fp8.h): ocp (max 448) or neuron
  // (Trainium2's, max 240). Only read under grad_wire fp8.
  Fp8Format fp8_format = Fp8Format::kOCP;
  // The data-parallel ranks one optimizer state is sharded over (--shard-group; 0: ZeRO's
  // default, the whole data-parallel group under zero >= 1). Data-parallel rank d is member
  // d % S of shard group d / S: S consecutive ranks, which replicate each other's shards
  // across the dp / S groups (hybrid sharding).
  int shard_group = 0;
  Recompute recompute = Recompute::kNone;
  int recompute_layers = 0;  // --recompute full: blocks of each chunk, from its first (0: all)
  bool sequence_parallel = false;  // --sequence-parallel (model::Config::sequence_parallel)
  // Context parallelism (--cp): each sequence cut into 2 cp chunks, cp rank r holding chunks r
  // and 2 cp - 1 - r (model::Placement::position), attention exchanging keys and values around
  // the cp ranks. The weights are replicated over dp x cp, which sum the gradients.
  int cp = 1;
  trn::cp::Comm cp_comm = trn::cp::Comm::kRing;  // --cp-comm: how attention exchanges the chunks
  // Expert parallelism (--ep): each MoE layer's experts split over ep consecutive replicas
  // (replica d is expert-parallel rank d % ep of expert group d / ep: EP inside DP, as in
  // Megatron), tokens sent to their experts' ranks and back with all_to_all_v. The experts'
  // gradients are summed over the replicas holding the same experts (replicas() / ep of them),
  // the rest over all replicas.
  int ep = 1;

  int world() const { return dp * cp * tp * pp; }
  // The ranks that hold the same weights and average their gradients: dp x cp.
  int replicas() const { return dp * cp; }
  // The replicas that shard the optimizer state among them (1: each holds it whole), and the
  // groups of them that replicate it: dp_shard() x dp_replicate() == replicas().
  // Under expert parallelism ZeRO shards over the replicas holding the same experts (replicas() /
  // ep, strided by ep) and the ep ranks of an expert group replicate the rest (hybrid sharding's
  // groups, with the experts' state held by one expert rank only).
  int dp_shard() const {
    return shard_group > 0 ? shard_group : zero >= 1 ? (ep > 1 ? replicas() / ep : replicas()) : 1;
  }
  int dp_replicate() const { return replicas() / dp_shard(); }
  // The replicas that shard one expert's optimizer state: the shard group, whose members all hold
  // the same experts (dp_shard()). The experts a rank holds are already 1/ep of the model's
  // (placement()), so a rank owns 1/(ep x dp_shard()) of every expert's state.
  int expert_shard() const { return dp_shard(); }
  // Replica d's expert-parallel rank and expert group.
  int ep_rank(int replica) const { return replica % ep; }
  int ep_group(int replica) const { return replica / ep; }
  // Whether the optimizer state and the gradients' mean are sharded (ZeRO over more than one
  // rank: the reduce-scatter and ZeroAdamW run; with one replica ZeRO has nothing to shard).
  bool sharded() const { return zero >= 1 && dp_shard() > 1; }
  // The ZeRO stage that runs: 0 when there is nothing to shard.
  int zero_stage() const { return sharded() ? zero : 0; }

  GridShape grid() const { return {dp, tp, pp, cp}; }
  pipeline::Shape pipeline() const { return {pp, micro_batches, virtual_stages}; }
  Coords coords_of(int rank) const { return grid().coords_of(rank); }
  int rank_of(Coords c) const { return grid().rank_of(c); }
  // Sequences per micro-batch on one rank of a global batch (a cp rank holds its chunks of them).
  int micro_batch(int global_batch) const { return global_batch / dp / micro_batches; }
  // Tokens of each sequence on one rank.
  int local_seq_len(int seq_len) const { return seq_len / cp; }
  size_t bucket_bytes() const { return size_t(bucket_mb * 1024 * 1024); }
  // model::Config::recompute for this plan: the blocks of each chunk recomputed (0: none).
  int recomputed_layers() const {
    return recompute == Recompute::kFull ? (recompute_layers > 0 ? recompute_layers : kAllLayers) : 0;
  }
  static constexpr int kAllLayers = 1 << 30;
  // The tensors the rank at (tp_rank, pp_rank) holds: its tp shard of every block, or of its
  // pipeline stage's chunks; and which chunks of each sequence it computes (cp_rank).
  // ep_rank: which experts of each MoE layer (model::ParamLayout::first_expert).
  model::Placement placement(const model::Config& c, int tp_rank, int pp_rank, int cp_rank = 0,
                             int ep_rank = 0) const;

  // The trn-train flags that run it ("--dp 2 --tp 2 --pp 1 --micro-batches 4 ...").
  std::string flags() const;
};

// Usage error (one line, naming the flags and what would work) unless the model and a global
// batch of `global_batch` sequences take the plan: tp divides the heads, the world fits in an
// int, the layers divide into pp x virtual stages, the schedule runs this pipeline shape, the
// batch divides into dp x micro-batches, sequence parallelism has tp > 1 ranks to split a sequence
// of seq_len tokens (when given) evenly over, context parallelism has 2 cp chunks of seq_len to
// split (and under sequence parallelism tp divides a rank's seq_len / cp tokens), and the fields
// expert parallelism divides both the replicas and each MoE layer's experts. dp_name names dp in the batch's error ("--dp", or "the job's data-parallel replicas").
void check(const Plan& p, const model::Config& c, int64_t global_batch, const char* dp_name = "--dp",
           int seq_len = 0);

// Bytes per rank, on the pipeline rank that needs the most.
struct MemoryCount {
  double weights = 0;      // fp32 parameters
  double gradients = 0;    // fp32 gradients, and each extra compute thread's own buffer
  double optimizer = 0;    // AdamW's two moments, of the owned parameters under ZeRO-1
  double bf16_copy = 0;    // the bf16 weight copy of the matmul weights (--precision bf16)
  double activations = 0;  // activation slots and scratch, zero-bubble's kept output gradients
  double buffers = 0;      // pipeline messages, the bf16 wire's staging copy, ZeRO-3's gathered weights
  double base = 0;         // the process's own bytes (trn-plan's measured base; 0 in the check)
  double total() const { return weights + gradients + optimizer + bf16_copy + activations + buffers + base; }
};

// What memory() needs of one stage. The default counts each directly (ParamLayout,
// Stage::activation_bytes, pipeline::plan_slots); trn-plan's search derives the same numbers
// from caches by stage shape (checked equal by a unit test), so its count costs no layout per
// candidate.
class StageCounter {
 public:
  struct Params {
    double total = 0;      // parameters of the stage
    double matmul = 0;     // of them, matmul weights (the bf16 copy's)
    // Of them, the MoE experts' (the rank's n_experts / ep of each MoE layer): sharded by ZeRO
    // over Plan::expert_shard() replicas, the rest over dp_shard().
    double experts = 0;
    double zb_widths = 0;  // one block's matmul output widths (zero-bubble's kept output gradients)
    // ZeRO-3's gather units, in parameters, before the buckets they are rounded out to: the
    // largest block, head (with the tied embedding it multiplies by) and embedding.
    double max_block = 0, max_head = 0, max_embed = 0;
    double tied = 0;  // the tied embedding's parameters (0 untied)
    // Each chunk's parameters, and of them those a ZeRO-3 chunk gather carries in fp32 under bf16
    // (non-matmul tensors and embedding tables: model/sharded.h).
    struct ChunkParams {
      double total = 0, f32 = 0;
    };
    std::vector<ChunkParams> chunks;
  };
  virtual ~StageCounter() = default;
  virtual Params params(const model::Config& c, const model::Placement& p);
  // Stage<float>::activation_bytes of the stage's chunk with `slots` slots of `batch` sequences.
  virtual double activation_bytes(const model::Config& c, const model::Placement& p, int batch, int seq_len,
                                  int slots, int chunk);
  // Activation slots per chunk that pipeline rank `stage` needs (pipeline::plan_slots).
  virtual std::vector<int> slots(const Plan& plan, int stage);
};
// The counts of one stage's parameters (what StageCounter::params returns).
StageCounter::Params stage_params(const model::ParamLayout& lay);

struct MemoryInputs {
  int threads = 1;            // compute threads per rank (a one-stage rank splits its micro-batch)
  int tp_rank = 0;            // the tensor-parallel rank counted
  bool bf16_copy_half = true;  // the bf16 copy holds bf16 (oneDNN), not widened fp32 (emulated)
  double base = 0;            // the process's own bytes
  StageCounter* counter = nullptr;  // null: count directly
  // Expert parallelism: a layer's busiest rank's received rows over a balanced load's (N x k),
  // as measured (plan::MoeLoads::busiest, peak). The rows a rank keeps grow to the largest count
  // seen; the count is of a balanced load at 1. moe_rows: the mean over the layers of each one's
  // largest (its own activations); moe_rows_anywhere: the largest of any layer (the buffers the
  // stage's layers share).
  double moe_rows = 1, moe_rows_anywhere = 1;
};

// THE memory count per rank of a plan: the trainer's check before a run and trn-plan's memory
// per layout are this function. The plan must pass check().
MemoryCount memory(const Plan& p, const model::Config& c, int global_batch, int seq_len, const MemoryInputs& in = {});

// The block index in a tensor's name ("h.3.attn...", "model.layers.3.mlp..."), or -1.
int block_of(const std::string& tensor_name);
// Whether a tensor is one of an MoE layer's experts ("...experts.{e}.w1.weight"): split over the
// expert-parallel ranks and summed over the replicas holding the same experts.
bool is_expert(const std::string& tensor_name);

}  // namespace trn::parallel
