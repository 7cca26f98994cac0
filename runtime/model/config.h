// A model's shape (Config, of any family), which part of it a rank holds (Placement), and the
// layout of that part's parameters in one flat buffer (ParamLayout): the whole model, or one
// tensor-parallel shard of a range of its blocks. Every tensor records the global (Hugging Face)
// tensor it slices, which saving, loading and checkpoints map through with no family-specific
// code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace trn::model {

// How the float model computes (--precision). kBf16: the matmuls take bf16 operands (weights
// from a bf16 copy of the fp32 master, activations stored as bf16) and sum in fp32; everything
// else is fp32 (runtime/model/stage.h). Not part of the shape: never saved, never compared.
enum class Precision { kFp32, kBf16 };

// A model's shape: its family (--arch, runtime/model/family.h) and the fields that family
// reads. The first five are every family's; the rest are read by the families that have them
// (GPT-2 has no KV heads, rotary embedding or untied head). They are one flat struct on purpose:
// describe() / parse_config() (checkpoints' manifests), the options, trn-plan and the Hugging
// Face config reader each read one key=value record, and a family lists its keys (Family::fields)
// rather than owning a type of its own that each of them would have to dispatch on.
struct Config {
  int n_layer = 2;
  int n_head = 4;
  int d_model = 128;
  int ctx = 128;     // max sequence length (rows of GPT-2's wpe)
  int vocab = 256;
  Precision precision = Precision::kFp32;
  std::string arch = "gpt2";
  int n_kv_head = 0;   // grouped-query attention: heads of k and v (0: n_head)
  int ffn_dim = 0;     // the MLP's hidden width (0: the family's default, 4 d_model for GPT-2)
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  bool tie_embeddings = true;  // the LM head is the token embedding
  int head_size = 0;           // an explicit head dimension (Hugging Face head_dim; 0: d_model / n_head)
  bool qkv_bias = false;       // q, k and v projections with biases (Qwen2)
  // RoPE scaling of Hugging Face's rope_type "llama3" (Llama-3.1 and 3.2): rotary frequencies
  // with wavelengths above original_ctx / low_freq_factor are divided by rope_factor, those below
  // original_ctx / high_freq_factor kept, and those between interpolated (0: no scaling).
  double rope_factor = 0;
  double rope_low_freq_factor = 1;
  double rope_high_freq_factor = 4;
  int rope_original_ctx = 8192;
  // Mixture of experts (--arch mixtral): each block's MLP is n_experts SwiGLU experts of ffn_dim
  // each, top_k of them per token, their weights renormalised over the k (moe_norm_topk, as
  // Mixtral) or the raw router probabilities (as OLMoE); runtime/kernels/moe.h has the maths.
  // n_experts 0: a dense MLP.
  int n_experts = 0;
  int top_k = 0;
  bool moe_norm_topk = true;
  // DeepSeek-V3's balancing without a loss (--moe-balance bias): each MoE layer holds a bias per
  // expert (a tensor of the model, never trained by the optimizer), added to the router's logits
  // for the choice only and moved toward balance after every step (Trainer).
  bool moe_bias = false;
  // How the MoE layer trains, not the model's shape (describe() leaves them out): each expert's
  // capacity per sequence as a factor of an even share (0: dropless), the coefficient of the
  // load-balancing loss added to the cross-entropy, and the balancing bias's rate
  // (kernels::moe::update_bias: each step moves it by rate x the expert's relative shortfall).
  double capacity_factor = 0;
  double moe_aux_coef = 0.01;
  double moe_bias_rate = 0.15;
  // Full activation recomputation (parallel::Plan's --recompute): the first `recompute` blocks of
  // each chunk keep only their output and rerun their forward at the start of their backward (0:
  // none; more than a chunk has: all of its blocks). How the stages compute, not the model's
  // shape: describe() leaves it out.
  int recompute = 0;
  // Selective recomputation: the blocks not recomputed in full keep neither their norms' outputs
  // nor (GPT-2) their MLP activation; each block's backward computes them again first.
  bool recompute_selective = false;
  // Sequence parallelism (parallel::Plan's --sequence-parallel), under tensor parallelism: between
  // the tensor-parallel regions each tp rank holds a contiguous 1/tp of the micro-batch's B x T
  // token rows (SeqRows, stage.h); a no-op at tp 1.
  bool sequence_parallel = false;

