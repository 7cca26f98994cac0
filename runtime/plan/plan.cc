#include "runtime/plan/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>

#include "collectives/core/error.h"
#include "collectives/core/settings.h"
#include "collectives/fabric/shm_ring.h"
#include "runtime/kernels/bf16.h"
#include "runtime/kernels/kernels.h"
#include "runtime/model/family.h"
#include "runtime/model/stage.h"
#include "runtime/pipeline_parallel/pipeline.h"
#include "runtime/pipeline_parallel/schedule.h"

namespace trn::plan {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;
constexpr int kHeadBlock = INT_MAX;  // a tensor the head's backward finishes
constexpr int kEmbeddingBlock = -1;  // a tensor the embedding's backward finishes

int micro_batch(const Job& job, const Layout& l) { return l.micro_batch(job.global_batch); }

model::Placement placement_of(const model::Config& c, const Layout& l, int pp_rank) {
  return l.placement(c, 0, pp_rank);
}

using parallel::block_of;

// Which piece's backward finishes each element range of a stage's buffer: the layout adds
// tensors in the order backward finishes them, so tensors before the first block's belong to
// the head and those after the last to the embedding.
struct Finisher {
  size_t end;  // elements [.., end) of the buffer
  int block;   // kHeadBlock, a block index or kEmbeddingBlock
};
std::vector<Finisher> finishers(const model::ParamLayout& lay, bool has_embedding) {
  std::vector<Finisher> out;
  bool seen_block = false;
  for (const model::TensorSpec& t : lay.tensors()) {
    int b = block_of(t.name);
    if (b >= 0)
      seen_block = true;
    else
      b = seen_block ? kEmbeddingBlock : kHeadBlock;
    // The tied wte: on a rank with the embedding its embedding gradient comes last; on the last
    // pipeline stage alone it is the head's weight.
    if (t.tied) b = has_embedding ? kEmbeddingBlock : kHeadBlock;
    out.push_back({t.offset + t.numel, b});
  }
  std::sort(out.begin(), out.end(), [](const Finisher& a, const Finisher& b) { return a.end < b.end; });
  return out;
}

// The members' hosts of a group of the grid: ranks on node r / per_node.
HostLayout group_layout(const std::vector<int>& ranks, int per_node) {
  std::vector<int> hosts;
  for (int r : ranks) hosts.push_back(r / std::max(1, per_node));
  return host_layout(hosts);
}

// The links with the cluster's extra delay and, between nodes, the rails shared by the `streams`
// groups of a node that cross at once (each group's own ranks sharing them is the cost model's
// link_shared, which stays).
CostModel links_for(const Cluster& cl, int streams) {
  CostModel m = cl.links;
  m.inter.alpha_us += cl.delay_s * 1e6;
  if (m.inter.link_shared > 0 && streams > 1) m.inter.beta_us_per_kib *= streams;
  return m;
}

// Between a local cluster's hosts the fabric runs tcp through rxm. A message beyond rxm's eager
// limit (trn sets 512 KiB: fabric/endpoint.cc) travels by rendezvous: the sender's request, the
// receiver's read of it, then the data, two one-way trips more than an eager message's. And an
// all-reduce's step moves about a window (the ring's receives in flight,
// collectives/algorithms/ring.cc) per three latencies over a link whose latency is large against
// its bandwidth: measured on the 2-host bed with 2 ms one way, a 13 MB all-reduce of 2 ranks took
// 99-162 ms (trn-train's blocking all-reduce figure over 6 runs; this charge: 119 ms) where the
// probe's alpha and beta, fitted to all-reduces of at most 4 MiB, give 23 ms
// (bench/results/2026-12-07-plan-validate-quiet.md). So a step's segment beyond the window is
// charged three latencies per further window, whichever algorithm the runtime chose. A device
// cluster's fabric (EFA's RDM endpoints) has neither.
constexpr double kRendezvousBytes = 512 * 1024;  // FI_OFI_RXM_EAGER_LIMIT as trn sets it
constexpr double kRingWindowBytes = 1 << 20;     // ring.cc's kWindowBytes
// The extra trips of a message of `bytes` between hosts (rendezvous), as a latency.
double rendezvous_s(const Cluster& cl, const CostParams& inter, double bytes) {
  return cl.local && bytes > kRendezvousBytes ? 2 * inter.alpha_us * 1e-6 : 0.0;
}

// The all-reduce the runtime would run (chosen on the links it knows, which do not see the other
// groups' traffic), costed on the links as they are shared during the step.
double allreduce_s(const Cluster& cl, const HostLayout& hl, size_t bytes, int streams) {
  if (hl.ranks <= 1 || bytes == 0) return 0;
  CostModel plain = cl.links;
  plain.inter.alpha_us += cl.delay_s * 1e6;
  const Algo algo = choose_allreduce(hl, bytes, plain);
  const CostModel m = links_for(cl, streams);
  double window_s = 0;  // a step's windows beyond the first, between hosts
  // (Whichever algorithm: a step of rhd, or of the tree's pipeline, moves a segment as large.)
  if (cl.local && hl.hosts > 1) {
    const double segment = double(bytes) / hl.ranks;
    window_s = 2.0 * (hl.ranks - 1) * std::max(0.0, std::ceil(segment / kRingWindowBytes) - 1) * 3 *
               m.inter.alpha_us * 1e-6;
  }
  return allreduce_cost_us(algo, hl, bytes, m) * 1e-6 + window_s;
}

// One message of `bytes` between two ranks.
double p2p_s(const Cluster& cl, bool same_node, size_t bytes, int streams) {
  const CostModel m = links_for(cl, streams);
  const CostParams& p = same_node ? m.intra : m.inter;
  return (p.alpha_us + double(bytes) / 1024.0 * p.beta_us_per_kib) * 1e-6 +
         (same_node ? 0.0 : rendezvous_s(cl, m.inter, double(bytes)));
}

// An all-to-all of a group of `n` ranks placed as hl, each rank holding `bytes` of which 1/n goes
// to each member (itself included): a pairwise exchange with every message posted at once
// (collectives' all_to_all_pairwise and all_to_all_v). A rank's messages to its node's peers go
// over the node's links while those to other nodes share the node's rails with every rank of the
// node (all of them exchange at once, per_node ranks).
double all_to_all_s(const Cluster& cl, const HostLayout& hl, int n, int per_node, double bytes) {
  const int local = hl.hosts > 1 ? std::max(1, hl.per_host) : n;
  const CostModel m = links_for(cl, hl.hosts > 1 ? per_node : 1);
  const double piece = bytes / n / 1024.0;  // KiB to each peer
  const double intra = local > 1 ? m.intra.alpha_us + (local - 1) * piece * m.intra.beta_us_per_kib : 0;
  const double inter = n > local ? m.inter.alpha_us + (n - local) * piece * m.inter.beta_us_per_kib +
                                       rendezvous_s(cl, m.inter, piece * 1024) * 1e6
                                 : 0;
  return std::max(intra, inter) * 1e-6;
}

// The FLOPs and bytes of a model's pieces on one rank (a device cluster's compute model).
struct PieceWork {
  double flops = 0, bytes = 0, kernels = 0;
};
double device_seconds(const Cluster& cl, bool bf16, const PieceWork& w) {
  const double peak = bf16 ? cl.matmul_flops_bf16 : cl.matmul_flops_fp32;
  return w.flops / (peak * cl.matmul_efficiency) + w.bytes / cl.memory_bytes_per_s +
         w.kernels * cl.launch_overhead_s;
}

// A block's forward work on one rank per micro-batch of B sequences of T tokens, a cp rank
// holding T / cp tokens of each: the matmul parameters of the shard (2 FLOPs per parameter per
// token) and causal attention (QK^T and PV, half the T x T square each), of which a cp rank
// computes 1/cp: its T / cp queries against the keys before them, balanced over the ranks by the
// head-and-tail chunks. An MoE block counts its active parameters (MoeMlp::weights): the router
// and top_k of its n_experts experts, which a token runs. Under expert parallelism a rank runs the
// experts it holds over the rows sent to them, on balanced routing as many as its own tokens'
// choices: the same work per rank whatever ep.
struct BlockShape {
  // Parameters of one block's (active) and the head's matmuls on the shard.
  double matmul = 0, head_matmul = 0;
  double experts = 0;                  // of `matmul`, the experts' a token runs (k of E)
  double attn_width = 0, heads = 0;    // the shard's query heads x head_dim, and its heads
  double kv_heads = 0, head_dim = 0;   // the shard's KV heads, and a head's width
};
BlockShape block_shape(const model::Config& c, int tp) {
  const model::ParamLayout lay(c, model::Placement{tp, 0, {}});
  BlockShape s;
  for (const model::TensorSpec& t : lay.tensors()) {
    if (!t.matmul) continue;
    const int b = block_of(t.name);
    if (b == 0 && parallel::is_expert(t.name)) {
      s.matmul += double(t.numel) * c.top_k / c.n_experts;
      s.experts += double(t.numel) * c.top_k / c.n_experts;
    } else if (b == 0) {
      s.matmul += double(t.numel);
    } else if (b < 0 && (t.tied || t.name.find("head") != std::string::npos))
      s.head_matmul += double(t.numel);
  }
  if (s.head_matmul == 0) s.head_matmul = double(model::padded_vocab(c, tp)) / tp * c.d_model;
  s.heads = lay.local_heads();
  s.attn_width = double(lay.local_heads()) * c.head_dim();
  s.kv_heads = std::max(1.0, double(c.kv_heads()) / tp);  // tp past the KV heads replicates them
  s.head_dim = c.head_dim();
  return s;
}
double attention_flops(const BlockShape& s, int B, int T, int cp) {
  return 2 * double(B) * T * T * s.attn_width / cp;  // scores and PV, causal half each
}

// Compute seconds of each piece per micro-batch of B sequences on a device: the matmul
// parameters of a block of the shard (forward 2 FLOPs per parameter per token, backward twice
// that), causal attention (block_shape), and the activations each piece streams through memory
// (about a dozen reads and writes of the residual width per token). attention_s: the forward
// attention's share of the block's (what hides the ring's transfers).
PieceTimes device_pieces(const Cluster& cl, const model::Config& c, int tp, int B, int T, int cp,
                         double* attention_s) {
  const BlockShape sh = block_shape(c, tp);
  const double block_matmul = sh.matmul, head_matmul = sh.head_matmul;
  const double N = double(B) * T / cp, C = c.d_model;
  const double attn_width = sh.attn_width;
  const bool bf16 = c.precision == model::Precision::kBf16;
  const double act = bf16 ? 2 : 4;
  PieceWork bf, ef, hf, at;
  at.flops = attention_flops(sh, B, T, cp);
  // The blockwise kernel (kernels/attention.cc: online softmax over blocks of kAttentionRows
  // query rows, the scores of a block in scratch, never the T x T matrix) reads, for each query
  // block, the keys and values before it once per KV head (its group's query heads share them):
  // on average half the sequence's, for each of the rank's T / cp / kAttentionRows blocks. Its
  // q, out and lse are in the block's activations below.
  const double q_blocks = std::ceil(double(T) / cp / kernels::kAttentionRows);
  at.bytes = double(B) * sh.kv_heads * q_blocks * (double(T) / 2) * 2 * sh.head_dim * act;
  *attention_s = device_seconds(cl, bf16, at);
  bf.flops = 2 * N * block_matmul + at.flops;
  bf.bytes = N * C * 4 * 12 + N * attn_width * act * 6 + at.bytes;
  bf.kernels = 16;
  ef.bytes = N * C * 4 * 2;
  ef.kernels = 2;
  hf.flops = 2 * N * head_matmul;
  hf.bytes = N * C * 4 * 3 + N * head_matmul / C * 4 * 3;
  hf.kernels = 6;
  PieceTimes t;
  t.block_fwd = device_seconds(cl, bf16, bf);
  PieceWork bb = bf;
  bb.flops *= 2;
  bb.bytes *= 2;
  bb.kernels *= 2;
  t.block_bwd = device_seconds(cl, bf16, bb);
  PieceWork bi = bf, bw = bf;  // input and weight halves of the backward's products
  bi.bytes *= 1.5;
  bw.bytes *= 0.5;
  bw.flops = 2 * N * block_matmul;
  bi.flops = bb.flops - bw.flops;
  t.block_bwd_input = device_seconds(cl, bf16, bi);
  t.block_bwd_weight = device_seconds(cl, bf16, bw);
  t.embedding_fwd = device_seconds(cl, bf16, ef);
  t.embedding_bwd = device_seconds(cl, bf16, ef);
  t.head_fwd = device_seconds(cl, bf16, hf);
  PieceWork hb = hf;
  hb.flops *= 2;
  hb.bytes *= 2;
  t.head_bwd = device_seconds(cl, bf16, hb);
  return t;
}

// The grid's groups (parallel/grid.h) around the rank at (pp_rank, dp 0, cp 0, tp 0): tp
// consecutive ranks; cp ranks tp apart; the replicas that average the gradients (and shard ZeRO's
// state), dp x cp ranks tp apart.
int rank_of(const Layout& l, int pp_rank) { return l.rank_of(parallel::Coords{0, 0, pp_rank, 0}); }
std::vector<int> tp_group(const Layout& l, int pp_rank) { return l.grid().tp_group(rank_of(l, pp_rank)); }
std::vector<int> dp_group(const Layout& l, int pp_rank) { return l.grid().dp_group(rank_of(l, pp_rank)); }
std::vector<int> cp_group(const Layout& l, int pp_rank) { return l.grid().cp_group(rank_of(l, pp_rank)); }
// Expert parallelism's groups among the replicas (Plan::ep_rank, ep_group): the ep group is ep
// consecutive replicas (tp x cp ranks apart in the world, crossing nodes once they pass one), and
// the replicas holding the same experts, which sum their gradients, every ep-th replica.
std::vector<int> ep_group(const Layout& l, int pp_rank) {
  const std::vector<int> replicas = dp_group(l, pp_rank);
  return {replicas.begin(), replicas.begin() + std::min<size_t>(size_t(l.ep), replicas.size())};
}
// Hybrid sharding's groups (Plan::shard_group, no ep): the shard group is S = dp_shard()
// consecutive replicas, the replicate group every S-th replica.
std::vector<int> shard_group(const Layout& l, int pp_rank) {
  const std::vector<int> replicas = dp_group(l, pp_rank);
  return {replicas.begin(), replicas.begin() + std::min<size_t>(size_t(l.dp_shard()), replicas.size())};
}
std::vector<int> replicate_group(const Layout& l, int pp_rank) {
  const std::vector<int> replicas = dp_group(l, pp_rank);
  std::vector<int> out;
  for (size_t i = 0; i < replicas.size(); i += size_t(std::max(1, l.dp_shard()))) out.push_back(replicas[i]);
  return out;
}
std::vector<int> expert_dp_group(const Layout& l, int pp_rank) {
  const std::vector<int> replicas = dp_group(l, pp_rank);
  std::vector<int> out;
  for (size_t i = 0; i < replicas.size(); i += size_t(std::max(1, l.ep))) out.push_back(replicas[i]);
  return out;
}

// Streams of a node crossing to other nodes at once in a group's collective: every rank of the
// node is in one such group of the same kind, and all of them run it together.
int crossing_streams(const Cluster& cl, const HostLayout& hl, int world) {
  return hl.hosts > 1 ? cl.per_node(world) / std::max(1, hl.per_host) : 1;
}

double seconds_of(const Cluster& cl, const HostLayout& hl, const std::vector<TpCall>& calls, int world) {
  double s = 0;
  const int streams = crossing_streams(cl, hl, world);
  for (const TpCall& c : calls) s += allreduce_s(cl, hl, (c.half ? 2 : 4) * double(c.n), streams);
  return s;
}

std::string why_runs_not(const Job& job, const Layout& l) {
  try {
    parallel::check(l, job.model, job.global_batch, "--dp", job.seq_len);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// What a stage's memory needs of its parameters. They depend on the tensor-parallel size and on
// how many blocks each of the stage's chunks holds and whether it has the embedding or the head,
// not on which blocks it holds (a model's blocks are alike): a search counts each such shape
// once, whatever the layer count.
// (Every expert-parallel rank holds as many experts, n_experts / ep: ep is the shape's, not which
// experts.)
struct StageShape {
  int tp = 1, ep = 1;
  std::vector<std::tuple<int, bool, bool>> chunks;  // blocks, embedding, head
  auto operator<=>(const StageShape&) const = default;
};
StageShape shape_of_stage(const model::Placement& p) {
  StageShape s{p.tp, p.ep, {}};
  for (const model::Chunk& c : p.chunks) s.chunks.emplace_back(c.end_layer - c.first_layer, c.embedding, c.head);
  return s;
}

// The counts parallel::memory takes from the model, kept for a search: each stage shape's
// parameters, each (shape, micro-batch, chunk)'s activation bytes, each schedule shape's
// activation slots. They equal StageCounter's direct counts (a unit test checks).
struct MemoryCounts : parallel::StageCounter {
  struct Stage {
    model::ParamLayout lay;
    Params params;
    Stage(const model::Config& c, const model::Placement& p) : lay(c, p), params(parallel::stage_params(lay)) {}
  };
  std::map<StageShape, Stage> stages;
  // (shape, micro-batch, tokens of each sequence (seq_len / cp), chunk) + the recomputation
  // (Config::recompute, recompute_selective) and sequence parallelism
  std::map<std::tuple<StageShape, int, int, int, int, bool, bool>, std::pair<size_t, size_t>> activations;
  std::map<std::tuple<int, int, int, int>, std::vector<std::vector<int>>> slot_counts;  // kind, P, M, V
  // The stage layouts of another recomputation or sequence parallelism than the stage's own.
  std::map<std::tuple<StageShape, int, bool, bool>, model::ParamLayout> variants;
  static constexpr size_t kMaxVariants = 16;
  SearchStats* stats = nullptr;
  std::function<bool()> stop;  // asked per stage of a deep pipeline's slot count

  const Stage& stage(const model::Config& c, const model::Placement& p) {
    StageShape key = shape_of_stage(p);
    auto it = stages.find(key);
    if (it == stages.end()) {
      it = stages.try_emplace(std::move(key), c, p).first;
      if (stats) ++stats->stage_shapes;
    }
    return it->second;
  }

  Params params(const model::Config& c, const model::Placement& p) override { return stage(c, p).params; }

  // Stage::activation_bytes with `slots` slots: a stage keeps that many identical sets of buffers
  // and one of everything else (visit_buffers in stage_impl.h), so the bytes are affine in the
  // slots and two counts give every slot count (checked by a unit test).
  double activation_bytes(const model::Config& c, const model::Placement& p, int B, int T, int slots,
                          int chunk) override {
    auto [it, fresh] = activations.try_emplace(
        {shape_of_stage(p), B, T, chunk, c.recompute, c.recompute_selective, c.sequence_parallel});
    if (fresh) {
      // The stage's own layout unless the recomputation differs from the one it was made with.
      const Stage& sp = stage(c, p);
      const model::Config& made = sp.lay.config();
      const bool same = made.recompute == c.recompute && made.recompute_selective == c.recompute_selective &&
                        made.sequence_parallel == c.sequence_parallel;
      const model::ParamLayout* lay = &sp.lay;
      if (!same) {
        // One layout per shape and recomputation, whatever the micro-batch and tokens asked.
        auto v = variants.find({shape_of_stage(p), c.recompute, c.recompute_selective, c.sequence_parallel});
        // A layout holds every tensor of the stage (thousands for a mixture of experts), and the
        // search asks for many recomputation depths (its bisection): the cache keeps a bounded
        // number, rebuilt when asked again, since each is needed only for its activation counts.
        if (v == variants.end() && variants.size() >= kMaxVariants) variants.clear();
        if (v == variants.end())
          v = variants
                  .try_emplace({shape_of_stage(p), c.recompute, c.recompute_selective, c.sequence_parallel}, c, p)
                  .first;
        lay = &v->second;
      }
      it->second = {model::Stage<float>::activation_bytes(*lay, B, T, 1, chunk),
                    model::Stage<float>::activation_bytes(*lay, B, T, 2, chunk)};
    }
    const auto [one, two] = it->second;
    return double(one + size_t(slots - 1) * (two - one));
  }

  // The slots each stage of a pipeline needs per chunk (pipeline::plan_slots), counted for every
  // stage at once.
  std::vector<int> slots(const Layout& l, int pp_rank) override {
    auto [it, fresh] = slot_counts.try_emplace({int(l.schedule), l.pp, l.micro_batches, l.virtual_stages});
    if (fresh) {
      for (int r = 0; r < l.pp; ++r) {
        if (stop && stop()) {
          slot_counts.erase(it);
          throw aborted_error("the search stopped counting a {}-stage pipeline's activations", l.pp);
        }
        it->second.push_back(pipeline::plan_slots(l.schedule, r, l.pipeline()).slots_needed);
      }
    }
    return it->second[size_t(pp_rank)];
  }
};

Memory memory_of(const Job& job, const Layout& l, const Cluster& cl, MemoryCounts& counts) {
  parallel::MemoryInputs in;
  in.threads = job.threads;
  in.tp_rank = 0;
  // The bf16 copy's form follows the kernels (bf16.h): bf16 for oneDNN, widened fp32 emulated;
  // a device holds bf16.
  in.bf16_copy_half = !cl.local || kernels::bf16_path() == kernels::Bf16Path::kOneDnn;
  if (cl.local) {
    const Calibration& cal = cl.calibration;
    in.base = l.world() == 1                       ? cal.base_rss_single_bytes
              : l.world() > cl.per_node(l.world()) ? cal.base_rss_network_bytes
                                                   : cal.base_rss_bytes;
    // A rank maps a pair of shared-memory rings per same-host peer (its send and its receive
    // ring, touched at connect: fabric/shm_ring.h). The base of ranks on one host holds one
    // peer's pair; the network base, measured without shm, none.
    const int peers = cl.per_node(l.world()) - 1, counted = l.world() > cl.per_node(l.world()) ? 0 : 1;
    // (Read from this process's environment: the runs are planned under the same settings.)
    // TRN_FABRIC_SHM unset: shm on (fabric/connect.cc).
    const bool shm = settings::get("TRN_FABRIC_SHM").empty() || settings::get_bool("TRN_FABRIC_SHM");
    if (l.world() > 1 && peers > counted && shm && settings::get_bool("TRN_FABRIC_RING")) {
      const size_t eager = size_t(settings::get_int("TRN_FABRIC_RING_EAGER"));
      const double pair = 2.0 * double(fabric::ring_capacity_for(eager) + sizeof(fabric::RingControl));
      in.base += double(peers - counted) * pair;
    }
  }
  in.counter = &counts;
  in.moe_rows = job.moe_loads.busiest(l.ep, true);
  in.moe_rows_anywhere = job.moe_loads.busiest_anywhere(l.ep);
  return parallel::memory(l, job.model, job.global_batch, job.seq_len, in);
}

}  // namespace

double Prediction::tokens_per_s() const { return step_s > 0 ? double(global_batch) * seq_len / step_s : 0; }

TpCalls tp_calls(const model::Config& c, size_t n) {
  const size_t C = size_t(c.d_model);
  const TpCall whole{n * C};
  TpCalls t;
  if (!c.sequence_parallel) {
    t.embedding_fwd = {whole};         // the vocabulary-parallel lookup: one rank holds each row
    t.block_fwd = {whole, whole};      // the row-parallel attention and MLP outputs
    t.block_bwd = {whole, whole};      // the column-parallel inputs' gradients
    t.head_fwd = {{n}, {2 * n}};       // the cross-entropy's row max, then its sums
    t.head_bwd = {whole};              // the vocabulary-parallel head's input gradient
    return t;
  }
  // Sequence parallelism: each all-reduce becomes a gather before the column-parallel block and
  // a reduce-scatter after the row-parallel one; backward first gathers the two norms' outputs
  // again (recompute_inputs), and sums each norm's weight gradient (GPT-2's with its bias).
  const TpCall half{n * C, true};
  const TpCall norm{model::family(c.arch).block_counts(c).norm_params};  // (a LayerNorm's with its bias)
  t.embedding_fwd = {half};                     // the lookup reduce-scattered
  t.embedding_bwd = {half};                     // the residual gradient gathered
  t.block_fwd = {half, half, half, half};       // ln1 gathered, attention's output scattered, ln2, MLP's
  t.block_bwd = {half, half,                    // ln1 and ln2 gathered again
                 half, half, norm,              // MLP: the output gradient gathered, the input's scattered
                 half, half, norm};             // attention: the same
  t.head_fwd = {half, {n}, {2 * n}};            // the final norm gathered, the cross-entropy's
  t.head_bwd = {half, norm};                    // the input gradient scattered, the final norm's
  return t;
}

CpTraffic cp_traffic(const model::Config& c, const Layout& l, int B, int seq_len) {
  CpTraffic t;
  if (l.cp <= 1) return t;
  const double tokens = double(B) * l.local_seq_len(seq_len), hd = c.head_dim();
  const double H = double(c.n_head) / l.tp, K = double(c.kv_heads()) / l.tp;
  const double share = double(l.cp - 1) / l.cp;
  if (l.cp_comm == cp::Comm::kRing) {
    t.block = 4 * 2 * K * hd * tokens;
    t.fwd_bytes = (l.cp - 1) * t.block;
    t.bwd_bytes = (l.cp - 1) * t.block + l.cp * t.block;
  } else {
    const double qkv = 4 * (H + 2 * K) * hd * tokens, out = 4 * H * hd * tokens;
    t.a2a_fwd = {qkv, out};
    t.a2a_bwd = {qkv, 2 * out, qkv};
    for (double x : t.a2a_fwd) t.fwd_bytes += share * x;
    for (double x : t.a2a_bwd) t.bwd_bytes += share * x;
  }
  return t;
}

CpCost cp_cost(const Cluster& cl, const model::Config& c, const Layout& l, int B, int seq_len, double attn_fwd_s) {
  CpCost r;
  if (l.cp <= 1) return r;
  const CpTraffic t = cp_traffic(c, l, B, seq_len);
  const int world = l.world(), per_node = cl.per_node(world);
  const HostLayout hl = group_layout(cp_group(l, 0), per_node);
  if (l.cp_comm == cp::Comm::kRing) {
    // The ring crosses between nodes at one rank of each node's share of the group; every cp group
    // with ranks on the node crosses at once, sharing its rails (as the tp and dp groups do).
    const bool same_node = hl.hosts == 1;
    const double msg = p2p_s(cl, same_node, size_t(t.block), crossing_streams(cl, hl, world));
    const double step_f = attn_fwd_s / l.cp, step_b = 2 * attn_fwd_s / l.cp;  // each step's attention
    r.link_fwd_s = (l.cp - 1) * msg;
    r.link_bwd_s = (2 * l.cp - 1) * msg;
    // Forward: steps 0 .. cp-2 send a block while computing one. Backward: those steps send the
    // keys and values on and the previous step's gradient sum; the last step's sum, and the wait
    // for the rank's own block's, come after the last computation.
    r.fwd_s = (l.cp - 1) * std::max(0.0, msg - step_f);
    r.bwd_s = (l.cp - 1) * std::max(0.0, 2 * msg - step_b) + msg;
  } else {
    // Pairwise exchange, every message posted at once (all_to_all_s).
    for (double x : t.a2a_fwd) r.link_fwd_s += all_to_all_s(cl, hl, l.cp, per_node, x);
    for (double x : t.a2a_bwd) r.link_bwd_s += all_to_all_s(cl, hl, l.cp, per_node, x);
    r.fwd_s = r.link_fwd_s;
    r.bwd_s = r.link_bwd_s;
  }
  return r;
}

double ep_rows_per_token(int E, int k, int ep) {
  if (ep <= 1) return 1;
  // P(no choice on a given rank) = C(E - E/ep, k) / C(E, k): k draws without replacement that
  // all miss the rank's E/ep experts.
  double miss = 1;
  for (int j = 0; j < k; ++j) miss *= std::max(0.0, double(E - E / ep - j) / double(E - j));
  return ep * (1 - miss);
}

EpTraffic ep_traffic(const model::Config& c, const Layout& l, int B, int seq_len) {
  EpTraffic t;
  if (!c.moe()) return t;
  t.rows_per_token = ep_rows_per_token(c.n_experts, c.top_k, l.ep);
  if (l.ep <= 1) return t;
  const double rows = double(B) * l.local_seq_len(seq_len) * t.rows_per_token;
  const double C = c.d_model, k = c.top_k, share = double(l.ep - 1) / l.ep;
  t.a2a_fwd = {4 * rows * (C + 2 * k), 4 * rows * C};
  t.a2a_bwd = {4 * rows * C, 4 * rows * (C + k)};
  for (double x : t.a2a_fwd) t.fwd_bytes += share * x;
  for (double x : t.a2a_bwd) t.bwd_bytes += share * x;
  return t;
}

EpCost ep_cost(const Cluster& cl, const model::Config& c, const Layout& l, int B, int seq_len) {
  EpCost r;
  if (!c.moe() || l.ep <= 1) return r;
  const EpTraffic t = ep_traffic(c, l, B, seq_len);
  const int per_node = cl.per_node(l.world());
  const HostLayout hl = group_layout(ep_group(l, 0), per_node);
  for (double x : t.a2a_fwd) r.fwd_s += all_to_all_s(cl, hl, l.ep, per_node, x);
  for (double x : t.a2a_bwd) r.bwd_s += all_to_all_s(cl, hl, l.ep, per_node, x);
  return r;
}

StepResult simulate_step(const StepInput& in) {
  const pipeline::Kind kind = in.schedule;
  const pipeline::Shape shape{in.P, in.M, in.V};
  const int VS = shape.virtual_stages();
  const int per_chunk = in.n_layer / VS;
  const PieceCost& k = in.cost;
  const bool zb = kind == pipeline::Kind::kZeroBubble;
  auto fwd = [&](int v) {
    return (v == 0 ? k.embedding_fwd : 0) + per_chunk * k.block_fwd + (v == VS - 1 ? k.head_fwd : 0);
  };
  auto bwd = [&](int v) {
    const double blk = zb ? k.block_bwd_input : k.block_bwd;
    return (v == 0 ? k.embedding_bwd : 0) + per_chunk * blk + (v == VS - 1 ? k.head_bwd : 0);
  };
  auto wgt = [&](int) { return per_chunk * k.block_bwd_weight; };

  std::vector<std::vector<pipeline::Action>> acts(in.P);
  for (int s = 0; s < in.P; ++s)
    acts[s] = in.P > 1 ? pipeline::actions(kind, s, shape) : pipeline::compute_order(kind, s, shape);
  // A fluid simulation: each stage runs its list; a computation is work that proceeds at the
  // rate the shared cores give (every running rank an equal share, at most one core's worth),
  // a receive waits for its message, a send leaves at once and arrives a transfer later.
  const double ranks_busy_per_stage = std::max(1.0, in.ranks_per_stage * in.threads);
  std::vector<size_t> idx(in.P, 0);
  std::vector<double> end(in.P, 0), work(in.P, 0), wall(in.P, 0), link_free_f(in.P, 0), link_free_b(in.P, 0);
  std::vector<double> remaining(in.P, 0), started(in.P, 0);
  std::vector<int> running_chunk(in.P, -1);
  std::vector<bool> running(in.P, false), grads_action(in.P, false);
  // When the last gradient pass (backward, or zb's weight pass) of each chunk started and how long it ran.
  std::vector<std::vector<std::pair<double, double>>> last_grad(in.P,
                                                                std::vector<std::pair<double, double>>(in.V));
  std::map<std::tuple<int, int, int>, double> arrival;  // (direction, virtual stage, mb) -> time
  // ZeRO-3's gathers (one stage): every pass is alike, so its waits are worked out once, at the
  // compute rate the stage runs at alone, and the stage idles that long before its forward and
  // before its backward (its cores free meanwhile).
  double stall_f = 0, stall_b = 0;
  if (!in.gathers.empty()) {
    if (in.P != 1) throw internal_error("plan: ZeRO-3's per-piece gathers are simulated on one stage only");
    const double rate = in.cores > 0 ? std::min(1.0, in.cores / ranks_busy_per_stage) : 1.0;
    const std::vector<StepInput::Gather>& g = in.gathers;
    const int D = std::max(0, in.prefetch);
    std::vector<double> cend(g.size(), 0);  // when each unit's compute ends
    double gfree = 0, fwd_end = 0, fwd_work = 0, bwd_work = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      // Gather i is issued when the pass begins (the first D + 1) or when unit i - D is asked
      // for, that is once unit i - D - 1 has computed.
      const double issued = i <= size_t(D) ? 0 : cend[i - size_t(D) - 1];
      gfree = std::max(gfree, issued) + g[i].seconds;
      const double start = std::max(i ? cend[i - 1] : 0.0, gfree);
      cend[i] = start + (g[i].fwd_work + g[i].bwd_work) / rate;
      if (g[i].fwd_work > 0) fwd_end = start + g[i].fwd_work / rate;
      fwd_work += g[i].fwd_work;
      bwd_work += g[i].bwd_work;
    }
    stall_f = std::max(0.0, fwd_end - fwd_work / rate);
    stall_b = std::max(0.0, cend.back() - fwd_end - bwd_work / rate);
  }
  std::vector<size_t> stalled_at(in.P, SIZE_MAX);  // the action whose gather wait began
  std::vector<double> stall_until(in.P, 0), gather_wait(in.P, 0);
  double now = 0;
  std::vector<double> wake(in.P);  // per event: when a waiting stage can go on (-1: not waiting)
  for (size_t events = 0;; ++events) {
    if (in.stop && events % 4096 == 4095 && in.stop())
      throw aborted_error("the {} schedule's simulation stopped", pipeline::to_string(in.schedule));
    std::fill(wake.begin(), wake.end(), -1.0);
    // A send of one stage may let another that was already visited go on: repeat until none can.
    for (bool moved = true; moved;) {
      moved = false;
      for (int s = 0; s < in.P; ++s) {
        while (!running[s] && idx[s] < acts[s].size()) {
          const pipeline::Action& a = acts[s][idx[s]];
          const int v = shape.virtual_stage(s, a.chunk);
          if (a.op == pipeline::Op::kRecvF || a.op == pipeline::Op::kRecvB) {
            const auto it = arrival.find({a.op == pipeline::Op::kRecvF ? 0 : 1, v, a.mb});
            if (it == arrival.end()) break;
            if (it->second > now) {
              wake[s] = it->second;
              break;
            }
            wake[s] = -1;
          } else if (a.op == pipeline::Op::kSendF || a.op == pipeline::Op::kSendB) {
            const bool f = a.op == pipeline::Op::kSendF;
            double& free = f ? link_free_f[s] : link_free_b[s];
            const double start = std::max(now, free);
            const double x = in.P > 1 ? in.transfer_s : 0;
            free = start + x;
            arrival[{f ? 0 : 1, f ? v + 1 : v - 1, a.mb}] = start + x;
          } else {
            const double stall = a.op == pipeline::Op::kForward ? stall_f : a.op == pipeline::Op::kBackward ? stall_b : 0;
            if (stall > 0 && stalled_at[s] != idx[s]) {
              stalled_at[s] = idx[s];
              stall_until[s] = now + stall;
              gather_wait[s] += stall;
            }
            if (stalled_at[s] == idx[s] && stall_until[s] > now) {
              wake[s] = stall_until[s];
              break;
            }
            const double d = a.op == pipeline::Op::kForward    ? fwd(v)
                             : a.op == pipeline::Op::kBackward ? bwd(v)
                                                               : wgt(v);
            running[s] = true;
            remaining[s] = d;
            started[s] = now;
            running_chunk[s] = a.chunk;
            grads_action[s] = a.op == (zb ? pipeline::Op::kWeight : pipeline::Op::kBackward);
            work[s] += d;
          }
          ++idx[s];
          moved = true;
        }
      }
    }
    int active = 0;
    bool all_done = true;
    for (int s = 0; s < in.P; ++s) {
      active += running[s];
      all_done = all_done && !running[s] && idx[s] == acts[s].size();
    }
    if (all_done) break;
    const double rate =
        in.cores > 0 ? std::min(1.0, in.cores / (double(active) * ranks_busy_per_stage)) : 1.0;
    double next = std::numeric_limits<double>::infinity();
    for (int s = 0; s < in.P; ++s) {
      if (running[s])
        next = std::min(next, now + remaining[s] / rate);
      else if (wake[s] > now)
        next = std::min(next, wake[s]);
    }
    if (!std::isfinite(next))
      throw internal_error("plan: the {} schedule's simulation stalled", pipeline::to_string(in.schedule));
    const double dt = next - now;
    for (int s = 0; s < in.P; ++s) {
      if (!running[s]) continue;
      remaining[s] -= dt * rate;
      if (remaining[s] <= 1e-12 * std::max(1.0, next)) {
        running[s] = false;
        end[s] = next;
        wall[s] += next - started[s];
        if (grads_action[s]) last_grad[s][running_chunk[s]] = {started[s], next - started[s]};
      }
    }
    now = next;
  }
  StepResult r;
  r.busy_s = work;
  r.end_compute_s = end;
  r.end_sync_s.assign(in.P, 0);
  double worst = -1;
  for (int s = 0; s < in.P; ++s) {
    double engine = 0;
    if (s < int(in.buckets.size())) {
      for (const StepInput::Bucket& b : in.buckets[s]) {
        // The bucket is final once the piece that finishes it ran in its chunk's last gradient
        // pass; the pass's wall time is shared out over its pieces in proportion to their work.
        const int layer = b.after_block;
        int v = 0;
        if (layer == kHeadBlock)
          v = VS - 1;
        else if (layer == kEmbeddingBlock)
          v = 0;
        else
          v = layer / std::max(1, per_chunk);
        if (shape.stage_of(v) != s)
          v = shape.virtual_stage(s, std::min(in.V - 1, std::max(0, shape.chunk_of(v))));
        const int ch = shape.chunk_of(v);
        const auto [start, took] = last_grad[s][ch];
        const double total = zb ? wgt(v) : bwd(v);
        const double blk = zb ? k.block_bwd_weight : k.block_bwd;
        const double head = (!zb && v == VS - 1) ? k.head_bwd : 0;
        double done_work;
        if (layer == kHeadBlock)
          done_work = head;
        else if (layer == kEmbeddingBlock)
          done_work = total;
        else
          done_work = head + (v * per_chunk + per_chunk - layer) * blk;
        // Under zb the executor reports the whole buffer once, after the step (pipeline.cc).
        const double ready = zb ? end[s] : start + (total > 0 ? took * std::min(1.0, done_work / total) : 0);
        engine = std::max(engine, ready) + b.seconds;
      }
    }
    r.end_sync_s[s] = engine;
    const double finish = std::max(end[s], engine);
    if (finish > worst) {
      worst = finish;
      r.step_s = finish;
      r.wall_busy_s = wall[s];
      r.bubble_s = std::max(0.0, end[s] - wall[s] - gather_wait[s]);
      r.gather_wait_s = gather_wait[s];
      r.dp_exposed_s = std::max(0.0, engine - end[s]);
    }
  }
  return r;
}

namespace {

// The layout's fields of a prediction, and whether it runs (trn-train's reason when not).
Prediction checked(const Job& job, const Layout& l, const Cluster& cl) {
  Prediction p;
  p.layout = l;
  p.global_batch = job.global_batch;
  p.seq_len = job.seq_len;
  // model::flops_per_token counts attention's whole T x T square (its term is linear in T); a
  // causal model computes half of it, as the compute charged here does.
  const double square = model::flops_per_token(job.model, job.seq_len),
               none = model::flops_per_token(job.model, 0);
  p.model_flops = (none + (square - none) / 2) * double(job.global_batch) * job.seq_len;
  if (cl.world() > 0 && l.world() != cl.world()) {
    p.runs = false;
    p.why_not = fmt::format("{} ranks, but the cluster has {}", l.world(), cl.world());
  } else if (std::string why = why_runs_not(job, l); !why.empty()) {
    p.runs = false;
    p.why_not = why;
  }
  return p;
}

// The memory per rank of a layout that runs, and whether it fits a rank's share of the node.
void count_memory(const Job& job, const Cluster& cl, MemoryCounts& counts, Prediction* p) {
  p->memory = memory_of(job, p->layout, cl, counts);
  const double have = cl.rank_memory(p->layout.world());
  if (have > 0 && p->memory.total() > have) {
    p->fits = false;
    p->why_not = fmt::format("won't fit: needs {:.1f} GiB per rank of {:.1f}",
                             p->memory.total() / (kMiB * 1024), have / (kMiB * 1024));
  }
}

// The compute threads of a layout's ranks that share one host's cores: the whole world's on a
// test bed whose hosts are this machine, else a node's.
int threads_sharing_cores(const Cluster& cl, int world, int threads) {
  return (cl.hosts_share_cores ? world : cl.per_node(world)) * std::max(1, threads);
}

// A local host whose ranks outnumber its cores: every message waits, beyond the link's alpha, for
// its peer to be scheduled (Calibration::oversubscribed_alpha_us, measured there); behind: a
// message of a collective that runs while the ranks compute waits for its peer's engine thread
// to get a core from them (oversubscribed_behind_alpha_us).
Cluster oversubscribed(const Cluster& cl, const Layout& l, int threads, bool behind) {
  Cluster o = cl;
  const Calibration& cal = cl.calibration;
  // (Behind the compute a message waits at least as long as for a caller: the larger figure.)
  const double alpha = behind ? std::max(cal.oversubscribed_behind_alpha_us, cal.oversubscribed_alpha_us)
                              : cal.oversubscribed_alpha_us;
  const double extra = alpha - cal.intra.alpha_us;
  if (cl.local && threads_sharing_cores(cl, l.world(), threads) > cl.cpu_cores && extra > 0) {
    o.links.intra.alpha_us += extra;
    o.links.inter.alpha_us += extra;
  }
  return o;
}

// The step time and its breakdown of a layout that runs.
void time_step(const Job& job, const Cluster& cluster, const std::function<bool()>& stop, Prediction* pred) {
  const Layout& l = pred->layout;
  Prediction& p = *pred;
  const Cluster over = cluster.local ? oversubscribed(cluster, l, job.threads, false) : Cluster{};
  const Cluster& cl = cluster.local ? over : cluster;
  // The links of the collectives that run behind the compute (data-parallel buckets and the
  // hybrid replicate sums, ZeRO-3's prefetched gathers, context parallelism's ring, pipeline
  // sends): on an oversubscribed local host their messages wait longer (oversubscribed()).
  const Cluster over_behind = cluster.local ? oversubscribed(cluster, l, job.threads, true) : Cluster{};
  const Cluster& bcl = cluster.local ? over_behind : cluster;
  const int world = l.world(), per_node = cl.per_node(world);
  const int B = micro_batch(job, l);
  const size_t n_tokens = size_t(B) * l.local_seq_len(job.seq_len);  // a cp rank's share of each sequence

  // Compute per piece, per micro-batch.
  PieceTimes pt;
  double attention_s = 0;  // the block forward's attention
  // On CPU workers the ranks share the cores: the step's simulation shares them out; the
  // optimizer runs on every rank at once.
  const double cores = cl.local ? double(cl.cpu_cores) * (cl.hosts_share_cores ? 1 : cl.nodes) : 0;
  const double oversubscribed = cores > 0 ? std::max(1.0, double(world) * job.threads / cores) : 1;
  if (cl.local) {
    const Calibration& cal = cl.calibration;
    if (!cal.has_tp(l.tp))
      throw usage_error(
          "the calibration in {} has no --tp {} (it measured {}); run trn-plan calibrate with --max-tp {}",
          cl.source, l.tp, cal.pieces.empty() ? 0 : cal.pieces.rbegin()->first, l.tp);
    // A cp rank computes 1/cp of every piece: each token's own work for its T / cp tokens, and
    // (balanced) 1/cp of the sequence's causal attention. Its share of the block forward is the
    // attention's share of the block's FLOPs.
    pt = cal.at(l.tp, B).scaled(1.0 / l.cp);
    // Ranks that share a host's cores run slower than one alone (its shared caches, memory
    // bandwidth and clock): the calibration's busy_scale with every core busy, in proportion to
    // the cores the host's ranks keep busy beyond the first.
    const int sharing = threads_sharing_cores(cl, world, job.threads);
    if (cl.cpu_cores > 1 && sharing > 1) {
      const double busy = double(std::min(sharing, cl.cpu_cores) - 1) / (cl.cpu_cores - 1);
      pt = pt.scaled(1 + (cal.busy_scale - 1) * busy);
    }
    // Ranks of one job sharing a host's cores wait for each other (Calibration::ranks_scale);
    // ZeRO-3's gathers run beside the compute on the same cores (zero3_scale).
    if (world > 1 && (cl.hosts_share_cores ? world : per_node) > 1) pt = pt.scaled(cal.ranks_scale);
    if (l.zero_stage() == 3) pt = pt.scaled(cal.zero3_scale);
    const BlockShape sh = block_shape(job.model, l.tp);
    const double attn = attention_flops(sh, B, job.seq_len, l.cp);
    attention_s = pt.block_fwd * attn / (attn + 2 * double(n_tokens) * sh.matmul);
  } else {
    pt = device_pieces(cl, job.model, l.tp, B, job.seq_len, l.cp, &attention_s);
  }
  // A rank's compute threads split its micro-batch (one stage) or its matmuls (a pipeline
  // stage): the one-thread times over the threads that have work, the calibration's
  // measurement being of one thread (a device's rates are the device's whatever the threads).
  // A pipeline stage runs its schedule on one thread (only its GEMMs take more): no split.
  const double split = cl.local && l.pp == 1 ? double(std::max(1, std::min(job.threads, B))) : 1.0;
  PieceCost k;
  static_cast<PieceTimes&>(k) = pt.scaled(1 / split);
  double regather_s = 0;  // sequence parallelism's two norm re-gathers in a kept block's backward
  if (l.tp > 1) {
    const HostLayout hl = group_layout(tp_group(l, 0), per_node);
    model::Config c = job.model;
    c.sequence_parallel = l.sequence_parallel;
    const TpCalls calls = tp_calls(c, n_tokens);
    k.tp_fwd_block = seconds_of(cl, hl, calls.block_fwd, world);
    k.tp_bwd_block = seconds_of(cl, hl, calls.block_bwd, world);
    const double e_f = seconds_of(cl, hl, calls.embedding_fwd, world),
                 h_f = seconds_of(cl, hl, calls.head_fwd, world);
    const double e_b = seconds_of(cl, hl, calls.embedding_bwd, world), h_b = seconds_of(cl, hl, calls.head_bwd, world);
    k.block_fwd += k.tp_fwd_block;
    k.block_bwd += k.tp_bwd_block;
    k.block_bwd_input += k.tp_bwd_block;
    k.embedding_fwd += e_f;
    k.embedding_bwd += e_b;
    k.head_fwd += h_f;
    k.head_bwd += h_b;
    k.tp_fwd_ends = e_f + h_f;
    k.tp_bwd_ends = e_b + h_b;
    if (l.sequence_parallel) {
      const TpCall half{n_tokens * size_t(job.model.d_model), true};
      regather_s = seconds_of(cl, hl, {half, half}, world);
    }
  }
  if (l.cp > 1) {
    // Context parallelism's exchange in every block's attention, beyond what its compute hides
    // (cp_cost); zero-bubble's input pass holds attention's backward.
    // (The ring's messages travel behind attention; the all-to-all's are waited for.)
    const CpCost cc =
        cp_cost(l.cp_comm == cp::Comm::kRing ? bcl : cl, job.model, l, B, job.seq_len, attention_s / split);
    k.cp_fwd_block = cc.fwd_s;
    k.cp_bwd_block = cc.bwd_s;
    k.block_fwd += cc.fwd_s;
    k.block_bwd += cc.bwd_s;
    k.block_bwd_input += cc.bwd_s;
  }
  if (l.ep > 1 && job.model.moe()) {
    // Expert parallelism's all-to-alls in every MoE block (ep_cost), waited for: the experts
    // cannot run before their rows arrive, nor the combine before they return.
    EpCost ec = ep_cost(cl, job.model, l, B, job.seq_len);
    // On measured routing (Job::moe_loads) each layer's busiest rank runs `busy` x a balanced
    // load's expert rows and the others wait for it in the exchange that returns them: the
    // expert part of the block's compute (its matmuls' share of the time outside attention),
    // (busy - 1) times over, forward and backward.
    if (const double busy = job.moe_loads.busiest(l.ep, false); busy > 1) {
      const BlockShape sh = block_shape(job.model, l.tp);
      const double share = sh.matmul > 0 ? sh.experts / sh.matmul : 0;
      ec.fwd_s += (busy - 1) * share * std::max(0.0, (pt.block_fwd - attention_s) / split);
      ec.bwd_s += (busy - 1) * share * std::max(0.0, (pt.block_bwd - 2 * attention_s) / split);
    }
    k.ep_fwd_block = ec.fwd_s;
    k.ep_bwd_block = ec.bwd_s;
    k.block_fwd += ec.fwd_s;
    k.block_bwd += ec.bwd_s;
    k.block_bwd_input += ec.bwd_s;
  }
  if (const int rc = l.recomputed_layers(); rc > 0) {
    // Full recomputation reruns a recomputed block's forward (its tensor-parallel sums too) at
    // the start of its backward: the chunk's first min(rc, blocks) blocks, spread over its blocks.
    const int per_chunk = std::max(1, job.model.n_layer / (l.pp * l.virtual_stages));
    const double share = double(std::min(rc, per_chunk)) / per_chunk;
    // (A recomputed block's forward gathers its norms' outputs itself: no re-gathers.)
    k.block_bwd += share * (k.block_fwd - regather_s);
    k.block_bwd_input += share * (k.block_fwd - regather_s);
  } else if (l.recompute == parallel::Recompute::kSelective) {
    // Selective recomputation reruns elementwise passes only: the two norms (each about 8
    // operations per element of N x C) and the MLP's selective activation (BlockCounts: GPT-2's
    // GELU, about 20 per element of its N x 4C/tp input), charged as their share of the block
    // forward's operations, which its matmuls' 2 x parameters per token dominate. Measured: 0.1% (Llama) and 2.8% (GPT-2) of a step at
    // d_model 256 (bench/results/2026-12-06-recompute.md); less at larger widths.
    const model::Config& c = job.model;
    const double C = c.d_model, F = c.ffn(), tp = l.tp;
    // (Under sequence parallelism a norm covers the rank's N / tp rows, and runs again in every mode.)
    const model::BlockCounts bc = model::family(c.arch).block_counts(c);
    const double elementwise = (l.sequence_parallel ? 0 : 16 * C) + bc.mlp_activation_ops * F / tp;
    const double matmuls = 2 * (4 * C * C + bc.mlp_weights) / tp;
    const double share = elementwise / (elementwise + matmuls);
    k.block_bwd += share * k.block_fwd;
    k.block_bwd_input += share * k.block_fwd;
  }

  StepInput in;
  in.schedule = l.pp > 1 ? l.schedule : parallel::Schedule::k1F1B;
  in.P = l.pp;
  in.M = l.micro_batches;
  in.V = l.virtual_stages;
  in.n_layer = job.model.n_layer;
  in.cost = k;
  in.cores = cores;
  in.ranks_per_stage = l.dp * l.cp * l.tp;
  in.threads = job.threads;
  in.stop = stop;
  if (l.pp > 1) {
    // Every boundary s -> s + 1 (and interleaved's P - 1 -> 0) takes the slowest one's time; a
    // stage's sends travel while both stages compute (bcl).
    double slowest = 0;
    for (int s = 0; s < l.pp; ++s) {
      const bool same = rank_of(l, s) / per_node == rank_of(l, (s + 1) % l.pp) / per_node;
      // A stage sends its rows: 1/tp of them under sequence parallelism.
      const double rows = l.sequence_parallel ? double(n_tokens) / l.tp : double(n_tokens);
      slowest =
          std::max(slowest, p2p_s(bcl, same, rows * job.model.d_model * sizeof(float), same ? 1 : per_node));
    }
    // (Every rank of a node sends its activations to the next stage at once.)
    in.transfer_s = slowest;
  }
  // Data-parallel buckets of every stage.
  double optimizer_s = 0, checkpoint_s = 0, ends_s = 0, dp_bytes = 0;
  std::vector<std::vector<StepInput::Bucket>> buckets(l.pp);
  for (int s = 0; s < l.pp; ++s) {
    const model::ParamLayout lay(job.model, placement_of(job.model, l, s));
    const double P = double(lay.total());
    const int zero = l.zero_stage();
    // ZeRO-3 on one stage gathers each unit before it computes (simulated with the step); a
    // pipeline stage gathers its chunks with its action list's UNSHARDs (below). Under bf16 a
    // block or head travels packed, 2 bytes an element; the embedding in fp32 (model/sharded.h).
    const bool unit_gathers = zero == 3 && l.pp == 1;
    const bool chunk_gathers = zero == 3 && l.pp > 1;
    const bool bf16_wire = job.model.precision == model::Precision::kBf16;
    double gather_s = 0;
    if (l.replicas() > 1) {
      // Hybrid sharding (a shard group of S < replicas, no ep): ZeRO's reduce-scatter, gathers
      // and all-gather after AdamW run over the shard group (hl), and each bucket's shard is then
      // all-reduced over the replicate group (rhl: 1/S of the bucket's bytes over replicas / S).
      const bool hybrid = l.zero && l.ep <= 1 && l.dp_replicate() > 1;
      const HostLayout hl = group_layout(hybrid ? shard_group(l, s) : dp_group(l, s), per_node);
      const int streams = crossing_streams(cl, hl, world);
      HostLayout rhl;
      int rstreams = 1;
      if (hybrid) {
        rhl = group_layout(replicate_group(l, s), per_node);
        rstreams = crossing_streams(cl, rhl, world);
      }
      const double wire = l.grad_wire == parallel::GradWire::kBF16 ? 2 : l.grad_wire == parallel::GradWire::kFP8 ? 1 : 4;
      const size_t per_bucket = std::max<size_t>(1, size_t(l.bucket_mb * kMiB) / sizeof(float));
      const model::Placement place = placement_of(job.model, l, s);
      const bool has_embedding =
          place.chunks.empty() || std::any_of(place.chunks.begin(), place.chunks.end(),
                                              [](const model::Chunk& c) { return c.embedding; });
      const std::vector<Finisher> fin = finishers(lay, has_embedding);
      // Expert parallelism: the experts' gradients are summed over the replicas holding the same
      // experts (expert_dp_group: replicas / ep of them), the rest over all replicas; a bucket
      // holding both is two all-reduces. (Its tensors' ranges, in buffer order.)
      std::vector<std::pair<size_t, size_t>> expert_ranges;
      const int expert_replicas = std::max(1, l.replicas() / std::max(1, l.ep));
      HostLayout ehl;
      int estreams = 1;
      if (l.ep > 1) {
        for (const model::TensorSpec& t : lay.tensors())
          if (parallel::is_expert(t.name)) expert_ranges.emplace_back(t.offset, t.offset + t.numel);
        std::sort(expert_ranges.begin(), expert_ranges.end());
        ehl = group_layout(expert_dp_group(l, s), per_node);
        estreams = crossing_streams(cl, ehl, world);
      }
      // The seconds of all-reducing `dense` bytes over the replicas and `experts` over theirs, on
      // links c (bcl for the buckets, which run behind the backward).
      auto sync_s = [&](const Cluster& c, double dense, double experts) {
        if (l.ep <= 1) return allreduce_s(c, hl, size_t(dense + experts), streams);
        return (dense > 0 ? allreduce_s(c, hl, size_t(dense), streams) : 0.0) +
               (experts > 0 ? allreduce_s(c, ehl, size_t(experts), estreams) : 0.0);
      };
      // The piece that finishes the buffer's last bucket: the backward's last.
      const auto last_finisher = std::lower_bound(fin.begin(), fin.end(), lay.total(),
                                                  [](const Finisher& x, size_t v) { return x.end < v; });
      size_t next_range = 0;  // the first expert range not wholly before the bucket
      double experts_total = 0;
      for (const auto& [rb, re] : expert_ranges) experts_total += double(re - rb);
      for (size_t b = 0; b < lay.total(); b += per_bucket) {
        const size_t e = std::min(lay.total(), b + per_bucket);
        const auto f = std::lower_bound(fin.begin(), fin.end(), e,
                                        [](const Finisher& x, size_t v) { return x.end < v; });
        double in_experts = 0;  // the bucket's expert elements
        while (next_range < expert_ranges.size() && expert_ranges[next_range].second <= b) ++next_range;
        for (size_t i = next_range; i < expert_ranges.size() && expert_ranges[i].first < e; ++i)
          in_experts += double(std::min(e, expert_ranges[i].second) - std::max(b, expert_ranges[i].first));
        // A bucket runs behind the rest of the backward (bcl), but those the backward's last
        // piece finishes (the buffer's end: chunks and their pieces sit in it in backward order),
        // which the ranks wait for (cl).
        const Cluster& on = f == last_finisher ? cl : bcl;
        double secs = sync_s(on, (double(e - b) - in_experts) * wire, in_experts * wire);
        if (l.zero) secs /= 2;  // a reduce-scatter: the all-reduce's first half
        if (hybrid) secs += allreduce_s(on, rhl, size_t(double(e - b) * wire / l.dp_shard()), rstreams);
        buckets[s].push_back({f == fin.end() ? kEmbeddingBlock : f->block, secs});
      }
      // A ring's share of each collective: what one rank sends; the experts' over their replicas.
      // Hybrid: the shard group's reduce-scatter and gathers, and the replicate group's all-reduce
      // of the shard.
      const int sharders = hybrid ? l.dp_shard() : l.replicas();
      const double share = double(sharders - 1) / sharders;
      const double eshare = double(expert_replicas - 1) / expert_replicas;
      const double synced = l.ep > 1 ? share * (P - experts_total) + eshare * experts_total : share * P;
      const bool after_adamw = l.zero && zero < 3;  // ZeRO-1 and 2 all-gather the update
      const double replicated =
          hybrid ? 2.0 * (l.dp_replicate() - 1) / l.dp_replicate() * P / l.dp_shard() * wire : 0.0;
      dp_bytes =
          std::max(dp_bytes, (l.zero ? 1 : 2) * synced * wire + replicated + (after_adamw ? 4 * synced : 0));
      if (after_adamw)  // the all-reduce's other half
        gather_s = sync_s(cl, 4 * (P - experts_total), 4 * experts_total) / 2;
      if (chunk_gathers) {
        // The UNSHARDs of the stage's list (pipeline::with_sharding): those before its first
        // computation are waited for, as ZeRO-1's gather after AdamW is; the rest are issued
        // `prefetch` computations ahead and counted hidden, their bytes still on the links.
        const parallel::StageCounter::Params sp = parallel::stage_params(lay);
        const pipeline::Shape shape = l.pipeline();
        const auto list = pipeline::with_sharding(pipeline::actions(l.schedule, s, shape), l.schedule, s, shape,
                                                  l.prefetch);
        double first = 0, rest = 0;
        bool computed = false;
        for (const pipeline::Action& a : list) {
          computed = computed || a.op == pipeline::Op::kForward || a.op == pipeline::Op::kBackward ||
                     a.op == pipeline::Op::kWeight;
          if (a.op != pipeline::Op::kUnshard) continue;
          const parallel::StageCounter::Params::ChunkParams& ch = sp.chunks.at(size_t(a.chunk));
          // Packed: every element's high half, and the low half of each fp32 one.
          const double bytes = bf16_wire && 2 * ch.f32 <= ch.total ? 2 * (ch.total + ch.f32) : 4 * ch.total;
          (computed ? rest : first) += bytes;
        }
        gather_s = allreduce_s(cl, hl, size_t(first), streams) / 2;
        dp_bytes += share * (first + rest);
      }
      if (unit_gathers) {
        // The gathers of a pass in the order it asks for them (ShardedWeights::order_for): the
        // embedding, the blocks, the head (its forward and backward share one gather, and the
        // last block's two uses around it another), the blocks again from the one before the
        // last; the embedding's backward reads no weight. A unit is its tensors (stage_params'
        // gather units) on the gather communicator, timed with its border pieces (gather_of); the
        // bytes counted are its tensors'.
        const auto [begin, end] = lay.chunk_range(0);
        const model::TensorSpec* tied = lay.tied();
        size_t blocks_end = lay.head_end;
        for (const model::ParamLayout::Block& blk : lay.blocks) blocks_end = std::max(blocks_end, blk.end);
        double gathered = 0;  // bytes
        // A gather runs behind the compute (bcl) once prefetched; the pass's first, and every
        // one without prefetch, is waited for (cl). On the fp32 wire a unit is gathered bucket by
        // bucket (ShardedWeights): its whole buckets and, where the norm pieces run across the
        // buffer, the piece at each border its neighbours share (optim::unit_stops), each an
        // all-gather of its own (buckets end on pieces, so none is smaller than one there); under
        // bf16 a packed unit is one.
        const bool per_tensor = optim::per_tensor_pieces(l.tp, l.pp, l.ep);
        const double piece = double(optim::kSumChunk);
        const double bucket_elems = per_tensor ? double(per_bucket) : std::max(double(per_bucket), piece);
        auto gather_of = [&](double elements, bool packed) {
          const double bytes = elements * (packed && bf16_wire ? 2 : 4);
          const bool waited = gathered == 0 || l.prefetch <= 0;
          gathered += bytes;
          const Cluster& on = waited ? cl : bcl;
          if (packed && bf16_wire) return allreduce_s(on, hl, size_t(bytes), streams) / 2;
          // A border piece at each end (at most), the rest in whole buckets.
          const double pieces = per_tensor ? 0 : std::min(2.0, std::ceil(elements / piece));
          const double interior = std::max(0.0, elements - pieces * piece);
          const double whole = interior > 0 ? std::ceil(interior / bucket_elems) : 0;
          double s = pieces * allreduce_s(on, hl, size_t(4 * std::min(piece, elements)), streams);
          if (whole > 0) s += whole * allreduce_s(on, hl, size_t(4 * interior / whole), streams);
          return s / 2;
        };
        const double head = double(lay.head_end - begin) + (tied ? double(tied->numel) : 0.0);
        std::vector<StepInput::Gather>& g = in.gathers;
        g.push_back({gather_of(double(end - blocks_end), false), k.embedding_fwd, 0});
        for (const model::ParamLayout::Block& blk : lay.blocks)
          g.push_back({gather_of(double(blk.end - blk.begin), true), k.block_fwd, 0});
        g.push_back({gather_of(head, true), k.head_fwd, k.head_bwd});
        if (!lay.blocks.empty()) g.back().bwd_work += k.block_bwd;  // the kept last block's backward
        for (auto it = lay.blocks.rbegin() + (lay.blocks.empty() ? 0 : 1); it != lay.blocks.rend(); ++it)
          g.push_back({gather_of(double(it->end - it->begin), true), 0, k.block_bwd});
        in.prefetch = l.prefetch;
        dp_bytes += share * gathered * l.micro_batches;
      }
    }
    // AdamW and the norm over the owned parameters, on the rank's threads: under ZeRO 1/dp_shard
    // of the rank's (under ep the shard group is the replicas holding the same experts:
    // parallel::memory's count).
    const double owned = l.zero ? P / l.dp_shard() : P;
    // ZeRO's all-gather follows AdamW on the same thread. ZeRO-2 and 3 then keep only the owned
    // shard of the averaged gradients: a copy of it.
    if (zero >= 2) gather_s += 4 * owned / (cl.local ? cl.calibration.copy_bytes_per_s : cl.memory_bytes_per_s / 2);
    if (cl.local) {
      optimizer_s = std::max(optimizer_s, gather_s + (owned * cl.calibration.adamw_s_per_param +
                                                      P * cl.calibration.norm_s_per_param) *
                                                         oversubscribed / std::max(1, job.threads));
    } else {
      optimizer_s = std::max(
          optimizer_s, gather_s + owned * 4 * 4 / cl.memory_bytes_per_s + P * 4 / cl.memory_bytes_per_s);
    }
    // Checkpoints: replica 0 writes params, m and v (ZeRO: every rank its owned part);
    // snapshots copy the same into memory.
    const double state = 12 * (l.zero ? owned : P);
    if (job.checkpoint_every > 0)
      checkpoint_s = std::max(checkpoint_s, state / cl.storage_bytes_per_s / job.checkpoint_every);
    if (job.snapshot_every > 0) {
      const double copy = cl.local ? cl.calibration.copy_bytes_per_s : cl.memory_bytes_per_s;
      checkpoint_s = std::max(checkpoint_s, state / copy / job.snapshot_every);
    }
  }
  if (l.replicas() > 1) in.buckets = buckets;
  // After the sync: the tied embedding's sum over the first and last stage, the loss over the
  // pipeline, the norm over the model-parallel group (a few bytes).
  if (l.pp > 1) {
    const model::ParamLayout first(job.model, placement_of(job.model, l, 0));
    if (const model::TensorSpec* tied = first.tied()) {
      const HostLayout hl = group_layout({rank_of(l, 0), rank_of(l, l.pp - 1)}, per_node);
      ends_s += allreduce_s(cl, hl, tied->numel * sizeof(float), crossing_streams(cl, hl, world));
    }
    std::vector<int> pp_ranks;
    for (int s = 0; s < l.pp; ++s) pp_ranks.push_back(rank_of(l, s));
    ends_s += allreduce_s(cl, group_layout(pp_ranks, per_node), 8, 1);
  }
  if (l.tp * l.pp > 1) {
    std::vector<int> mp;
    for (int s = 0; s < l.pp; ++s)
      for (int t = 0; t < l.tp; ++t) mp.push_back(rank_of(l, s) + t);
    ends_s += allreduce_s(cl, group_layout(mp, per_node), 8, 1);
  }
  // The norm's sum over the ep group, whose ranks hold different experts.
  if (l.ep > 1) ends_s += allreduce_s(cl, group_layout(ep_group(l, 0), per_node), 8, 1);

  const StepResult sim = simulate_step(in);
  // The same step with instant transfers: its idle time is the schedule's bubble, the rest of
  // the waiting is the transfers'.
  double bubble = sim.bubble_s;
  if (l.pp > 1) {
    StepInput instant = in;
    instant.transfer_s = 0;
    instant.buckets.clear();
    bubble = std::min(sim.bubble_s, simulate_step(instant).bubble_s);
  }
  p.step_s = sim.step_s + ends_s + optimizer_s + checkpoint_s;
  Breakdown& b = p.breakdown;
  const int mb_per_rank = l.micro_batches * l.virtual_stages;
  const int blocks = job.model.n_layer / (l.pp * l.virtual_stages);
  b.tp_comm = l.tp > 1 ? double(mb_per_rank) * (blocks * (k.tp_fwd_block + k.tp_bwd_block)) +
                             double(l.micro_batches) * (k.tp_fwd_ends + k.tp_bwd_ends) / std::max(1, l.pp)
                       : 0;
  b.cp_comm = double(mb_per_rank) * blocks * (k.cp_fwd_block + k.cp_bwd_block);
  b.ep_comm = double(mb_per_rank) * blocks * (k.ep_fwd_block + k.ep_bwd_block);
  b.compute = std::max(0.0, sim.wall_busy_s - b.tp_comm - b.cp_comm - b.ep_comm);
  b.bubble = bubble;
  b.pp_comm = std::max(0.0, sim.bubble_s - bubble);
  b.dp_exposed = sim.dp_exposed_s + sim.gather_wait_s;
  b.dp_bytes = dp_bytes;
  b.optimizer = ends_s + optimizer_s;
  b.checkpoint = checkpoint_s;
  const double peak =
      job.model.precision == model::Precision::kBf16 ? cl.matmul_flops_bf16 : cl.matmul_flops_fp32;
  if (!cl.local && peak > 0 && p.step_s > 0) p.mfu = p.model_flops / (p.step_s * world * peak);
}

}  // namespace

Prediction predict(const Job& job, const Layout& l, const Cluster& cl) {
  Prediction p = checked(job, l, cl);
  if (!p.runs) return p;
  time_step(job, cl, {}, &p);
  MemoryCounts counts;
  count_memory(job, cl, counts, &p);
  return p;
}

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

// The context-parallel sizes searched for a world of `world` ranks: powers of two that divide it
// and cut each sequence into 2 cp equal chunks, each rank keeping at least kMinCpTokens of every
// sequence (1 alone without a sequence length). Below that a rank's matmuls are a few hundred rows
// and a ring step's attention (quadratic in the chunk) too short to hide its transfer (linear in
// it); the sizes past it only lengthen the search (at seq 8,192 on 16,384 ranks, cp up to 4,096
// made it 10 times larger and 100 times slower). --layout takes any size check() takes.
constexpr int kMinCpTokens = 1024;
std::vector<int> cp_sizes(const Job& job, int world, int max_cp) {
  std::vector<int> out{1};
  for (int cp = 2; job.seq_len > 0 && world % cp == 0 && job.seq_len % (2 * cp) == 0 &&
                   job.seq_len / cp >= kMinCpTokens && (max_cp <= 0 || cp <= max_cp);
       cp *= 2)
    out.push_back(cp);
  return out;
}

// The expert-parallel sizes searched for `replicas` replicas of a mixture of experts: powers of
// two dividing the replicas and n_experts (each rank an equal share of every MoE layer's
// experts), up to max_ep (0: no bound); 1 alone for a dense model. check() takes any divisor;
// the powers of two are the presets' and the all-to-all's usual sizes.
std::vector<int> ep_sizes(const Job& job, int replicas, int max_ep) {
  std::vector<int> out{1};
  for (int ep = 2; job.model.moe() && replicas % ep == 0 && job.model.n_experts % ep == 0 &&
                   (max_ep <= 0 || ep <= max_ep);
       ep *= 2)
    out.push_back(ep);
  return out;
}

// The layouts worth simulating for a world of `world` ranks: every dp x tp x pp x cp that the
// model takes, micro-batches from pp up to the most the batch allows (powers of two), each
// schedule, virtual stages 2 and 4 for interleaved, ZeRO 0 to 3 (with one replica there is nothing
// to shard: 0 alone), ZeRO-3 with its default prefetch, the three recomputations, sequence
// parallelism where tp > 1.
//
// Context parallelism (cp > 1, each exchange that check() takes: ring, and all-to-all where the
// KV heads divide by tp x cp) only where a micro-batch is one sequence per rank. With B >= 2
// sequences per micro-batch, halving cp and doubling dp keeps each rank's tokens, attention work,
// activations and replicas (dp x cp) and exchanges less: such a layout is never better, so it is
// not considered. Context parallelism splits what data parallelism cannot.
//
// Expert parallelism (a mixture of experts): each ep of ep_sizes over the replicas, with every
// other choice (check() refuses what does not combine with it, ZeRO today).
std::vector<Layout> candidates(const Job& job, int world, const Cluster& cl, int max_cp, int max_ep) {
  std::vector<Layout> out;
  const int per_node = cl.per_node(world);
  for (int tp : divisors(world)) {
    if (tp > std::max(1, per_node) && cl.ranks_per_node > 0) continue;  // on devices tp stays inside a node
    try {
      model::check_tensor_parallel(job.model, tp);
    } catch (const Error&) {
      continue;
    }
    for (int cp : cp_sizes(job, world / tp, max_cp))
    for (int pp : divisors(world / tp / cp)) {
      if (job.model.n_layer % pp != 0) continue;
      const int dp = world / tp / cp / pp;
      if (job.global_batch % dp != 0) continue;
      const int per_replica = job.global_batch / dp;
      std::vector<int> ms;
      if (cp > 1)
        ms = {per_replica};  // one sequence per micro-batch
      else
        for (int m = 1; m <= per_replica; m *= 2)
          if (per_replica % m == 0) ms.push_back(m);
      using Comm = trn::cp::Comm;
      const std::vector<Comm> comms = cp > 1 ? std::vector<Comm>{Comm::kRing, Comm::kAllToAll} : std::vector<Comm>{Comm::kRing};
      const std::vector<int> eps = ep_sizes(job, dp * cp, max_ep);
      for (int m : ms) {
        using S = parallel::Schedule;
        const std::vector<S> schedules =
            pp > 1 ? std::vector<S>{S::k1F1B, S::kGpipe, S::kZeroBubble, S::kInterleaved} : std::vector<S>{S::k1F1B};
        for (const S sched : schedules) {
          std::vector<int> vs{1};
          if (sched == S::kInterleaved) vs = {2, 4};
          for (int v : vs) {
            for (int zero : dp * cp > 1 ? std::vector<int>{0, 1, 2, 3} : std::vector<int>{0})
              for (const parallel::Recompute rc :
                   {parallel::Recompute::kNone, parallel::Recompute::kSelective, parallel::Recompute::kFull})
                for (const bool seq : tp > 1 ? std::vector<bool>{false, true} : std::vector<bool>{false})
                  for (const Comm comm : comms)
                  for (const int ep : eps) {
                    Layout l;
                    l.dp = dp;
                    l.tp = tp;
                    l.pp = pp;
                    l.cp = cp;
                    l.cp_comm = comm;
                    l.micro_batches = m;
                    l.schedule = sched;
                    l.virtual_stages = v;
                    l.zero = zero;
                    l.recompute = rc;  // full: every block; plan() looks for the fewest that fit
                    l.sequence_parallel = seq;
                    l.ep = ep;
                    l.fp8_format = cl.fp8_format;
                    if (why_runs_not(job, l).empty()) out.push_back(l);
                  }
          }
        }
      }
    }
  }
  return out;
}

// Why a world of `world` ranks has no candidate, in one line: the largest grid the divisibility
// constraints allow when none uses every rank, else trn-train's reason for the first that does.
std::string why_none(const Job& job, int world, const Cluster& cl, int max_cp) {
  const int per_node = cl.per_node(world);
  int largest = 0, largest_tp = 1, largest_cp = 1;
  std::string refused;  // trn-train's reason for the first grid of `world` ranks
  for (int tp : divisors(world)) {
    if (tp > std::max(1, per_node) && cl.ranks_per_node > 0) continue;
    try {
      model::check_tensor_parallel(job.model, tp);
    } catch (const Error&) {
      continue;
    }
    largest_tp = std::max(largest_tp, tp);
    for (int cp : cp_sizes(job, world / tp, max_cp)) {
      largest_cp = std::max(largest_cp, cp);
      for (int pp : divisors(world / tp / cp)) {
        if (job.model.n_layer % pp != 0) continue;
        for (int dp : divisors(world / tp / cp / pp)) {
          if (job.global_batch % dp != 0) continue;
          largest = std::max(largest, dp * tp * pp * cp);
          if (dp * tp * pp * cp == world && refused.empty()) {
            Layout l;
            l.dp = dp;
            l.tp = tp;
            l.pp = pp;
            l.cp = cp;
            refused = why_runs_not(job, l);
          }
        }
      }
    }
  }
  if (largest < world)
    return fmt::format(
        "no layout uses all {} ranks: dp x tp x pp x cp must be {} with --dp dividing the global batch {}, --pp "
        "the {} layers, --tp at most {} (the heads{}) and --cp at most {} (a power of two, 2 cp dividing --seq-len "
        "{}); the largest such grid has {} ranks: plan for {} ranks or fewer, or a larger --global-batch",
        world, world, job.global_batch, job.model.n_layer, largest_tp,
        cl.ranks_per_node > 0 ? ", within a node" : "", largest_cp, job.seq_len, largest, largest);
  return fmt::format("no layout of {} ranks runs: {}", world, refused.empty() ? "every one is refused" : refused);
}

// The layouts of the search: every world's candidates.
std::vector<Layout> search_space(const Job& job, const Cluster& cl, int max_cp, int max_ep) {
  std::vector<int> worlds;
  if (cl.world() > 0)
    worlds = {cl.world()};
  else
    for (int w = cl.nodes; w <= cl.nodes * std::max(1, cl.cpu_cores); w += cl.nodes) worlds.push_back(w);
  std::vector<Layout> all;
  for (int world : worlds) {
    std::vector<Layout> cands = candidates(job, world, cl, max_cp, max_ep);
    if (cl.local && cl.world() == 0) {
      // On this machine's kind, a layout the calibration has no tp for cannot be predicted.
      std::erase_if(cands, [&](const Layout& l) { return !cl.calibration.has_tp(l.tp); });
    }
    all.insert(all.end(), cands.begin(), cands.end());
  }
  if (all.empty()) throw usage_error("{}", why_none(job, worlds.front(), cl, max_cp));
  return all;
}

}  // namespace

