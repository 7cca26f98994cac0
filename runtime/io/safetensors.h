// A model's weights as safetensors (F32, the family's Hugging Face names and shapes): the file
// loads in PyTorch / transformers as the model's state dict, and the other way round.
//
// Format: 8-byte little-endian header length, a JSON header mapping each tensor name to
// {"dtype", "shape", "data_offsets": [begin, end]} (offsets into the data that follows), then
// the data. Files are written to a temporary name, fsynced and renamed. Files are read through a
// read-only mmap: a reader touches only the pages of the tensors (and rows) it copies, and gives
// them back (release) once copied, so loading a shard of a model never holds the whole file.
// (A file truncated by another process while mapped faults its reader: model files are not
// expected to change while they load.)
// Hugging Face directories (config.json, shards, index) are runtime/io/hf_dir.h.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json_fwd.hpp>
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
  // `what` names the file in errors about opening it ("safetensors file", "--init-hf shard").
  explicit SafetensorsFile(const std::string& path, const std::string& what = "safetensors file");
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  const std::string& path() const { return path_; }
  const std::map<std::string, TensorEntry>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The tensor's bytes in the mapping (not aligned: the header may have any length).
  const char* data(const TensorEntry& t) const { return map_ + data_start_ + t.begin; }
  // Drops the tensor's pages from this process's memory (they come back from the file if read
  // again): a loader calls it after copying a tensor, so its resident set holds one tensor of the
  // file at a time.
  void release(const TensorEntry& t) const;

 private:
  std::string path_;
  const char* map_ = nullptr;
  size_t size_ = 0;
  size_t data_start_ = 0;
  void unmap();
  void parse_header(const nlohmann::json& header, size_t data_size);
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
