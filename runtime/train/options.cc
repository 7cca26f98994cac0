#include "runtime/train/options.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <limits>

#include <unistd.h>

#include "collectives/core/error.h"
#include "collectives/core/flags.h"
#include "collectives/core/settings.h"
#include "runtime/data/data.h"
#include "runtime/io/atomic_file.h"
#include "runtime/io/hf_config.h"
#include "runtime/io/hf_dir.h"
#include "runtime/io/safetensors.h"
#include "runtime/model/family.h"
#include "runtime/model/layers/moe_flags.h"
#include "runtime/train/dp_sync.h"
#include "runtime/pipeline_parallel/pipeline.h"

namespace trn::train {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;
constexpr double kMaxBucketMb = 1024.0 * 1024.0;  // 1 TiB

// Model shape flags: 0 keeps the preset's value.
struct Overrides {
  int n_layer = 0, n_head = 0, d_model = 0, ctx = 0, vocab = 0, n_kv_head = 0, ffn_dim = 0;
  double rope_theta = 0, norm_eps = 0;
  int tie_embeddings = -1;
  model::MoeFlags moe;  // the MoE layer's own flags (layers/moe_flags.h)
};

// "--model"'s help and choices, from every family's presets.
const std::string& preset_help() {
  static const std::string s = [] {
    std::string out = "preset:";
    for (const model::Family* f : model::families())
      for (const model::Preset& p : f->presets) out += fmt::format("{} {} ({})", out.size() > 7 ? ";" : "", p.name, p.help);
    return out;
  }();
  return s;
}
const std::string& preset_names() {
  static const std::string s = [] {
    std::string out;
    for (const model::Family* f : model::families())
      for (const model::Preset& p : f->presets) out += (out.empty() ? "" : "|") + p.name;
    return out;
  }();
  return s;
}
const std::string& arch_names() {
  static const std::string s = [] {
    std::string out;
    for (const model::Family* f : model::families()) out += (out.empty() ? "" : "|") + f->name;
    return out;
  }();
  return s;
}

// "1 2 3" or "1,2,3": token ids (non-negative ints), at least one.
std::vector<int32_t> parse_token_ids(const std::string& flag, const std::string& text) {
  std::vector<int32_t> out;
  const char* p = text.data();
  const char* const end = p + text.size();
  while (p < end) {
    if (*p == ' ' || *p == ',') {
      ++p;
      continue;
    }
    int32_t id = -1;
    const auto [next, ec] = std::from_chars(p, end, id);
    if (ec != std::errc() || id < 0 || (next < end && *next != ' ' && *next != ','))
      throw usage_error("{} takes token ids (non-negative integers) separated by spaces or commas, got '{}'", flag,
                        text);
    out.push_back(id);
    p = next;
  }
  if (out.empty()) throw usage_error("{} needs at least one token id, got '{}'", flag, text);
  return out;
}

constexpr const char* kModel = "Model";
constexpr const char* kTraining = "Data and schedule";
constexpr const char* kOptimizer = "Optimizer";
constexpr const char* kOutput = "Output";
constexpr const char* kCheckpoints = "Checkpoints";
constexpr const char* kLayout = "Layout";
constexpr const char* kDataParallel = "Data-parallel gradients";
constexpr const char* kPrecision = "Precision";

using flags::Range;

// trn-train's flags: the members of *o (and the model overrides *ov) they set. --help renders
// the defaults from *o, so build it on a default Options for help.
flags::Table table(Options* o, Overrides* ov) {
  constexpr auto kPositive = Range::kPositive;
  constexpr auto kNonNegative = Range::kNonNegative;
  flags::Table t{
      "trn-train",
      "Trains a GPT-2 or Llama model on one process, or as one rank of a data- and tensor-parallel job under\n"
      "trnrun/mpirun (world size = dp x tp x pp).\n",
      {
          {"--arch", &o->arch, "model family; without --model, its first preset", kModel, arch_names().c_str(),
           "the preset's"},
          {"--model", &o->model_name, preset_help().c_str(), kModel, preset_names().c_str(),
           "tiny, or the --init file's model"},
          {"--n-layer", &ov->n_layer, "transformer blocks (overrides the preset)", kModel, "N", "preset", kPositive},
          {"--n-head", &ov->n_head, "attention heads (overrides the preset)", kModel, "N", "preset", kPositive},
          {"--d-model", &ov->d_model, "embedding width (overrides the preset)", kModel, "N", "preset", kPositive},
          {"--ctx", &ov->ctx, "context length (overrides the preset)", kModel, "N", "preset", kPositive},
          {"--vocab", &ov->vocab, "vocabulary size (overrides the preset; for indexed shards, their largest id + 1)",
           kModel, "N", "preset", kPositive},
          {"--n-kv-head", &ov->n_kv_head, "k and v heads of grouped-query attention, dividing n_head (llama)", kModel,
           "N", "preset", kPositive},
          {"--ffn-dim", &ov->ffn_dim, "the MLP's hidden width (llama)", kModel, "N", "preset", kPositive},
          {"--rope-theta", &ov->rope_theta, "rotary embedding base (llama)", kModel, "X", "preset", kPositive},
          {"--norm-eps", &ov->norm_eps, "RMSNorm epsilon (llama)", kModel, "X", "preset", kPositive},
          {"--tie-embeddings", &ov->tie_embeddings, "1: the LM head is the token embedding (llama)", kModel, "0|1",
           "preset", Range::kAny, 0, 0, "0|1"},
          {"--data", &o->data,
           "token shards (a DIR of train-*.bin/.idx, a GLOB, or PREFIX.bin with its .idx), an llm.c .bin, or raw "
           "bytes",
           kTraining, "DIR|GLOB|FILE", "the built-in corpus"},
          {"--steps", &o->steps, "optimizer steps", kTraining, "N", nullptr, kPositive},
          {"--batch-size", &o->batch_size, "sequences per step, global", kTraining, "N", nullptr, kPositive},
          {"--seq-len", &o->seq_len, "tokens per sequence", kTraining, "N", "ctx", kPositive},
          {"--seed", &o->seed, "random seed", kTraining, "N"},
          {"--val-data", &o->val_data, "held-out tokens for validation, in any format --data takes", kTraining,
           "PATH"},
          {"--eval-every", &o->eval_every, "steps between validations (--val-data)", kTraining, "N",
           "only after the last step", kNonNegative},
          {"--eval-batches", &o->eval_batches, "global batches of --val-data per validation (at most the set holds)", kTraining, "K",
           nullptr, kPositive},
          {"--lr", &o->lr, "peak learning rate", kOptimizer, "X", nullptr, kNonNegative},
          {"--lr-schedule", [o](auto&, auto& v) { o->schedule = optim::parse_schedule(v); },
           "learning-rate schedule after the warmup", kOptimizer, "constant|cosine", "cosine"},
          {"--warmup-steps", &o->warmup_steps, "steps of linear warmup to --lr", kOptimizer, "N", nullptr,
           kNonNegative},
          {"--min-lr", &o->min_lr, "the learning rate cosine decays to", kOptimizer, "X", "lr/10", kNonNegative},
          {"--weight-decay", &o->weight_decay, "AdamW's decoupled weight decay", kOptimizer, "X", nullptr,
           kNonNegative},
          {"--beta1", &o->beta1, "AdamW's first-moment decay (below 1)", kOptimizer, "X", nullptr, kNonNegative},
          {"--beta2", &o->beta2, "AdamW's second-moment decay (below 1)", kOptimizer, "X", nullptr, kNonNegative},
          {"--grad-clip", &o->grad_clip, "gradient norm clipping; 0 = off", kOptimizer, "X", "1.0", kNonNegative},
          {"--init", &o->init, "start from these weights", kOutput, "FILE.safetensors"},
          {"--save", &o->save, "write the trained weights", kOutput, "FILE.safetensors"},
          {"--init-hf", &o->init_hf,
           "start from a Hugging Face model directory: the model from its config.json (llama, qwen2, mistral), "
           "the weights from its safetensors (F32, BF16, F16; one file or index and shards)",
           kOutput, "DIR"},
          {"--save-hf", &o->save_hf,
           "write the trained model as a Hugging Face directory: config.json, safetensors shards and index, and "
           "--init-hf's tokenizer and generation files (a previous --save-hf output there is replaced whole)",
           kOutput, "DIR"},
          {"--save-shard-size", [o](auto& f, auto& v) { o->save_shard_size = io::parse_byte_size(f, v); },
           "--save-hf: the largest safetensors file (a larger tensor goes alone in one)", kOutput, "SIZE", "5GB"},
          {"--save-dtype", &o->save_dtype, "--save-hf: the weights' dtype (bf16 rounds to nearest even)", kOutput, "",
           "bf16", Range::kAny, 0, 0, "bf16|f32"},
          {"--threads", &o->threads, "compute threads", kOutput, "N", "TRN_THREADS, else 1", kPositive},
          {"--log-every", &o->log_every, "steps between log lines", kOutput, "N", nullptr, kPositive},
          {"--metrics-jsonl", &o->metrics_jsonl, "one JSON line of metrics per logged step", kOutput, "FILE"},
          {"--metrics-moe-loads", &o->metrics_moe_loads,
           "each --metrics-jsonl line also holds the step's global expert loads, n_layer x n_experts kept choices "
           "(\"moe_loads\"; trn-plan --moe-loads reads them)",
           kOutput},
          {"--dump-batches", &o->dump_batches, "write each step's global batch as int32 [steps, batch, seq+1]",
           kOutput, "FILE"},
          {"--dump-logits", &o->dump_logits,
           "write the logits of --logits-tokens's prompt as float32 [tokens, vocab], from one forward through "
           "this run's layout after loading and before step 1",
           kOutput, "FILE"},
          {"--logits-tokens", [o](auto& f, auto& v) { o->logits_tokens = parse_token_ids(f, v); },
           "--dump-logits's prompt: token ids separated by spaces or commas, at most --seq-len of them", kOutput,
           "IDS"},
          {"--trace", &o->trace,
           "Chrome trace-event timeline (Perfetto, chrome://tracing): one track per rank, merged by rank 0; "
           "{rank} in FILE: one file per rank",
           kOutput, "FILE"},
          {"--checkpoint-dir", &o->checkpoint_dir,
           "sharded checkpoints of weights, AdamW state and data position go under DIR", kCheckpoints, "DIR"},
          {"--checkpoint-every", &o->checkpoint_every, "steps between checkpoints", kCheckpoints, "N",
           "only at the end", kPositive},
          {"--keep-checkpoints", &o->keep_checkpoints, "committed checkpoints kept in DIR", kCheckpoints, "K",
           nullptr, kPositive},
          {"--snapshot-every", &o->snapshot_every,
           "in-memory snapshots of this rank's state (own and a buddy's memory) for trnrun --recovery in-place",
           kCheckpoints, "N", "none", kPositive},
          {"--resume", &o->resume, "auto resumes from the newest committed checkpoint in DIR", kCheckpoints,
           "auto|never|PATH"},
          {"--allow-changed-settings", &o->allow_changed_settings,
           "resume although batch, schedule or optimizer settings differ from the checkpoint's (one warning "
           "each; else an error)",
           kCheckpoints},
          {"--dp", &o->plan.dp,
           "data-parallel replicas; without --dp, dp = workers / (tp x pp x cp), so an elastic job trains on the "
           "hosts each generation has",
           kLayout, "N", "workers / (tp x pp x cp)", kPositive},
          {"--tp", &o->plan.tp, "tensor-parallel shards (must divide n_head)", kLayout, "N", nullptr, kPositive},
          {"--cp", &o->plan.cp,
           "context-parallel ranks: each sequence in 2 x cp chunks, rank r computing chunks r and 2cp-1-r, "
           "attention's keys and values passed around them (ring attention); --seq-len must be a multiple of 2 x cp",
           kLayout, "N", nullptr, kPositive},
          {"--ep", &o->plan.ep,
           "expert-parallel ranks: each MoE layer's experts split over this many data-parallel ranks (which "
           "must divide --dp and --n-experts), tokens sent to their experts' ranks and back by all-to-all",
           kLayout, "N", nullptr, kPositive},
          {"--pp", &o->plan.pp, "pipeline stages (pp x virtual stages must divide n_layer)", kLayout, "N", nullptr,
           kPositive},
          {"--cp-comm",
           [o](auto&, auto& v) {
             o->plan.cp_comm = cp::parse_comm(v);  // a usage error for anything else
           },
           "how --cp's attention exchanges the sequence: ring passes keys and values around the cp ranks, "
           "overlapped with the blocks; all-to-all swaps the split of the tokens for a split of the heads around "
           "attention (Ulysses: the rank's KV heads must divide by cp)",
           kLayout, "ring|all-to-all", "ring"},
          {"--micro-batches", &o->plan.micro_batches,
           "pieces of each rank's batch: gradient accumulation, and the micro-batches a pipeline schedule runs",
           kLayout, "N", nullptr, kPositive},
          {"--schedule",
           [o](auto&, auto& v) {
             o->plan.schedule = pipeline::parse_kind(v);  // a usage error for anything else
           },
           "pipeline schedule (--pp > 1)", kLayout, "gpipe|1f1b|interleaved|zb", "1f1b"},
          {"--virtual-stages", &o->plan.virtual_stages, "chunks of layers per pipeline rank (interleaved)", kLayout,
           "V", nullptr, kPositive},
          {"--bucket-mb", &o->plan.bucket_mb, "data-parallel gradient bucket size in MiB", kDataParallel, "X", nullptr,
           kPositive, 0, 0, "", "",
           [o](auto& f, auto& v) {
             // A bucket holds whole fp32 gradients; one larger than the model is one bucket for all
             // of it, so the limit only keeps the byte count representable.
             if (o->plan.bucket_mb * kMiB < sizeof(float))
               throw usage_error("{} {} is {:.3g} bytes, less than one fp32 gradient (4 bytes); use at least {:.2g}",
                                 f, v, o->plan.bucket_mb * kMiB, sizeof(float) / kMiB);
             if (o->plan.bucket_mb > kMaxBucketMb)
               throw usage_error("{} {} is too large: at most {} (1 TiB); a bucket larger than the model's "
                                 "gradients is one bucket for all of them",
                                 f, v, kMaxBucketMb);
           }},
          {"--grad-comm",
           [o](auto&, auto& v) {
             o->plan.grad_wire = parallel::parse_grad_wire(v);  // a usage error for anything else
           },
           "data-parallel gradients on the wire; fp8: e4m3 with a scale per 128 values, a quarter of f32's bytes",
           kDataParallel, "f32|bf16|fp8", "f32"},
          {"--fp8-format",
           [o](auto&, auto& v) {
             o->plan.fp8_format = parse_fp8_format(v);  // a usage error for anything else
           },
           "E4M3 format of --grad-comm fp8: ocp (OCP E4M3FN, max 448) or neuron (Trainium2's IEEE-style E4M3 "
           "with infinities, max 240; its compiler refuses ocp's); every rank must use the same",
           kDataParallel, "ocp|neuron", "ocp"},
          {"--zero", &o->plan.zero,
           "ZeRO stage over the data-parallel ranks: 1 shards AdamW's state, 2 also keeps only each rank's "
           "share of the averaged gradients between steps, 3 also its share of the fp32 weights, gathering "
           "each block's weights when it computes",
           kDataParallel, "0|1|2|3", nullptr, Range::kAny, 0, 0, "0|1|2|3",
           "1: AdamW's state sharded, 2: and the gradients, 3: and the weights"},
          {"--shard-group",
           [o](auto& f, auto& v) {
             if (v == "host") {
               o->shard_group_host = true;
               return;
             }
             int n = 0;
             const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
             if (ec != std::errc() || end != v.data() + v.size() || n < 1)
               throw usage_error("{} takes a number of data-parallel ranks (1 or more) or 'host', got '{}'", f, v);
             o->plan.shard_group = n;
           },
           "hybrid sharding: ZeRO shards within groups of N data-parallel ranks (host: one host's) and all-reduces "
           "the shards' gradients across the groups",
           kDataParallel, "N|host", "all data-parallel ranks"},
          {"--zero-prefetch", &o->plan.prefetch,
           "--zero 3: the blocks' (pipeline: chunks') weights gathered ahead of the one computing (more hides more "
           "gather time and holds more memory)",
           kDataParallel, "D", nullptr, Range::kMinMax, 0, 8},
          {"--precision", &o->precision,
           "bf16: matmuls on bf16 operands with fp32 sums, their saved inputs stored as bf16; fp32 master "
           "weights, AdamW state and checkpoints",
           kPrecision, "", nullptr, Range::kAny, 0, 0, "fp32|bf16"},
          {"--bf16-kernels", &o->bf16_kernels, "bf16 kernels: onednn needs a CPU oneDNN has bf16 kernels for (AVX-512)",
           kPrecision, "", nullptr, Range::kAny, 0, 0, "auto|emulated|onednn"},
          {"--recompute",
           [o](auto&, auto& v) {
             o->plan.recompute = parallel::parse_recompute(v);  // a usage error for anything else
           },
           "activation recomputation (same results, less memory, more compute): selective computes the norms' "
           "outputs (and GPT-2's GELU output) again in the backward, full keeps only each block's output and "
           "reruns its forward",
           kPrecision, "none|selective|full", "none"},
          {"--sequence-parallel", &o->plan.sequence_parallel,
           "under --tp: each tp rank holds 1/tp of the tokens between the tensor-parallel blocks (norms, residuals), "
           "with an all-gather before each and a reduce-scatter after, in place of the all-reduce",
           kPrecision},
          {"--recompute-layers", &o->plan.recompute_layers,
           "--recompute full: the blocks of each pipeline chunk, from its first, that recompute (0: all)", kPrecision,
           "N", "0: all", Range::kMinMax, 0, 1 << 20},
      }};
  // The layers' option groups, after the families' shape flags.
  const auto after = std::find_if(t.flags.begin(), t.flags.end(),
                                  [](const flags::Flag& f) { return std::string(f.name) == "--tie-embeddings"; });
  const std::vector<flags::Flag> moe = ov->moe.table(kModel);
  t.flags.insert(after + 1, moe.begin(), moe.end());
  return t;
}

}  // namespace