std::vector<Prediction> plan(const Job& job, const Cluster& cl, const Search& search) {
  const std::vector<Layout> space = search_space(job, cl, search.max_cp, search.max_ep);
  MemoryCounts counts;
  counts.stats = search.stats;
  counts.stop = search.stop;
  if (search.stats) *search.stats = {};
  std::vector<Prediction> all;
  size_t done = 0;
  std::vector<size_t> sharded;  // the ZeRO layouts of `all` that may take a hybrid shard group
  // The prediction of a layout with its memory counted (not yet timed).
  const auto counted = [&](const Layout& l) {
    Prediction p = checked(job, l, cl);
    if (p.runs) count_memory(job, cl, counts, &p);
    return p;
  };
  // A layout that does not fit is ranked by its memory: its step is not simulated.
  const auto add = [&](Prediction p) {
    if (p.runs && p.fits) {
      time_step(job, cl, search.stop, &p);
      if (search.stats) ++search.stats->simulated;
    } else {
      p.timed = false;
    }
    if (search.stats) ++search.stats->layouts;
    all.push_back(std::move(p));
  };
  for (const Layout& base : space) {
    if (search.stop && search.stop())
      throw aborted_error("the search stopped after {} of {} layouts", done, space.size());
    Prediction p = counted(base);
    // Full recomputation on the fewest blocks that fit (--recompute-layers N: the first N blocks
    // of each chunk). A block recomputed costs its forward again and saves its activations, so
    // time rises and memory falls with N: the smallest N that fits is the fastest full layout,
    // found by bisection on the memory count alone. (Recomputing every block is N = per chunk.)
    // (Every block recomputed fits whenever any N does, so only then is there an N to look for.)
    if (p.runs && p.fits && base.recompute == parallel::Recompute::kFull && base.recompute_layers == 0) {
      const int per_chunk = job.model.n_layer / (base.pp * base.virtual_stages);
      int lo = 1, hi = per_chunk;  // N = hi fits; the smallest that does is in [lo, hi]
      std::optional<Prediction> at_hi;
      while (lo < hi) {
        Layout l = base;
        l.recompute_layers = lo + (hi - lo) / 2;
        Prediction q = counted(l);
        if (search.stats) ++search.stats->probed;
        if (q.fits) {
          hi = l.recompute_layers;
          at_hi = std::move(q);
        } else {
          lo = l.recompute_layers + 1;
        }
      }
      if (at_hi) p = std::move(*at_hi);
    }
    if (p.runs && base.zero >= 1 && base.shard_group == 0 && base.ep <= 1 && base.replicas() >= 4)
      sharded.push_back(all.size());
    add(std::move(p));
    if (search.progress) search.progress(++done, space.size());
  }
  // Hybrid sharding (--shard-group S): ZeRO over S consecutive replicas, replicated across the
  // replicas / S groups. It holds replicas / S times the sharded state (AdamW's; the gradients
  // and weights too under ZeRO 2, 3) of sharding over all replicas, for a reduce-scatter and
  // gathers that stay inside S and an all-reduce of 1/S of the gradients across the groups.
  // Searched: the shard group that fills the replicas of one node (its collectives on the node's
  // links), or, when that does not fit, the smallest larger power of two that does. A group
  // smaller than a node's replicas moves more of the gradients over the slow links for no less
  // local traffic; a larger one than needed spreads the reduce-scatter over more nodes.
  // It changes only the data-parallel sync and ZeRO's gathers, so it cannot take from a step
  // more than the sharded layout's exposed sync, optimizer and transfer waits: a layout whose
  // step less those is no faster than the best found has no hybrid worth simulating.
  double best_s = std::numeric_limits<double>::infinity();
  for (const Prediction& p : all)
    if (p.runs && p.fits) best_s = std::min(best_s, p.step_s);
  const size_t based = all.size();
  for (size_t i : sharded) {
    if (i >= based) break;
    // A hybrid holds more than sharding over every replica: none fits where that does not.
    const Prediction& p = all[i];
    const Breakdown& b = p.breakdown;
    if (!p.fits || p.step_s - (b.dp_exposed + b.optimizer + b.pp_comm) >= best_s) continue;
    const Layout base = p.layout;
    const std::vector<int> replicas = dp_group(base, 0);
    const int per_node = cl.per_node(base.world());
    int on_node = 0;  // replicas on rank 0's node
    for (int r : replicas) on_node += r / per_node == replicas[0] / per_node;
    int S = 2;
    while (S < on_node) S *= 2;
    for (; S < base.replicas() && base.replicas() % S == 0; S *= 2) {
      if (search.stop && search.stop())
        throw aborted_error("the search stopped after {} of {} layouts", done, space.size());
      Layout l = base;
      l.shard_group = S;
      Prediction q = counted(l);
      if (search.stats) ++search.stats->probed;
      if (q.runs && q.fits) {
        add(std::move(q));
        break;
      }
    }
  }
  std::stable_sort(all.begin(), all.end(), [](const Prediction& a, const Prediction& b) {
    if (a.fits != b.fits) return a.fits;
    return a.fits ? a.step_s < b.step_s : a.memory.total() < b.memory.total();
  });
  if (all.size() > search.limit) all.resize(search.limit);
  return all;
}

