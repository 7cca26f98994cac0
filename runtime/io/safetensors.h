// A model's weights as safetensors (F32, the family's Hugging Face names and shapes): the file
// loads in PyTorch / transformers as the model's state dict, and the other way round.
//
// Format: 8-byte little-endian header length, a JSON header mapping each tensor name to
// {"dtype", "shape", "data_offsets": [begin, end]} (offsets into the data that follows), then
// the data. Files are written to a temporary name, fsynced and renamed.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "runtime/model/config.h"

namespace trn::io {

struct TensorEntry {
  std::string dtype;
  std::vector<int64_t> shape;
  size_t begin = 0, end = 0;  // byte range in the data section
};

// A parsed safetensors file. Usage errors (naming the file) for a missing file or a corrupt
// header: bad length, malformed JSON, offsets outside the data.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  const std::map<std::string, TensorEntry>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const char* data(const TensorEntry& t) const { return bytes_.data() + data_start_ + t.begin; }

 private:
  std::string path_;
  std::string bytes_;
  size_t data_start_ = 0;
  std::map<std::string, TensorEntry> tensors_;
  std::map<std::string, std::string> metadata_;
};

// The __metadata__ strings of a safetensors file, reading only its header.
std::map<std::string, std::string> read_safetensors_metadata(const std::string& path);

// Writes every parameter of `layout` from `params` (the flat buffer). The layout must be the whole
// model (no shards: gather them first, runtime/parallel/gather.h).
void save_gpt2(const std::string& path, const model::ParamLayout& layout, const float* params,
               const std::map<std::string, std::string>& metadata = {});

// Fills `params`, this rank's part of the model (any Placement), from a file of the whole model:
// each tensor this rank holds takes its slice. Every tensor of the model must be present as F32
// with its global shape; otherwise a usage error names the tensor, what it found and what it needs.
// A "transformer." prefix is accepted, and the non-parameter entries of Hugging Face files
// (attn.bias, attn.masked_bias, a tied model's lm_head.weight, rotary_emb.inv_freq) are ignored; any other
// extra tensor is an error.
void load_gpt2(const std::string& path, const model::ParamLayout& layout, float* params);

}  // namespace trn::io
