#include "runtime/train/options.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <type_traits>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>

#include <unistd.h>

#include "collectives/core/error.h"
#include "collectives/core/settings.h"
#include "runtime/train/dp_sync.h"
#include "runtime/pipeline_parallel/pipeline.h"

namespace trn::train {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;
constexpr double kMaxBucketMb = 1024.0 * 1024.0;  // 1 TiB
constexpr int64_t kMaxWorkers = std::numeric_limits<int>::max();  // ranks are ints

template <typename T>
T number(const std::string& flag, const std::string& v) {
  T out{};
  const char* end = v.data() + v.size();
  auto [p, ec] = std::from_chars(v.data(), end, out);
  if (ec != std::errc() || p != end)
    throw usage_error("{} needs a number, got '{}'", flag, v);
  if constexpr (std::is_floating_point_v<T>)
    if (!std::isfinite(out)) throw usage_error("{} needs a finite number, got '{}'", flag, v);
  return out;
}

template <typename T>
T positive(const std::string& flag, const std::string& v) {
  const T x = number<T>(flag, v);
  if (!(x > 0)) throw usage_error("{} must be positive, got {}", flag, v);
  return x;
}

template <typename T>
T non_negative(const std::string& flag, const std::string& v) {
  const T x = number<T>(flag, v);
  if (x < 0) throw usage_error("{} must not be negative, got {}", flag, v);
  return x;
}

}  // namespace

std::string usage_text() {
  return R"(usage: trn-train [options]
Trains GPT-2 on one process, or as one rank of a data- and tensor-parallel job under
trnrun/mpirun (world size = dp x tp x pp).
  --model tiny|small|gpt2      preset (default tiny): tiny 2x4x128 ctx 128, small 4x8x256 ctx 256,
                               gpt2 12x12x768 ctx 1024 vocab 50257
  --n-layer --n-head --d-model --ctx --vocab N     override the preset
  --data FILE                  raw bytes or llm.c .bin tokens (default: the built-in corpus)
  --steps N (200)  --batch-size N (8, sequences per step, global)  --seq-len N (ctx)
  --lr X (1e-3)  --lr-schedule constant|cosine (cosine)  --warmup-steps N (0)  --min-lr X (lr/10)
  --weight-decay X (0.1)  --beta1 X (0.9)  --beta2 X (0.95)  --grad-clip X (1.0; 0 = off)
  --seed N (1337)  --init FILE.safetensors  --save FILE.safetensors
  --threads N (TRN_THREADS, else 1)  --log-every N (10)  --metrics-jsonl FILE
  --dump-batches FILE          write each step's global batch as int32 [steps, batch, seq+1]
  --checkpoint-dir DIR  --checkpoint-every N  --keep-checkpoints K (3)  --resume auto|never|PATH (auto)
                               sharded checkpoints of weights, AdamW state and data position;
                               auto resumes from the newest committed one in DIR
  --allow-changed-settings     resume although batch, schedule or optimizer settings differ
                               from the checkpoint's (one warning each; else an error)
  --trace FILE                 Chrome trace-event timeline (Perfetto, chrome://tracing): one track
                               per rank, merged by rank 0; {rank} in FILE: one file per rank
  --dp N --tp N --pp N (1)     layout: data-parallel replicas x tensor-parallel shards (tp must
                               divide n_head) x pipeline stages (pp x virtual stages must divide
                               n_layer); without --dp, dp = workers / (tp x pp), so an elastic
                               job trains on the hosts each generation has
  --micro-batches N (1)        pieces of each rank's batch: gradient accumulation, and the
                               micro-batches a pipeline schedule runs
  --schedule gpipe|1f1b|interleaved|zb (1f1b)   pipeline schedule (--pp > 1)
  --virtual-stages V (1)       chunks of layers per pipeline rank (interleaved)
  --bucket-mb X (25)           data-parallel gradient buckets
  --grad-comm f32|bf16|fp8 (f32)   data-parallel gradients on the wire; fp8: e4m3 with a scale
                               per 128 values, a quarter of f32's bytes
  --zero 0|1 (0)               1: ZeRO-1, each data-parallel rank keeps and updates 1/dp of AdamW's
                               state (gradients reduce-scattered, parameters all-gathered)
  --precision fp32|bf16 (fp32) bf16: matmuls on bf16 operands with fp32 sums, their saved inputs
                               stored as bf16; fp32 master weights, AdamW state and checkpoints
  --bf16-kernels auto|emulated|native (auto)   bf16 matmul kernels: native needs AVX512-BF16
)";
}

