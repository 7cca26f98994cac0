// A Hugging Face model directory's weights, in and out (docs/huggingface.md): the safetensors
// files (one model.safetensors, or model-0000i-of-0000n.safetensors shards with
// model.safetensors.index.json), beside config.json (runtime/io/hf_config.h).
//
// Loading is per rank: each rank maps the files and copies only the byte ranges of its own
// slices (TensorSpec: tensor-parallel shard, pipeline chunks), converting BF16 and F16 to fp32 as
// it goes and dropping each tensor's pages once copied, so its memory holds its part of the model
// and at most one tensor of the file. Saving writes the whole model (gather the shards first) into
// a temporary sibling directory, fsynced, then renamed into place: a crash or a full disk leaves
// the destination as it was.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "runtime/model/config.h"

namespace trn::io {

// Fills `params`, this rank's part of the model (any Placement), from DIR's safetensors. Strict:
// every tensor of the model present, with its global shape, as F32, BF16 or F16 and finite; no
// tensor that is not a parameter (except a tied model's lm_head.weight and rotary inv_freq
// buffers); the index's shards present and holding what it says. Otherwise one usage error
// naming `flag`, the file and the tensor.
void load_hf(const std::string& dir, const model::ParamLayout& layout, float* params,
             const std::string& flag = "--init-hf");

struct HfSave {
  bool bf16 = true;                             // --save-dtype: bf16 (round to nearest even) or f32
  uint64_t shard_bytes = 5000000000;            // --save-shard-size: transformers' default, 5 GB
  std::string source_dir;                       // --init-hf's directory: config token ids, tokenizer files
  std::map<std::string, std::string> metadata;  // beside {"format": "pt"} in every file
};

// Writes DIR: config.json (v4 spelling), the weights of `whole` (the whole model: ParamLayout
// of the Config, no shards) in files of at most shard_bytes (a tensor larger than that alone in
// one), model.safetensors when they fit one file (as transformers writes it) or shards with an
// index (keys sorted, metadata.total_size), and the side files (hf_config.h's kHfSideFiles) that
// source_dir has, byte for byte. No lm_head.weight when tied. `flag` names it in errors.
void save_hf(const std::string& dir, const model::ParamLayout& whole, const float* params, const HfSave& opt,
             const std::string& flag = "--save-hf");

// A usage error naming `flag` unless save_hf may write DIR: it is absent (with a writable parent),
// an empty directory, or a previous --save-hf output (only the files save_hf writes), which is
// replaced whole. Any other directory is refused rather than mixed with.
void check_hf_output(const std::string& flag, const std::string& dir);

// "5GB", "500MB", "2GiB", "1000000" (bytes): transformers' max_shard_size spelling (KB, MB, GB
// are powers of 10, KiB, MiB, GiB of 2). A usage error naming `flag` for anything else.
uint64_t parse_byte_size(const std::string& flag, const std::string& text);

// This process's peak resident set (VmHWM) in bytes, 0 when unknown.
uint64_t peak_rss_bytes();

}  // namespace trn::io