  int head_dim() const { return head_size > 0 ? head_size : d_model / n_head; }
  int kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  int ffn() const { return ffn_dim > 0 ? ffn_dim : 4 * d_model; }
  bool moe() const { return n_experts > 0; }
  // Throws a usage error naming the bad field when the shape is not a valid model of its family.
  void validate() const;
  // "n_layer=2 n_head=4 d_model=128 ctx=128 vocab=256" for GPT-2; other families lead with
  // "arch=NAME" and list their fields (family.h). What checkpoints and saved files record.
  std::string describe() const;
  // trn-train's (and trn-plan's) flags for this shape: "--arch NAME" and each of the family's
  // fields (family.h) as --field-name VALUE, n_kv_head and ffn_dim resolved (never 0).
  std::string flags() const;
};

// The model a describe() string names, or a usage error saying what in it is wrong. Only the
// exact form describe() writes is accepted.
Config parse_config(const std::string& described);

// A preset by --model name, of any family ("tiny", "small", "gpt2", "llama-tiny", ...); a usage
// error listing them for another name.
Config preset(const std::string& name);

// A contiguous range of blocks [first_layer, end_layer) a rank runs as one pipeline chunk, with
// the embedding in front (the first pipeline stage) and the final LayerNorm and LM head behind
// (the last).
struct Chunk {
  int first_layer = 0, end_layer = 0;
  bool embedding = false, head = false;
};

// Which part of the model one rank holds: its tensor-parallel shard (tp_rank of tp) of its
// chunks (one per virtual pipeline stage it runs, in model order). No chunks: the whole model
// as one chunk, as one process holds it.
struct Placement {
  int tp = 1, tp_rank = 0;
  std::vector<Chunk> chunks;
  // Context parallelism (parallel::Plan::cp): a stage runs Tn = seq_len / cp tokens of each
  // sequence, chunks cp_rank and 2 cp - 1 - cp_rank of its 2 cp equal chunks (head and tail: under
  // the causal mask every cp rank then does the same attention work).
  int cp = 1, cp_rank = 0;
  // Expert parallelism (parallel::Plan::ep): a rank holds experts [ep_rank, ep_rank + 1) x
  // n_experts / ep of each MoE layer.
  int ep = 1, ep_rank = 0;
  // The position in its sequence of a stage's token t of Tn.
  int position(int t, int Tn) const {
    if (cp == 1) return t;
    const int L = Tn / 2;
    return (t < L ? cp_rank : 2 * cp - 1 - cp_rank) * L + t % L;
  }
};

// Rows of wte (and columns of the logits) under tensor parallelism: the vocabulary rounded up to
// a multiple of tp, so every rank holds as many rows. Rows past c.vocab are padding: zero, masked
// out of the softmax, never in a saved file.
int64_t padded_vocab(const Config& c, int tp);

// Throws a usage error naming the values and what would work when c cannot be split tp ways
// (the family's rule: for GPT-2 tp must divide n_head, so every shard holds whole heads).
void check_tensor_parallel(const Config& c, int tp);

// One tensor of this rank's buffer: a slice of a global (Hugging Face) tensor. Replicated tensors
// (shard_dim -1) are the whole global tensor. A sharded one holds, along shard_dim, the
// `length` entries from `shard_offset` of each of `interleave` equal parts of that dimension:
// c_attn's q, k and v parts are each split by heads (interleave 3); wte is split by rows of the
// padded vocabulary, so its last shard may reach past the global rows (padding).
struct TensorSpec {
  std::string name;                   // Hugging Face name, e.g. "h.0.attn.c_attn.weight"
  std::vector<int64_t> shape;         // this rank's shape (the family's: GPT-2 linears are [in, out])
  std::vector<int64_t> global_shape;  // the HF shape
  int shard_dim = -1;
  int64_t shard_offset = 0, shard_length = 0;
  int interleave = 1;
  size_t offset = 0;  // first element in the parameter buffer
  size_t numel = 0;
  bool decay = false;  // AdamW weight decay applies (2-D tensors only)
  // How init_params fills it: N(0, init_std) from the counter-based generator, or a constant.
  enum class Init { kNormal, kOnes, kZeros };
  Init init = Init::kNormal;
  double init_std = 0.02;
  // The embedding that is also the LM head (tied): under pipeline parallelism the first and the
  // last stage each hold a copy, whose gradients are summed over the embedding group; it is
  // counted once (on pipeline rank 0) in the gradient norm and the gathered model.
  bool tied = false;
  bool matmul = false;  // a matmul weight: Precision::kBf16 multiplies its bf16 copy (Bf16Weights)
  // One MoE expert's tensor: under expert parallelism only its expert rank holds it, so its
  // gradient is summed over that rank's expert replicas, it counts in the gradient norm on every
  // expert rank, and every expert rank's first replica saves it (parallel::Plan::ep).
  bool expert = false;
  bool replicated() const { return shard_dim < 0; }
  // Global flat index of local element i, or -1 for a padding element (no global counterpart).
  int64_t global_index(size_t i) const;
};