namespace {

// Products of flags are formed in 64 bits: each factor is an int, so a product of two never
// overflows, and the world size (three factors) is checked after its first two.
void check_batch(const Options& o) {
  if (o.batch_size % (int64_t{o.dp} * o.micro_batches) != 0)
    throw usage_error("--batch-size {} must divide evenly into {} {} x --micro-batches {}", o.batch_size,
                      o.dp_given ? "--dp" : "the job's data-parallel replicas", o.dp, o.micro_batches);
}

}  // namespace

bool parse_options(const std::vector<std::string>& args, Options* o) {
  struct Overrides {
    int n_layer = 0, n_head = 0, d_model = 0, ctx = 0, vocab = 0;
  } ov;
  bool schedule_set = false;
  using Handler = std::function<void(const std::string& flag, const std::string& v)>;
  const std::map<std::string, Handler> flags = {
      {"--model", [&](auto&, auto& v) { o->model_name = v; }},
      {"--n-layer", [&](auto& f, auto& v) { ov.n_layer = positive<int>(f, v); }},
      {"--n-head", [&](auto& f, auto& v) { ov.n_head = positive<int>(f, v); }},
      {"--d-model", [&](auto& f, auto& v) { ov.d_model = positive<int>(f, v); }},
      {"--ctx", [&](auto& f, auto& v) { ov.ctx = positive<int>(f, v); }},
      {"--vocab", [&](auto& f, auto& v) { ov.vocab = positive<int>(f, v); }},
      {"--data", [&](auto&, auto& v) { o->data = v; }},
      {"--steps", [&](auto& f, auto& v) { o->steps = positive<int64_t>(f, v); }},
      {"--batch-size", [&](auto& f, auto& v) { o->batch_size = positive<int>(f, v); }},
      {"--seq-len", [&](auto& f, auto& v) { o->seq_len = positive<int>(f, v); }},
      {"--lr", [&](auto& f, auto& v) { o->lr = non_negative<float>(f, v); }},
      {"--lr-schedule", [&](auto&, auto& v) { o->schedule = optim::parse_schedule(v); }},
      {"--warmup-steps", [&](auto& f, auto& v) { o->warmup_steps = non_negative<int64_t>(f, v); }},
      {"--min-lr", [&](auto& f, auto& v) { o->min_lr = non_negative<float>(f, v); }},
      {"--weight-decay", [&](auto& f, auto& v) { o->weight_decay = non_negative<float>(f, v); }},
      {"--beta1", [&](auto& f, auto& v) { o->beta1 = non_negative<float>(f, v); }},
      {"--beta2", [&](auto& f, auto& v) { o->beta2 = non_negative<float>(f, v); }},
      {"--grad-clip", [&](auto& f, auto& v) { o->grad_clip = non_negative<float>(f, v); }},
      {"--seed", [&](auto& f, auto& v) { o->seed = number<uint64_t>(f, v); }},
      {"--init", [&](auto&, auto& v) { o->init = v; }},
      {"--save", [&](auto&, auto& v) { o->save = v; }},
      {"--threads", [&](auto& f, auto& v) { o->threads = positive<int>(f, v); }},
      {"--log-every", [&](auto& f, auto& v) { o->log_every = positive<int>(f, v); }},
      {"--metrics-jsonl", [&](auto&, auto& v) { o->metrics_jsonl = v; }},
      {"--dump-batches", [&](auto&, auto& v) { o->dump_batches = v; }},
      {"--trace", [&](auto&, auto& v) { o->trace = v; }},
      {"--checkpoint-dir", [&](auto&, auto& v) { o->checkpoint_dir = v; }},
      {"--checkpoint-every", [&](auto& f, auto& v) { o->checkpoint_every = positive<int64_t>(f, v); }},
      {"--keep-checkpoints", [&](auto& f, auto& v) { o->keep_checkpoints = positive<int>(f, v); }},
      {"--resume", [&](auto&, auto& v) { o->resume = v; }},
      {"--dp", [&](auto& f, auto& v) { o->dp = positive<int>(f, v); o->dp_given = true; }},
      {"--tp", [&](auto& f, auto& v) { o->tp = positive<int>(f, v); }},
      {"--pp", [&](auto& f, auto& v) { o->pp = positive<int>(f, v); }},
      {"--micro-batches", [&](auto& f, auto& v) { o->micro_batches = positive<int>(f, v); }},
      {"--schedule", [&](auto&, auto& v) {
         pipeline::parse_kind(v);
         o->pipeline_schedule = v;
         schedule_set = true;
       }},
      {"--virtual-stages", [&](auto& f, auto& v) { o->virtual_stages = positive<int>(f, v); }},
      {"--bucket-mb", [&](auto& f, auto& v) {
         o->bucket_mb = positive<double>(f, v);
         // A bucket holds whole fp32 gradients; one larger than the model is one bucket for all
         // of it, so the limit only keeps the byte count representable.
         if (o->bucket_mb * kMiB < sizeof(float))
           throw usage_error("{} {} is {:.3g} bytes, less than one fp32 gradient (4 bytes); use at least {:.2g}", f, v,
                             o->bucket_mb * kMiB, sizeof(float) / kMiB);
         if (o->bucket_mb > kMaxBucketMb)
           throw usage_error("{} {} is too large: at most {} (1 TiB); a bucket larger than the model's gradients "
                             "is one bucket for all of them", f, v, kMaxBucketMb);
       }},
      {"--zero", [&](auto& f, auto& v) {
         if (v != "0" && v != "1")
           throw usage_error("{} takes 0 or 1 (1: ZeRO-1, AdamW's state sharded over the data-parallel ranks), got '{}'",
                             f, v);
         o->zero = v == "1";
       }},
      {"--precision", [&](auto& f, auto& v) {
         if (v != "fp32" && v != "bf16") throw usage_error("{} takes fp32 or bf16, got '{}'", f, v);
         o->precision = v;
       }},
      {"--bf16-kernels", [&](auto& f, auto& v) {
         if (v != "auto" && v != "emulated" && v != "native")
           throw usage_error("{} takes auto, emulated or native, got '{}'", f, v);
         o->bf16_kernels = v;
       }},
      {"--grad-comm", [&](auto&, auto& v) {
         parse_grad_wire(v);  // a usage error for anything else
         o->grad_comm = v == "fp32" ? "f32" : v;
       }},
  };
  for (size_t i = 0; i < args.size(); ++i) {
    std::string flag = args[i], value;
    if (flag == "-h" || flag == "--help") {
      std::fputs(usage_text().c_str(), stdout);
      return false;
    }
    const auto eq = flag.find('=');
    const bool inline_value = flag.rfind("--", 0) == 0 && eq != std::string::npos;
    if (inline_value) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    }
    if (flag == "--allow-changed-settings" && !inline_value) {  // the one flag without a value
      o->allow_changed_settings = true;
      continue;
    }
    auto it = flags.find(flag);
    if (it == flags.end())
      throw usage_error("unknown option '{}'; run trn-train --help for the list", flag);
    if (!inline_value) {
      if (i + 1 >= args.size()) throw usage_error("{} needs a value", flag);
      value = args[++i];
    }
    it->second(flag, value);
    o->flags_given.insert(flag);
  }
  o->model = model::preset(o->model_name);
  if (ov.n_layer) o->model.n_layer = ov.n_layer;
  if (ov.n_head) o->model.n_head = ov.n_head;
  if (ov.d_model) o->model.d_model = ov.d_model;
  if (ov.ctx) o->model.ctx = ov.ctx;
  if (ov.vocab) o->model.vocab = ov.vocab;
  o->model.precision = o->precision == "bf16" ? model::Precision::kBf16 : model::Precision::kFp32;
  o->model.validate();
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
  model::check_tensor_parallel(o->model, o->tp);
  if (o->checkpoint_every > 0 && o->checkpoint_dir.empty())
    throw usage_error("--checkpoint-every needs --checkpoint-dir DIR");
  if (const int64_t workers = int64_t{o->dp} * o->tp; workers > kMaxWorkers || workers * o->pp > kMaxWorkers)
    throw usage_error("--dp {} x --tp {} x --pp {} is more than {} workers, the most a job can have; use a layout "
                      "of the job's size",
                      o->dp, o->tp, o->pp, kMaxWorkers);
  if (const int64_t chunks = int64_t{o->pp} * o->virtual_stages; chunks > o->model.n_layer)
    throw usage_error("--pp {}{} makes {} pipeline chunks but the model has {} layers (n_layer); each chunk holds at "
                      "least one layer, so use a --pp{} of at most {}",
                      o->pp, o->virtual_stages > 1 ? fmt::format(" x --virtual-stages {}", o->virtual_stages) : "",
                      chunks, o->model.n_layer, o->virtual_stages > 1 ? " x --virtual-stages" : "", o->model.n_layer);
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
  {
    const pipeline::Kind kind = pipeline::parse_kind(o->pipeline_schedule);
    const pipeline::Shape shape{o->pp, o->micro_batches, o->virtual_stages};
    if (o->pp == 1 && (schedule_set || o->virtual_stages > 1))
      throw usage_error("--schedule and --virtual-stages choose how a pipeline runs and need --pp 2 or more "
                        "(got --pp 1)");
    if (o->pp > 1) {
      pipeline::check(kind, shape);
      pipeline::chunks_of(o->model, shape, 0);  // the layers divide into the virtual stages
    }
  }
  check_batch(*o);
  return true;
}

