// trn-train's command line.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "runtime/model/config.h"
#include "runtime/optim/adamw.h"
#include "runtime/parallel/plan.h"

namespace trn::train {

struct Options {
  std::string model_name = "tiny";  // the preset (--model), or the family's first for --arch alone
  std::string arch;                 // --arch; empty: the preset's family
  model::Config model = model::preset("tiny");
  std::string data;  // empty: the built-in corpus
  int64_t steps = 200;
  int batch_size = 8;  // sequences per step, global
  int seq_len = 0;     // 0: the model's context
  float lr = 1e-3f;
  optim::Schedule::Kind schedule = optim::Schedule::Kind::kCosine;
  int64_t warmup_steps = 0;
  float min_lr = -1.0f;  // < 0: lr / 10
  float weight_decay = 0.1f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float grad_clip = 1.0f;
  uint64_t seed = 1337;
  // Validation (Trainer::evaluate): the mean token loss over eval_batches global batches of
  // val_data, drawn by a sampler of its own seed, every eval_every steps and after the last one
  // (eval_every 0: only after the last). Empty val_data: no evaluation.
  std::string val_data;
  int64_t eval_every = 0;
  int eval_batches = 8;
  std::string init, save;
  // Hugging Face directories (runtime/io/hf_dir.h, docs/huggingface.md): --init-hf takes the model
  // from DIR/config.json and its weights from DIR's safetensors; --save-hf writes the trained
  // model as one, in files of at most save_shard_size bytes of save_dtype (bf16 | f32).
  std::string init_hf, save_hf;
  uint64_t save_shard_size = 5000000000;
  std::string save_dtype = "bf16";
  int threads = 0;  // 0: TRN_THREADS, else 1
  int log_every = 10;
  std::string metrics_jsonl;
  bool metrics_moe_loads = false;  // --metrics-moe-loads: the expert loads on each metrics line
  std::string dump_batches;  // write every step's global batch (int32 tokens) to this file
  // --dump-logits FILE: the logits of the prompt logits_tokens (at most seq_len ids), as float32
  // [tokens, vocab], from one forward through the run's layout after loading and before step 1
  // (Trainer::dump_logits).
  std::string dump_logits;
  std::vector<int32_t> logits_tokens;
  std::string trace;         // Chrome trace-event JSON; "{rank}" in it: one file per rank
  std::string checkpoint_dir;        // sharded checkpoints go under it (runtime/checkpoint)
  int64_t checkpoint_every = 0;      // steps between checkpoints (0: only with --checkpoint-dir, at the end)
  int keep_checkpoints = 3;
  std::string resume = "auto";       // auto | never | PATH
  bool allow_changed_settings = false;  // resume although the checkpoint's settings differ
  // In-memory snapshots every N steps (0: none): this rank's state copied into its own memory
  // and a buddy's (runtime/train/snapshot.h), from which trnrun --recovery in-place resumes.
  int64_t snapshot_every = 0;
  // The job's generation this trainer runs in (TRN_GENERATION; set by train_main, not a flag):
  // a restarted generation resumes its own run's newest checkpoint.
  int64_t generation = 0;
  // The job's parallel plan (parallel/plan.h): --dp, --tp, --pp, --micro-batches, --schedule,
  // --virtual-stages, --zero, --bucket-mb and --grad-comm, parsed into it; everything after the
  // options reads the layout from it. Without --dp the replicas fill the job: dp = workers /
  // (tp x pp), set by resolve_layout. An elastic job (trnrun --nnodes MIN:MAX) then trains on
  // whatever hosts its generation has. --zero 1 with one replica has nothing to shard and trains
  // as 0 (Plan::sharded()).
  parallel::Plan plan;
  bool dp_given = false;
  // --shard-group host: the shard group is the data-parallel ranks of one host (its workers / tp),
  // set by resolve_layout from the launcher's ranks per host.
  bool shard_group_host = false;
  std::set<std::string> flags_given;  // every flag on the command line (ignored_flags)
  // fp32 | bf16: how the model computes (model::Precision; sets model.precision). The weights,
  // their gradients, AdamW's state and checkpoints are fp32 either way.
  std::string precision = "fp32";
  std::string bf16_kernels = "auto";  // auto | emulated | onednn (runtime/kernels/bf16.h)
};

// Parses argv (without argv[0]). Usage errors name the flag. Returns false when --help printed.
bool parse_options(const std::vector<std::string>& args, Options* out);
// Resolves the plan for a job of `world` workers: fixes dp (when --dp was not given) and checks
// that the batch divides into it; a layout that does not fit the job is left for check_layout
// to name.
// ranks_per_host: the launcher's workers per host (--shard-group host; 0: unknown).
void resolve_layout(Options* o, int world, int ranks_per_host = 0);
std::string usage_text();  // --help: rendered from the flag table (collectives/core/flags.h)
// One warning per flag that the resolved options make ineffective (--bf16-kernels without
// --precision bf16, --grad-comm or --zero 1 with one data-parallel replica, ...); empty when
// every flag given takes effect. Call after resolve_layout.
std::vector<std::string> ignored_flags(const Options& o);

}  // namespace trn::train