// Copies between a rank's slice (local, spec.numel elements) and the whole global tensor
// (global, the product of global_shape elements). to_global leaves padding out; from_global
// fills padding with zeros.
void copy_from_global(const TensorSpec& spec, const float* global, float* local);
void copy_to_global(const TensorSpec& spec, const float* local, float* global);
// Calls run(local_first, global_first, count) for each contiguous run of elements of the slice,
// in local order (padding, which has no global elements, is in no run): what a loader that reads
// only its slice's bytes of a file walks.
void for_each_run(const TensorSpec& spec, const std::function<void(size_t, size_t, size_t)>& run);

// The tensors one rank holds (Placement), in one flat buffer ordered by when backward finishes
// each tensor's gradient: chunk by chunk from the last to the first, inside a chunk the head's
// tensors, then the blocks from last to first, then the embedding's. So during backward the
// final gradients grow as one prefix [0, n) of the gradient buffer, and data parallelism can
// all-reduce complete buckets while earlier layers still compute. Which tensors, their shapes,
// shards and initialisation come from the family's spec (family.h), which adds them through
// add() as the constructor calls it.
class ParamLayout {
 public:
  explicit ParamLayout(const Config& c, Placement p = {});
  const Config& config() const { return c_; }
  const Placement& placement() const { return p_; }
  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  size_t total() const { return total_; }
  const TensorSpec& find(const std::string& name) const;  // internal error when absent
  const TensorSpec* find_or_null(const std::string& name) const;
  // The tied embedding and LM head when this rank holds it (TensorSpec::tied), else null.
  const TensorSpec* tied() const;

  // Shard sizes under tensor parallelism (tp = placement().tp): attention heads, KV heads, the
  // attention's width (heads x head_dim), the MLP's hidden width, vocabulary rows.
  int local_heads() const { return c_.n_head / p_.tp; }
  int local_kv_heads() const { return c_.kv_heads() / p_.tp; }
  int local_attn() const { return local_heads() * c_.head_dim(); }
  int local_mlp() const { return c_.ffn() / p_.tp; }
  // The MoE experts this rank holds: local_experts() from first_expert() (expert parallelism).
  int local_experts() const { return c_.n_experts / p_.ep; }
  int first_expert() const { return local_experts() * p_.ep_rank; }
  int64_t local_vocab() const { return vocab_rows_; }
  int64_t vocab_begin() const { return vocab_rows_ * p_.tp_rank; }  // first global row held here
  const std::vector<Chunk>& chunks() const { return p_.chunks; }
  // Chunk c's tensors: [first, second) of the buffer.
  std::pair<size_t, size_t> chunk_range(int c) const { return chunk_ranges_.at(c); }
  // This rank holds the whole model, unsharded (what a safetensors file stores).
  bool whole() const;

  // Offsets, valid when the placement holds them: the token embedding, the LM head's weight
  // (the embedding itself when tied), the final norm, and the family's extra ones (GPT-2's
  // position embedding) in the order its spec added them.
  size_t embedding = 0, head = 0;
  std::vector<size_t> final_norm, extra;
  size_t head_end = 0;  // where the last chunk's head tensors end (its first prefix_done)
  // Per global layer (valid for the layers held): the block's tensors' offsets in the order its
  // spec added them, and the block's range [begin, end) of the buffer.
  struct Block {
    std::vector<size_t> at;
    size_t begin = 0, end = 0;
  };
  std::vector<Block> blocks;

  // For the family's spec (family.h): appends one tensor, the slice this rank holds of the
  // global tensor `global` (sharded along dim when tp > 1: `length` entries from `offset` of
  // each of `interleave` equal parts; dim -1: replicated), and returns it for its flags.
  TensorSpec& add(const std::string& name, std::vector<int64_t> global, int dim = -1, int64_t offset = 0,
                  int64_t length = 0, int interleave = 1);

 private:
  Config c_;
  Placement p_;
  int64_t vocab_rows_ = 0;
  std::vector<std::pair<size_t, size_t>> chunk_ranges_;
  std::vector<TensorSpec> tensors_;
  size_t total_ = 0;
};

// Floating point operations of one training step (forward + backward) per token, the usual
// 6 * matmul parameters + attention count.
double flops_per_token(const Config& c, int seq_len);

}  // namespace trn::model