std::string usage_text() {
  Options defaults;
  Overrides ov;
  return flags::help(table(&defaults, &ov));
}

namespace {

// The plan against the model and batch (parallel::check), naming dp as the user gave it.
void check_plan(const Options& o) {
  parallel::check(o.plan, o.model, o.batch_size, o.dp_given ? "--dp" : "the job's data-parallel replicas",
                  o.seq_len);
}

// The model: --model's preset (or --arch's first, or tiny), or with --init and no --model the
// model the file's metadata names (so loading a saved model needs no shape flags), with the
// shape flags over it.
void choose_model(Options* o, const Overrides& ov) {
  auto given = [&](const char* flag) { return o->flags_given.count(flag) > 0; };
  if (!o->arch.empty()) model::family(o->arch);  // a usage error naming the families
  bool from_file = false;
  if (!o->init_hf.empty()) {
    for (const char* other : {"--init", "--model", "--arch"})
      if (given(other))
        throw usage_error("--init-hf {} takes the model from its config.json; drop {}", o->init_hf, other);
    o->model = io::read_hf_config(o->init_hf).config;
    o->model_name = "from " + o->init_hf;
    from_file = true;
  }
  if (!from_file && !given("--model") && !o->init.empty()) {
    io::check_readable_file("--init", o->init);
    const auto meta = io::read_safetensors_metadata(o->init);
    if (const auto it = meta.find("trn.model"); it != meta.end()) {
      model::Config c;
      try {
        c = model::parse_config(it->second);
      } catch (const Error& e) {
        throw usage_error("--init {}: its trn.model metadata: {}; pass the model flags it was saved with", o->init,
                          e.what());
      }
      if (!o->arch.empty() && c.arch != o->arch)
        throw usage_error("--init {} holds a {} model (\"{}\"), not --arch {}", o->init, c.arch, it->second, o->arch);
      o->model = c;
      o->model_name = "from " + o->init;
      from_file = true;
    }
  }
  if (!from_file) {
    if (!given("--model") && !o->arch.empty()) o->model_name = model::family(o->arch).presets.at(0).name;
    o->model = model::preset(o->model_name);
  }
  if (!o->arch.empty() && o->model.arch != o->arch)
    throw usage_error("--model {} is a {} preset, not --arch {}; use one of the {} presets or drop --arch",
                      o->model_name, o->model.arch, o->arch, o->arch);
  model::Config& c = o->model;
  if (ov.n_layer) c.n_layer = ov.n_layer;
  if (ov.n_head) c.n_head = ov.n_head;
  if (ov.d_model) c.d_model = ov.d_model;
  if (ov.ctx) c.ctx = ov.ctx;
  if (ov.vocab) c.vocab = ov.vocab;
  // Indexed shards know their vocabulary (largest id + 1); --vocab or --init's model wins, and
  // the trainer's Tokens::load rejects one below the data's.
  if (!ov.vocab && !from_file && !o->data.empty())
    if (const int64_t v = data::dataset_vocab(o->data))
      c.vocab = int(std::min<int64_t>(v, std::numeric_limits<int>::max()));
  if (ov.n_kv_head) c.n_kv_head = ov.n_kv_head;
  if (ov.ffn_dim) c.ffn_dim = ov.ffn_dim;
  if (ov.rope_theta > 0) c.rope_theta = ov.rope_theta;
  if (ov.norm_eps > 0) c.norm_eps = ov.norm_eps;
  if (ov.tie_embeddings >= 0) c.tie_embeddings = ov.tie_embeddings == 1;
  ov.moe.apply(c, from_file);
  if (c.arch != "gpt2") {
    // Spelled out, so the description checkpoints and saved files record is one per model.
    c.n_kv_head = c.kv_heads();
    c.ffn_dim = c.ffn();
  }
}

}  // namespace