void resolve_layout(Options* o, int world) {
  const int64_t model_parallel = int64_t{o->tp} * o->pp;
  if (!o->dp_given && world % model_parallel == 0) o->dp = std::max<int>(1, int(world / model_parallel));
  check_batch(*o);
}

std::vector<std::string> ignored_flags(const Options& o) {
  std::vector<std::string> out;
  auto given = [&](const char* flag) { return o.flags_given.count(flag) > 0; };
  if (given("--bf16-kernels") && o.bf16_kernels != "auto" && o.precision != "bf16")
    out.push_back(fmt::format("--bf16-kernels {} has no effect with --precision {}: only bf16 matmuls use those "
                              "kernels; add --precision bf16 or drop the flag",
                              o.bf16_kernels, o.precision));
  if (o.dp == 1) {
    if (o.zero) out.push_back("--zero 1 with one data-parallel replica: nothing to shard, AdamW's state stays whole");
    if (given("--grad-comm"))
      out.push_back(fmt::format("--grad-comm {} with one data-parallel replica: no gradients are exchanged, so it "
                                "has no effect",
                                o.grad_comm));
    if (given("--bucket-mb"))
      out.push_back("--bucket-mb with one data-parallel replica: no gradients are exchanged, so it has no effect");
  }
  if (given("--min-lr") && o.schedule == optim::Schedule::Kind::kConstant)
    out.push_back("--min-lr has no effect with --lr-schedule constant (only cosine decays to it)");
  if (o.checkpoint_dir.empty()) {
    if (given("--keep-checkpoints"))
      out.push_back("--keep-checkpoints has no effect without --checkpoint-dir (no checkpoints are written)");
    if (given("--resume") && o.resume == "never")
      out.push_back("--resume never has no effect without --checkpoint-dir (there is nothing to resume)");
  }
  return out;
}

}  // namespace trn::train
