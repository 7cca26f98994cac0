// GPT-2 shape (presets tiny, small, gpt2) and the layout of its parameters in one flat buffer.
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

struct Config {
  int n_layer = 2;
  int n_head = 4;
  int d_model = 128;
  int ctx = 128;     // max sequence length (rows of wpe)
  int vocab = 256;

  int head_dim() const { return d_model / n_head; }
  // Throws a usage error naming the bad field when the shape is not a valid GPT-2.
  void validate() const;
  std::string describe() const;  // "n_layer=2 n_head=4 d_model=128 ctx=128 vocab=256"
};

// "tiny" (2, 4, 128, 128), "small" (4, 8, 256, 256), "gpt2" (12, 12, 768, 1024, vocab 50257).
Config preset(const std::string& name);

struct TensorSpec {
  std::string name;            // Hugging Face GPT-2 name, e.g. "h.0.attn.c_attn.weight"
  std::vector<int64_t> shape;  // HF shape; linear weights are [in, out]
  size_t offset = 0;           // first element in the parameter buffer
  size_t numel = 0;
  bool decay = false;          // AdamW weight decay applies (2-D tensors only)
};

// Offsets of one block's tensors, in elements.
struct BlockOffsets {
  size_t ln1_w, ln1_b, attn_w, attn_b, attnproj_w, attnproj_b;
  size_t ln2_w, ln2_b, fc_w, fc_b, fcproj_w, fcproj_b;
  size_t begin, end;  // the block's range in the buffer
};

class ParamLayout {
 public:
  explicit ParamLayout(const Config& c);
  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  size_t total() const { return total_; }
  const TensorSpec& find(const std::string& name) const;  // internal error when absent

  size_t wte = 0, wpe = 0, lnf_w = 0, lnf_b = 0;
  std::vector<BlockOffsets> blocks;  // indexed by layer

 private:
  size_t add(const std::string& name, std::vector<int64_t> shape);
  std::vector<TensorSpec> tensors_;
  size_t total_ = 0;
};

// Floating point operations of one training step (forward + backward) per token, the usual
// 6 * matmul parameters + attention count.
double flops_per_token(const Config& c, int seq_len);

}  // namespace trn::model