bool parse_options(const std::vector<std::string>& args, Options* o) {
  Overrides ov;
  if (!flags::parse(table(o, &ov), args, &o->flags_given)) return false;
  o->dp_given = o->flags_given.count("--dp") > 0;
  const bool schedule_set = o->flags_given.count("--schedule") > 0;
  choose_model(o, ov);
  o->model.precision = o->precision == "bf16" ? model::Precision::kBf16 : model::Precision::kFp32;
  o->model.recompute = o->plan.recomputed_layers();
  o->model.recompute_selective = o->plan.recompute == parallel::Recompute::kSelective;
  o->model.sequence_parallel = o->plan.sequence_parallel;
  o->model.validate();
  if (!o->save_hf.empty() && o->model.arch != "llama")
    throw usage_error("--save-hf writes Llama-family directories (model_type llama or qwen2), not a {} model; save "
                      "it with --save",
                      o->model.arch);
  if (o->seq_len == 0) o->seq_len = o->model.ctx;
  if (o->seq_len > o->model.ctx)
    throw usage_error("--seq-len {} exceeds the model context {}; lower it or raise --ctx",
                      o->seq_len, o->model.ctx);
  if (o->min_lr < 0) o->min_lr = o->lr / 10;
  if (o->min_lr > o->lr)
    throw usage_error("--min-lr {} is above --lr {}: the schedule decays from --lr down to --min-lr; "
                      "lower --min-lr or raise --lr",
                      o->min_lr, o->lr);
  if (o->beta1 >= 1 || o->beta2 >= 1) throw usage_error("--beta1 and --beta2 must be below 1");
  if (o->threads == 0)
    o->threads = settings::is_set("TRN_THREADS") ? int(settings::get_int("TRN_THREADS")) : 1;
  if (o->threads < 1) throw usage_error("TRN_THREADS must be at least 1, got {}", o->threads);
  if (o->checkpoint_every > 0 && o->checkpoint_dir.empty())
    throw usage_error("--checkpoint-every needs --checkpoint-dir DIR");
  if (!o->dump_batches.empty()) {
    // The dump is built in memory and written whole: steps x batch x (seq + 1) int32.
    const long double bytes = static_cast<long double>(o->steps) * o->batch_size * (o->seq_len + 1) * 4;
    const long double have = static_cast<long double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
    if (have > 0 && bytes > have)
      throw usage_error("--dump-batches needs {:.4g} GB for --steps {} x --batch-size {} x {} tokens, more than this "
                        "host's {:.4g} GB of memory; dump fewer --steps",
                        static_cast<double>(bytes / 1e9), o->steps, o->batch_size, o->seq_len + 1,
                        static_cast<double>(have / 1e9));
  }
  if (!o->dump_logits.empty()) {
    if (o->logits_tokens.empty())
      throw usage_error("--dump-logits {} needs the prompt: --logits-tokens IDS (token ids separated by spaces)",
                        o->dump_logits);
    if (o->logits_tokens.size() > size_t(o->seq_len))
      throw usage_error("--logits-tokens has {} tokens, more than --seq-len {}; shorten the prompt or raise "
                        "--seq-len",
                        o->logits_tokens.size(), o->seq_len);
    for (const int32_t id : o->logits_tokens)
      if (id >= o->model.vocab)
        throw usage_error("--logits-tokens: token id {} is outside the model's vocabulary of {}", id,
                          o->model.vocab);
    if (o->plan.cp > 1)
      throw usage_error("--dump-logits runs with whole sequences on each rank; drop --cp {} for the dump",
                        o->plan.cp);
  }
  if (o->plan.pp == 1 && schedule_set)
    throw usage_error("--schedule and --virtual-stages choose how a pipeline runs and need --pp 2 or more "
                      "(got --pp 1)");
  // The plan as given (dp may still change with the job's size: resolve_layout checks it again).
  check_plan(*o);
  return true;
}