std::string why_slower(const Prediction& p, const Prediction& best) {
  if (!p.runs) return p.why_not;
  if (!p.fits) return p.why_not;
  const Breakdown &a = p.breakdown, &b = best.breakdown;
  const double extra = p.step_s - best.step_s;
  if (extra <= 1e-9 * best.step_s) {
    const double more = p.memory.total() - best.memory.total();
    return more > 0 ? fmt::format("as fast, with {:.2f} GiB more memory per rank", more / (kMiB * 1024))
                    : "as fast";
  }
  // The part of the breakdown that grew the most names the reason.
  const std::pair<double, std::string> parts[] = {
      {a.compute - b.compute, "compute"},
      {a.tp_comm - b.tp_comm, "tensor-parallel communication"},
      {a.cp_comm - b.cp_comm, "context-parallel communication"},
      {a.ep_comm - b.ep_comm, "expert-parallel communication"},
      {a.bubble - b.bubble, fmt::format("pipeline bubble ({:.0f}% of its step)", 100 * a.bubble / p.step_s)},
      {a.pp_comm - b.pp_comm, "pipeline transfers"},
      {a.dp_exposed - b.dp_exposed, "exposed data-parallel communication"},
      {a.optimizer - b.optimizer, "optimizer and its communication"},
      {a.checkpoint - b.checkpoint, "checkpoints"},
  };
  const auto* worst = &parts[0];
  for (const auto& x : parts)
    if (x.first > worst->first) worst = &x;
  return fmt::format("{} (+{:.1f}%)", worst->second, 100 * extra / best.step_s);
}

}  // namespace trn::plan
