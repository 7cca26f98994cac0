// GPT-2 shape (presets tiny, small, gpt2) and the layout of a rank's parameters in one flat
// buffer: the whole model, or one tensor-parallel shard of a range of its blocks.
//
// The buffer is ordered by when backward finishes each tensor's gradient: ln_f first, then the
// blocks from last to first (inside a block: mlp.c_proj, mlp.c_fc, ln_2, attn.c_proj,
// attn.c_attn, ln_1), then wpe and wte (wte last: the tied LM head and the embedding both add to
// its gradient). So during backward the final gradients grow as one prefix [0, n) of the
// gradient buffer, and data parallelism can all-reduce complete buckets while earlier layers
// still compute.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace trn::model {

// How the float model computes (--precision). kBf16: the matmuls take bf16 operands (weights
// from a bf16 copy of the fp32 master, activations stored as bf16) and sum in fp32; everything
// else is fp32 (runtime/model/stage.h). Not part of the shape: never saved, never compared.
enum class Precision { kFp32, kBf16 };

struct Config {
  int n_layer = 2;
  int n_head = 4;
  int d_model = 128;
  int ctx = 128;     // max sequence length (rows of wpe)
  int vocab = 256;
  Precision precision = Precision::kFp32;

  int head_dim() const { return d_model / n_head; }
  // Throws a usage error naming the bad field when the shape is not a valid GPT-2.
  void validate() const;
  std::string describe() const;  // "n_layer=2 n_head=4 d_model=128 ctx=128 vocab=256"
};

// "tiny" (2, 4, 128, 128), "small" (4, 8, 256, 256), "gpt2" (12, 12, 768, 1024, vocab 50257).
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
};

// Rows of wte (and columns of the logits) under tensor parallelism: the vocabulary rounded up to
// a multiple of tp, so every rank holds as many rows. Rows past c.vocab are padding: zero, masked
// out of the softmax, never in a saved file.
int64_t padded_vocab(const Config& c, int tp);

// Throws a usage error naming the values and what would work when c cannot be split tp ways
// (tp must divide n_head; every shard then holds n_head / tp whole heads).
void check_tensor_parallel(const Config& c, int tp);

// One tensor of this rank's buffer: a slice of a global (Hugging Face) tensor. Replicated tensors
// (shard_dim -1) are the whole global tensor. A sharded one holds, along shard_dim, the
// `length` entries from `shard_offset` of each of `interleave` equal parts of that dimension:
// c_attn's q, k and v parts are each split by heads (interleave 3); wte is split by rows of the
// padded vocabulary, so its last shard may reach past the global rows (padding).
struct TensorSpec {
  std::string name;                   // Hugging Face GPT-2 name, e.g. "h.0.attn.c_attn.weight"
  std::vector<int64_t> shape;         // this rank's shape; linear weights are [in, out]
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
  bool replicated() const { return shard_dim < 0; }
  // Global flat index of local element i, or -1 for a padding element (no global counterpart).
  int64_t global_index(size_t i) const;
};

// Copies between a rank's slice (local, spec.numel elements) and the whole global tensor
// (global, the product of global_shape elements). to_global leaves padding out; from_global
// fills padding with zeros.
void copy_from_global(const TensorSpec& spec, const float* global, float* local);
void copy_to_global(const TensorSpec& spec, const float* local, float* global);

// Offsets of one block's tensors, in elements.
struct BlockOffsets {
  size_t ln1_w, ln1_b, attn_w, attn_b, attnproj_w, attnproj_b;
  size_t ln2_w, ln2_b, fc_w, fc_b, fcproj_w, fcproj_b;
  size_t begin, end;  // the block's range in the buffer
};

// The tensors one rank holds (Placement), in one flat buffer ordered as the file comment says,
// chunk by chunk from the last to the first (the order their final gradients appear in).
// Local sizes under tensor parallelism: C = d_model, T = tp; c_attn [C, 3C/T], attn.c_proj
// [C/T, C], c_fc [C, 4C/T], mlp.c_proj [4C/T, C], wte [padded_vocab/T, C]; the rest replicated.
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

  // Shard sizes: heads, columns of the attention (C/T) and MLP (4C/T), vocabulary rows.
  int local_heads() const { return c_.n_head / p_.tp; }
  int local_attn() const { return c_.d_model / p_.tp; }
  int local_mlp() const { return 4 * c_.d_model / p_.tp; }
  int64_t local_vocab() const { return vocab_rows_; }
  int64_t vocab_begin() const { return vocab_rows_ * p_.tp_rank; }  // first global row of wte here
  const std::vector<Chunk>& chunks() const { return p_.chunks; }
  // Chunk c's tensors: [first, second) of the buffer.
  std::pair<size_t, size_t> chunk_range(int c) const { return chunk_ranges_.at(c); }
  // This rank holds the whole model, unsharded (what a safetensors file stores).
  bool whole() const;

  size_t wte = 0, wpe = 0, lnf_w = 0, lnf_b = 0;  // valid when the placement holds them
  std::vector<BlockOffsets> blocks;  // indexed by global layer; valid for the layers held

 private:
  size_t add(const std::string& name, std::vector<int64_t> global, int dim = -1, int64_t offset = 0,
             int64_t length = 0, int interleave = 1);
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