void resolve_layout(Options* o, int world, int ranks_per_host) {
  const int64_t model_parallel = int64_t{o->plan.tp} * o->plan.pp * o->plan.cp;
  if (!o->dp_given && world % model_parallel == 0) o->plan.dp = std::max<int>(1, int(world / model_parallel));
  if (o->shard_group_host) {
    // A host's workers are consecutive ranks and a data-parallel group strides by tp, so a host
    // holds ranks_per_host / tp consecutive data-parallel ranks of each (tp, pp) position.
    const int per_host = ranks_per_host > 0 ? ranks_per_host : world;
    if (per_host % o->plan.tp != 0)
      throw usage_error("--shard-group host: {} workers per host do not divide into --tp {}", per_host, o->plan.tp);
    o->plan.shard_group = std::min(o->plan.dp, std::max(1, per_host / o->plan.tp));
  }
  check_plan(*o);
}

std::vector<std::string> ignored_flags(const Options& o) {
  std::vector<std::string> out;
  auto given = [&](const char* flag) { return o.flags_given.count(flag) > 0; };
  if (given("--bf16-kernels") && o.bf16_kernels != "auto" && o.precision != "bf16")
    out.push_back(fmt::format("--bf16-kernels {} has no effect with --precision {}: only bf16 matmuls use those "
                              "kernels; add --precision bf16 or drop the flag",
                              o.bf16_kernels, o.precision));
  if (o.plan.replicas() == 1) {
    if (o.plan.zero)
      out.push_back(fmt::format("--zero {} with one data-parallel replica: nothing to shard, the weights, gradients "
                                "and AdamW's state stay whole",
                                o.plan.zero));
    if (given("--grad-comm"))
      out.push_back(fmt::format("--grad-comm {} with one data-parallel replica: no gradients are exchanged, so it "
                                "has no effect",
                                parallel::to_string(o.plan.grad_wire)));
    if (given("--bucket-mb"))
      out.push_back("--bucket-mb with one data-parallel replica: no gradients are exchanged, so it has no effect");
  }
  if (given("--fp8-format") && o.plan.grad_wire != parallel::GradWire::kFP8)
    out.push_back(fmt::format("--fp8-format {} only chooses the E4M3 format of --grad-comm fp8: it has no effect with "
                              "--grad-comm {}",
                              to_string(o.plan.fp8_format), parallel::to_string(o.plan.grad_wire)));
  if (given("--recompute-layers") && o.plan.recompute != parallel::Recompute::kFull)
    out.push_back(fmt::format("--recompute-layers only chooses the blocks --recompute full reruns: it has no effect "
                              "with --recompute {}",
                              parallel::to_string(o.plan.recompute)));
  if (given("--zero-prefetch") && (o.plan.zero < 3 || !o.plan.sharded()))
    out.push_back("--zero-prefetch only sets how far ahead --zero 3 gathers weights over more than one data-parallel "
                  "replica: it has no effect here");
  if (given("--min-lr") && o.schedule == optim::Schedule::Kind::kConstant)
    out.push_back("--min-lr has no effect with --lr-schedule constant (only cosine decays to it)");
  if (o.val_data.empty())
    for (const char* flag : {"--eval-every", "--eval-batches"})
      if (given(flag))
        out.push_back(fmt::format("{} has no effect without --val-data (nothing is validated)", flag));
  if (o.save_hf.empty())
    for (const char* flag : {"--save-shard-size", "--save-dtype"})
      if (given(flag))
        out.push_back(fmt::format("{} has no effect without --save-hf (it shapes that output only)", flag));
  if (given("--logits-tokens") && o.dump_logits.empty())
    out.push_back("--logits-tokens has no effect without --dump-logits FILE (the prompt is only for that dump)");
  if (o.checkpoint_dir.empty()) {
    if (given("--keep-checkpoints"))
      out.push_back("--keep-checkpoints has no effect without --checkpoint-dir (no checkpoints are written)");
    if (given("--resume") && o.resume == "never")
      out.push_back("--resume never has no effect without --checkpoint-dir (there is nothing to resume)");
  }
  return out;
}

}  // namespace trn::train
