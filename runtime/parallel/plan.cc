#include "runtime/parallel/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <limits>

#include "collectives/core/error.h"
#include "runtime/context_parallel/attention.h"
#include "runtime/model/family.h"
#include "runtime/model/stage.h"
#include "runtime/optim/zero.h"
#include "runtime/pipeline_parallel/pipeline.h"

namespace trn::parallel {

GradWire parse_grad_wire(const std::string& name) {
  if (name == "f32" || name == "fp32") return GradWire::kF32;
  if (name == "bf16") return GradWire::kBF16;
  if (name == "fp8") return GradWire::kFP8;
  throw usage_error("--grad-comm takes f32, bf16 or fp8, got '{}'", name);
}

const char* to_string(GradWire w) {
  switch (w) {
    case GradWire::kF32: return "f32";
    case GradWire::kBF16: return "bf16";
    case GradWire::kFP8: return "fp8";
  }
  return "?";
}

Recompute parse_recompute(const std::string& name) {
  if (name == "none") return Recompute::kNone;
  if (name == "selective") return Recompute::kSelective;
  if (name == "full") return Recompute::kFull;
  throw usage_error("--recompute {}: choose none, selective or full", name);
}

const char* to_string(Recompute r) {
  switch (r) {
    case Recompute::kNone: return "none";
    case Recompute::kSelective: return "selective";
    case Recompute::kFull: return "full";
  }
  return "?";
}

model::Placement Plan::placement(const model::Config& c, int tp_rank, int pp_rank, int cp_rank, int ep_rank) const {
  model::Placement p{tp, tp_rank, {}};
  p.cp = cp;
  p.cp_rank = cp_rank;
  p.ep = ep;
  p.ep_rank = ep_rank;
  if (pp > 1) p.chunks = pipeline::chunks_of(c, pipeline(), pp_rank);
  return p;
}

std::string Plan::flags() const {
  std::string s = fmt::format("--dp {} --tp {} --pp {}", dp, tp, pp);
  if (cp != 1) s += fmt::format(" --cp {}", cp);
  if (cp != 1 && cp_comm != trn::cp::Comm::kRing) s += fmt::format(" --cp-comm {}", trn::cp::to_string(cp_comm));
  if (micro_batches != 1) s += fmt::format(" --micro-batches {}", micro_batches);
  if (pp > 1) s += fmt::format(" --schedule {}", pipeline::to_string(schedule));
  if (virtual_stages != 1) s += fmt::format(" --virtual-stages {}", virtual_stages);
  if (zero) s += fmt::format(" --zero {}", zero);
  if (zero == 3 && prefetch != 1) s += fmt::format(" --zero-prefetch {}", prefetch);
  if (shard_group > 0 && shard_group != dp) s += fmt::format(" --shard-group {}", shard_group);
  if (dp > 1 && bucket_mb != 25.0) s += fmt::format(" --bucket-mb {:g}", bucket_mb);
  if (dp > 1 && grad_wire != GradWire::kF32) s += fmt::format(" --grad-comm {}", to_string(grad_wire));
  if (dp > 1 && grad_wire == GradWire::kFP8 && fp8_format != Fp8Format::kOCP)
    s += fmt::format(" --fp8-format {}", trn::to_string(fp8_format));
  if (recompute != Recompute::kNone) s += fmt::format(" --recompute {}", to_string(recompute));
  if (recompute == Recompute::kFull && recompute_layers > 0) s += fmt::format(" --recompute-layers {}", recompute_layers);
  if (sequence_parallel) s += " --sequence-parallel";
  if (ep > 1) s += fmt::format(" --ep {}", ep);
  return s;
}

void check(const Plan& p, const model::Config& c, int64_t global_batch, const char* dp_name, int seq_len) {
  constexpr int64_t kMaxWorkers = std::numeric_limits<int>::max();  // ranks are ints
  if (p.dp < 1 || p.tp < 1 || p.pp < 1 || p.cp < 1 || p.micro_batches < 1 || p.virtual_stages < 1)
    throw usage_error(
        "--dp {} --tp {} --pp {} --cp {} --micro-batches {} --virtual-stages {}: every size must be at least 1", p.dp,
        p.tp, p.pp, p.cp, p.micro_batches, p.virtual_stages);
  if (p.zero < 0 || p.zero > 3) throw usage_error("--zero {}: ZeRO stages are 0 to 3", p.zero);
  if (p.prefetch < 0) throw usage_error("--zero-prefetch {}: a count of gathers, 0 or more", p.prefetch);
  if (p.shard_group < 0) throw usage_error("--shard-group {}: a number of data-parallel ranks", p.shard_group);
  if (p.shard_group > 0) {
    if (p.zero < 1)
      throw usage_error("--shard-group {} shards ZeRO's state within groups of data-parallel ranks: it needs --zero 1, "
                        "2 or 3",
                        p.shard_group);
    if (p.replicas() % p.shard_group != 0)
      throw usage_error("--shard-group {} must divide the {} data-parallel ranks (--dp {}{}) into whole groups",
                        p.shard_group, p.replicas(), p.dp, p.cp > 1 ? fmt::format(" x --cp {}", p.cp) : "");
  }
  if (p.ep < 1) throw usage_error("--ep {}: every size must be at least 1", p.ep);
  if (p.ep > 1) {
    if (!c.moe())
      throw usage_error("--ep {} splits the experts of a mixture of experts over ranks, and {} has none; use "
                        "--arch mixtral (or --n-experts) or --ep 1",
                        p.ep, c.describe());
    if (c.n_experts % p.ep != 0)
      throw usage_error("--ep {} must divide the {} experts of each MoE layer", p.ep, c.n_experts);
    if (p.replicas() % p.ep != 0)
      throw usage_error("--ep {} splits the experts over data-parallel ranks: it must divide --dp {}", p.ep, p.dp);
    if (p.shard_group > 0)
      throw usage_error("--ep {} with --shard-group {}: under expert parallelism ZeRO shards over the replicas "
                        "holding the same experts (--dp / --ep of them); leave --shard-group out",
                        p.ep, p.shard_group);
  }
  if (p.cp > 1 && p.cp_comm == trn::cp::Comm::kAllToAll && p.tp > 0 && c.kv_heads() % (p.tp * p.cp) != 0)
    throw usage_error("--cp-comm all-to-all splits each tp rank's heads over the cp ranks: its {} KV heads (n_kv_head "
                      "{} / --tp {}) do not divide by --cp {}; use --cp-comm ring",
                      c.kv_heads() / p.tp, c.kv_heads(), p.tp, p.cp);
  if (p.cp > 1 && seq_len > 0 && seq_len % (2 * p.cp) != 0)
    throw usage_error("--cp {} with --seq-len {}: each sequence is cut into 2 x {} equal chunks (head and tail per "
                      "rank, for balanced causal attention), so --seq-len must be a multiple of {}",
                      p.cp, seq_len, p.cp, 2 * p.cp);
  if (p.sequence_parallel) {
    if (p.tp == 1)
      throw usage_error("--sequence-parallel splits the tokens between the tensor-parallel blocks over the tp ranks: "
                        "it needs --tp 2 or more (got --tp 1)");
    if (seq_len > 0 && p.local_seq_len(seq_len) % p.tp != 0)
      throw usage_error("--sequence-parallel with --seq-len {}{}: the sequence must split evenly over --tp {}", seq_len,
                        p.cp > 1 ? fmt::format(" (--cp {}: {} tokens per rank)", p.cp, p.local_seq_len(seq_len)) : "",
                        p.tp);
    if (p.pp > 1 && p.schedule == Schedule::kZeroBubble)
      throw usage_error("--sequence-parallel with --schedule zb: zero-bubble's weight pass reads the norms' gathered "
                        "outputs, which sequence parallelism does not keep; use another schedule");
  }
  if (p.recompute_layers < 0)
    throw usage_error("--recompute-layers {}: a number of blocks per pipeline chunk (0: all)", p.recompute_layers);
  // What the family's layers declare they cannot run (family.h Refusals).
  const model::Refusals& refuses = model::family(c.arch).refusals;
  if (refuses.cp && p.cp > 1) throw usage_error("--cp {} with {}: {}", p.cp, refuses.what, refuses.cp);
  if (refuses.zero_bubble && p.pp > 1 && p.schedule == Schedule::kZeroBubble)
    throw usage_error("--schedule zb with {}: {}", refuses.what, refuses.zero_bubble);
  if (p.recompute != Recompute::kNone && p.pp > 1 && p.schedule == Schedule::kZeroBubble)
    throw usage_error("--recompute {} with --schedule zb: zero-bubble's weight pass reads a block's activations "
                      "after its input pass, which recomputation does not keep; use another schedule or "
                      "--recompute none",
                      to_string(p.recompute));
  if (!(p.bucket_mb * 1024 * 1024 >= sizeof(float)))
    throw usage_error("--bucket-mb {} is less than one fp32 gradient (4 bytes)", p.bucket_mb);
  model::check_tensor_parallel(c, p.tp);
  // Products of sizes are formed in 64 bits: each factor is an int, so a product of two never
  // overflows, and the world size (four factors) grows one checked factor at a time.
  {
    int64_t workers = int64_t{p.dp} * p.tp;
    for (const int f : {p.cp, p.pp})
      if (workers <= kMaxWorkers) workers *= f;
    if (workers > kMaxWorkers)
      throw usage_error("--dp {} x --tp {} x --pp {}{} is more than {} workers, the most a job can have; use a "
                        "layout of the job's size",
                        p.dp, p.tp, p.pp, p.cp > 1 ? fmt::format(" x --cp {}", p.cp) : "", kMaxWorkers);
  }
  if (const int64_t chunks = int64_t{p.pp} * p.virtual_stages; chunks > c.n_layer)
    throw usage_error("--pp {}{} makes {} pipeline chunks but the model has {} layers (n_layer); each chunk holds at "
                      "least one layer, so use a --pp{} of at most {}",
                      p.pp, p.virtual_stages > 1 ? fmt::format(" x --virtual-stages {}", p.virtual_stages) : "",
                      chunks, c.n_layer, p.virtual_stages > 1 ? " x --virtual-stages" : "", c.n_layer);
  if (p.pp == 1 && (p.virtual_stages > 1 || p.schedule != Schedule::k1F1B))
    throw usage_error("--schedule and --virtual-stages choose how a pipeline runs and need --pp 2 or more "
                      "(got --pp 1)");
  if (p.pp > 1) {
    pipeline::check(p.schedule, p.pipeline());
    pipeline::chunks_of(c, p.pipeline(), 0);  // the layers divide into the virtual stages
  }
  if (global_batch % (int64_t{p.dp} * p.micro_batches) != 0)
    throw usage_error("--batch-size {} must divide evenly into {} {} x --micro-batches {}", global_batch, dp_name,
                      p.dp, p.micro_batches);
}

int block_of(const std::string& name) {
  for (size_t i = 0; i + 1 < name.size(); ++i) {
    if (name[i] != '.' || !std::isdigit(static_cast<unsigned char>(name[i + 1]))) continue;
    size_t j = i + 1;
    int v = 0;
    while (j < name.size() && std::isdigit(static_cast<unsigned char>(name[j]))) v = v * 10 + (name[j++] - '0');
    if (j < name.size() && name[j] == '.') return v;
  }
  return -1;
}

bool is_expert(const std::string& name) { return name.find(".experts.") != std::string::npos; }

StageCounter::Params stage_params(const model::ParamLayout& lay) {
  StageCounter::Params sp;
  sp.total = double(lay.total());
  for (const model::TensorSpec& t : lay.tensors()) {
    if (t.matmul) sp.matmul += double(t.numel);
    if (is_expert(t.name)) sp.experts += double(t.numel);
  }
  int first = -1;
  for (const model::TensorSpec& t : lay.tensors()) {
    const int b = block_of(t.name);
    if (!t.matmul || b < 0 || (first >= 0 && b != first)) continue;
    first = b;
    // GPT-2 stores linear weights [in, out], the other families nn.Linear's [out, in].
    sp.zb_widths += double(lay.config().arch == "gpt2" ? t.shape.back() : t.shape.front());
  }
  const model::TensorSpec* tied = lay.tied();
  for (int c = 0; c < int(lay.chunks().size()); ++c) {
    const model::Chunk& k = lay.chunks()[size_t(c)];
    const auto [begin, end] = lay.chunk_range(c);
    size_t blocks_end = begin;
    if (k.head) {
      sp.max_head = std::max(sp.max_head, double(lay.head_end - begin) + (tied ? double(tied->numel) : 0.0));
      blocks_end = lay.head_end;
    }
    for (int l = k.first_layer; l < k.end_layer; ++l) {
      sp.max_block = std::max(sp.max_block, double(lay.blocks[size_t(l)].end - lay.blocks[size_t(l)].begin));
      blocks_end = std::max(blocks_end, lay.blocks[size_t(l)].end);
    }
    sp.max_embed = std::max(sp.max_embed, double(end - blocks_end));
    StageCounter::Params::ChunkParams cp;
    cp.total = double(end - begin);
    for (const model::TensorSpec& t : lay.tensors())
      if (t.offset >= begin && t.offset < end && (!t.matmul || (k.embedding && t.offset >= blocks_end)))
        cp.f32 += double(t.numel);
    sp.chunks.push_back(cp);
  }
  if (tied) sp.tied = double(tied->numel);
  return sp;
}

StageCounter::Params StageCounter::params(const model::Config& c, const model::Placement& p) {
  return stage_params(model::ParamLayout(c, p));
}

double StageCounter::activation_bytes(const model::Config& c, const model::Placement& p, int batch, int seq_len,
                                      int slots, int chunk) {
  return double(model::Stage<float>::activation_bytes(model::ParamLayout(c, p), batch, seq_len, slots, chunk));
}

std::vector<int> StageCounter::slots(const Plan& plan, int stage) {
  return pipeline::plan_slots(plan.schedule, stage, plan.pipeline()).slots_needed;
}

MemoryCount memory(const Plan& p, const model::Config& config, int global_batch, int seq_len,
                   const MemoryInputs& in) {
  model::Config c = config;
  c.recompute = p.recomputed_layers();  // the stages' activations follow the plan's recomputation
  c.recompute_selective = p.recompute == Recompute::kSelective;
  c.sequence_parallel = p.sequence_parallel;
  StageCounter direct;
  StageCounter& counter = in.counter ? *in.counter : direct;
  const int B = p.micro_batch(global_batch);  // sequences per micro-batch
  seq_len = p.local_seq_len(seq_len);         // a cp rank's tokens of each
  const double N = double(B) * seq_len, C = c.d_model;
  MemoryCount best;
  for (int r = 0; r < p.pp; ++r) {
    const model::Placement place = p.placement(c, in.tp_rank, r);
    const StageCounter::Params sp = counter.params(c, place);
    const double P = sp.total;
    MemoryCount m;
    const int stage = p.zero_stage();
    const double d = p.dp_shard();
    // The parameters a rank owns under ZeRO: 1/dp_shard of the dense ones and 1/expert_shard of
    // its experts (the experts it holds are already 1/ep of the model's: the placement's).
    const double owned = stage == 0                   ? P
                         : p.expert_shard() == p.dp_shard() ? P / d
                                                            : (P - sp.experts) / d + sp.experts / p.expert_shard();
    m.weights = stage == 3 ? 4 * owned : 4 * P;
    m.gradients = 4 * P;  // the whole accumulator during a step (exact sums: DESIGN.md "ZeRO")
    // ZeRO-2 and 3 copy the owned shard out of it after the sync, before freeing it.
    const double shard = stage >= 2 ? 4 * owned : 0;
    m.gradients += shard;
    m.optimizer = 8 * owned;  // AdamW's moments, of the owned share under ZeRO
    // The copy's form follows the kernels (kernels/bf16.h): bf16 for oneDNN, widened fp32 emulated.
    const double copy_bytes = in.bf16_copy_half ? 2 : 4;
    if (c.precision == model::Precision::kBf16) m.bf16_copy = sp.matmul * copy_bytes;
    const double bucket = double(p.bucket_bytes()) / 4;
    // What a ZeRO-3 gather holds beyond its tensors at each end: the bucket straddling the border,
    // which optim::unit_stops makes the one norm piece there (a whole piece, whatever the bucket
    // size: buckets end on pieces), or nothing where the pieces are per tensor (tp, pp or ep:
    // optim::norm_pieces), every border then a cut.
    const double reach = optim::per_tensor_pieces(p.tp, p.pp, p.ep) ? 0.0 : double(optim::kSumChunk);
    // ZeRO-3's gathered weights are all freed before the shard's copy is made, and the shard
    // freed before the next pass gathers: the peak holds the larger of the two, not both.
    // With the gradient window (one backward per step, one compute thread) the shard lives
    // through the step beside them.
    const bool window = stage >= 2 && p.pp == 1 && p.micro_batches == 1 && std::min(in.threads, B) <= 1;
    auto gathered = [&](double bytes) { m.buffers += std::max(0.0, bytes - (window ? 0.0 : shard)); };
    if (p.pp == 1) {
      // One stage: each compute thread holds a Stage over its slice of the micro-batch, and every
      // thread after the first a gradient buffer of its own (OneStageModel).
      const int n = std::max(1, std::min(in.threads, B));
      for (int k = 0; k < n; ++k)
        m.activations += counter.activation_bytes(c, place, (k + 1) * B / n - k * B / n, seq_len, 1, 0);
      m.gradients += 4 * P * (n - 1);
      if (window) {
        // The gradient window (model/grad_window.h) instead of the whole accumulator: the
        // largest piece's offsets outside the tied embedding plus a bucket, the tied embedding
        // apart, and at most ZeroSync::kMaxStaged bucket copies on their way to the shard.
        const double window = std::min(P - sp.tied, std::max({sp.max_block, sp.max_head - sp.tied, sp.max_embed - sp.tied}) + bucket);
        const double wire = p.grad_wire == GradWire::kBF16 ? 2 : 4;
        m.gradients = 4 * (window + sp.tied) + shard + std::min(P, 4 * bucket) * wire;
        if (p.grad_wire == GradWire::kBF16) m.gradients += 2 * owned;  // the shard's bf16 form
      }
      if (stage == 3) {
        // Gather units, each rounded out to whole buckets (at most `reach` more at each end): the
        // one computing, `prefetch` blocks ahead, and one unit per compute thread lagging behind
        // the first. A block or the head holds 4 bytes an element on the fp32 wire; under bf16
        // its wire's 2 (until it arrives) and its bf16 form. The embedding stays fp32, no form.
        auto unit = [&](double params) { return std::min(P, params + 2 * reach); };
        const double per = c.precision == model::Precision::kBf16 ? 2 + copy_bytes : 4;
        // The head's tied embedding is gathered as the buckets over it, which start with the
        // embedding unit's (a table before it, GPT-2's wpe, comes along): at most the rest of the
        // embedding unit, and a bucket and a piece.
        const double tied_lead =
            sp.tied > 0 ? std::min(sp.max_embed - sp.tied, bucket + double(optim::kSumChunk)) : 0.0;
        const double computing =
            std::max({4 * unit(sp.max_embed), per * unit(sp.max_head + tied_lead), per * unit(sp.max_block)});
        // With prefetch 0 the last block is still held across the head's turn (kept for its
        // backward): at least one block beside the unit computing.
        gathered(computing * n + per * unit(sp.max_block) * std::max(p.prefetch, 1));
        m.bf16_copy = 0;
      }
    } else {
      // A pipeline stage holds one Stage per chunk with the slots its schedule needs (at least one).
      const std::vector<int> slots = counter.slots(p, r);
      for (size_t ch = 0; ch < slots.size(); ++ch)
        m.activations += counter.activation_bytes(c, place, B, seq_len, std::max(slots[ch], 1), int(ch));
      if (p.schedule == Schedule::kZeroBubble) {
        // A zero-bubble input pass keeps each matmul's output gradient for its weight pass
        // (outside Stage::activation_bytes): a block's matmul output widths per live micro-batch.
        int live = 0;
        for (int x : slots) live += std::max(x, 1);
        const int blocks = c.n_layer / (p.pp * p.virtual_stages);
        m.activations += 4.0 * live * blocks * N * sp.zb_widths;
      }
      // The pipeline's messages: a stage's rows of each micro-batch (1/tp under sequence parallelism).
      const double rows = p.sequence_parallel ? N / p.tp : N;
      m.buffers += 4.0 * 4.0 * p.virtual_stages * p.micro_batches * rows * C;
      if (stage == 3) {
        // Chunk gathers (UNSHARD / RESHARD): at most promised_unsharded chunks held at once, the
        // largest ones counted, each rounded out to whole buckets. 4 bytes an element on the fp32
        // wire; under bf16, while a chunk arrives, its packed wire (2 bytes an element and 2 more
        // for each fp32 one), its bf16 form and its fp32 elements whole (measured with heaptrack
        // at gpt2 dp 2 x pp 2), unless most of the chunk travels in fp32 (the fp32 wire, the form).
        const bool bf16 = c.precision == model::Precision::kBf16;
        std::vector<double> bytes;
        for (const StageCounter::Params::ChunkParams& ch : sp.chunks) {
          const double R = std::min(P, ch.total + 2 * reach), F = ch.f32;
          bytes.push_back(!bf16 ? 4 * R : 2 * F <= ch.total ? 2 * (R + F) + copy_bytes * R + 4 * F : (4 + copy_bytes) * R);
        }
        std::sort(bytes.begin(), bytes.end(), std::greater<>());
        const int held = pipeline::promised_unsharded(p.schedule, r, p.pipeline(), p.prefetch);
        double sum = 0;
        for (int i = 0; i < held && i < int(bytes.size()); ++i) sum += bytes[size_t(i)];
        gathered(sum);
        m.bf16_copy = 0;
      }
    }
    if (p.replicas() > 1 && p.grad_wire == GradWire::kBF16 && !window) m.buffers += 2 * P;  // the bf16 staging copy
    // A reduce-scatter of a bucket receives into scratch of about the bucket's size (measured:
    // bench/results/2026-12-06-zero-memory.md); the all-reduce's is in the calibrated base.
    if (stage >= 1) m.buffers += std::min(4 * P, double(p.bucket_bytes()));
    // So does sequence parallelism's reduce-scatter of a micro-batch's N x C partial sums.
    if (p.sequence_parallel && p.tp > 1) m.buffers += 4 * N * C;
    // Context parallelism's ring: blocks of keys and values and their gradients in flight, with
    // bf16 operands widened (runtime/context_parallel/attention.h).
    if (p.cp > 1)
      m.buffers += cp::scratch_bytes(p.cp_comm, B, seq_len, c.n_head / p.tp, c.kv_heads() / p.tp, c.head_dim(),
                                     c.precision == model::Precision::kBf16);
    // Expert parallelism on unbalanced routing: a rank's experts receive moe_rows x a balanced
    // load's rows in the busiest layer, and every buffer sized by the received rows grows to
    // them (layers/moe.h): per MoE layer and live slot its grouped activations ([gate | up],
    // outputs, inputs), and once per stage its scratch (inputs, outputs, [gate | up] and
    // activation gradients) and the exchanges' received rows.
    if (c.moe() && p.ep > 1 && std::max(in.moe_rows, in.moe_rows_anywhere) > 1) {
      const double rows = N * c.top_k, F = double(c.ffn()) / p.tp, k = c.top_k;
      const double received = N * std::min(c.top_k, p.ep);
      double live = 0;
      if (p.pp == 1) {
        live = c.n_layer;  // (each compute thread holds its slice's rows: N x k over them all)
      } else {
        const std::vector<int> slots = counter.slots(p, r);
        for (int x : slots) live += double(std::max(x, 1)) * c.n_layer / (p.pp * p.virtual_stages);
      }
      const double layers = live * rows * (2 * F + 2 * C);
      const double shared = rows * (2 * C + 4 * F) + received * ((C + 2 * k) + (C + k));
      m.activations +=
          4 * (std::max(0.0, in.moe_rows - 1) * layers + std::max(0.0, in.moe_rows_anywhere - 1) * shared);
    }
    m.base = in.base;
    if (m.total() > best.total()) best = m;
  }
  return best;
}

}  // namespace trn::parallel
