// A model family (GPT-2, Llama, ...) is a specification: its shape fields and presets, the
// tensors of each part with their Hugging Face names, shards and initialisation, and its bodies:
// a composition of the shared layers (layers/block.h) with its names and hyperparameters.
// Everything parallel is shared: ParamLayout lays out whatever tensors a spec adds, TP shards,
// pipeline chunks, checkpoints with reshard, --save / --init and trn-ckpt consolidate read only
// the TensorSpecs, a Stage runs the composed bodies through one slot machine (stage_impl.h), and
// the planner and calibration ask this struct (fields, block_counts), never the name.
//
// A family lives in its own files, runtime/model/<name>.h, <name>_spec.cc (this struct),
// <name>_block.cc (its layers: ComposedBody's L) and <name>_decode.cc (its KV-cached decoder), and
// is registered by one line of families.cc; a family built on another's block reuses what that
// family's header exports for it (Mixtral: llama.h). A new kind of layer goes into layers/ with
// what it needs of the shared code declared by the layer (layers/README.md, "What a layer owns"):
// its refusals (Refusals, below), its flags, its report. Shape fields go into Config (config.h
// says why they are shared).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "runtime/model/config.h"
#include "runtime/model/decode.h"

namespace trn::tp {
class Region;
}

namespace trn::model {

template <typename T>
class StageBody;

template <typename T>
struct StageFactory {
  // Chunk `chunk` of layout, with activation slots for `slots` micro-batches of (batch, seq_len).
  std::unique_ptr<StageBody<T>> (*make)(const ParamLayout& layout, int batch, int seq_len, int slots,
                                        tp::Region& tp, int chunk);
  // The bytes make() would allocate for activations and scratch, without allocating them.
  size_t (*activation_bytes)(const ParamLayout& layout, int batch, int seq_len, int slots, int chunk);
};

// What the planner (runtime/plan) counts of one block, from the family's layers at tp 1
// (ComposedBody::counts).
struct BlockCounts {
  size_t norm_params = 0;        // one norm's (summed over tp per norm under sequence parallelism)
  double mlp_weights = 0;        // the MLP's matmul weights
  double mlp_activation_ops = 0; // per MLP hidden element, what selective recomputation reruns
};

// Parallel layouts a family's layers cannot run, each the reason it cannot (null: it can);
// parallel::Plan refuses them as "--cp N with WHAT: WHY". The layer that cannot declares them
// (MoeMlp::kRefusals), and its family passes them on.
struct Refusals {
  const char* what = nullptr;         // the model as the refusal names it: "a mixture of experts"
  const char* cp = nullptr;           // context parallelism (--cp above 1)
  const char* zero_bubble = nullptr;  // --schedule zb under pipeline parallelism
};

struct Preset {
  std::string name;  // --model
  Config config;
  std::string help;  // the shape, for --help
};

struct Family {
  std::string name;                 // --arch
  std::vector<Preset> presets;
  std::vector<std::string> fields;  // Config fields its describe() lists, in order (config.cc)
  // Fields describe() lists after those only where they differ from a default Config's (so a
  // model without them describes as it did before they existed), in this order.
  std::vector<std::string> optional_fields;
  // Usage errors naming the flag: a shape this family cannot build, or a tp it cannot split.
  void (*validate)(const Config& c);
  void (*check_tensor_parallel)(const Config& c, int tp);
  // The spec, called by ParamLayout's constructor for each chunk it holds, from the last: the
  // head's tensors (final norm, an untied LM head), each block's (from the last), then the
  // embedding's (and the tied head's copy on a last stage). Each sets the layout's offsets.
  void (*add_head)(ParamLayout& lay);
  void (*add_block)(ParamLayout& lay, int layer);
  void (*add_embedding)(ParamLayout& lay, const Chunk& chunk);
  // Floating point operations of one training step (forward + backward) per token.
  double (*flops_per_token)(const Config& c, int seq_len);
  BlockCounts (*block_counts)(const Config& c);
  StageFactory<float> stage_f;
  StageFactory<double> stage_d;
  // The KV-cached decoder of the whole model that trn-generate samples with (decode.h).
  DecoderFactory make_decoder;
  // What its layers cannot run (none for GPT-2 and Llama; Mixtral's are the MoE layer's).
  Refusals refusals = {};

  template <typename T>
  const StageFactory<T>& stage() const {
    if constexpr (std::is_same_v<T, float>) return stage_f;
    else return stage_d;
  }
};

// Every registered family, in --help order (families.cc).
const std::vector<const Family*>& families();
// The family named `arch`; a usage error listing the families for another name.
const Family& family(const std::string& arch);

}  // namespace trn::model
