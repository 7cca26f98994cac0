// Incremental decoding of a whole model (one process, fp32): each family's Decoder runs tokens
// through its blocks one position after another, keeping every layer's k and v of the positions
// seen so far (the KV cache), so a new token costs one row of each matmul and one row of
// attention over the cache instead of recomputing the sequence. Attention is the training
// kernel's blockwise loop (kernels.h attention_forward_rows): the new rows against the cache's key
// blocks with an online softmax, holding one block of scores per KV head whatever the prompt's
// length. It reads the parameters through the same TensorSpecs and offsets the family's spec
// defines (gpt2_offsets, llama_offsets, ParamLayout::embedding / head / final_norm / extra).
// trn-generate samples with it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "runtime/model/config.h"

namespace trn::model {

class Decoder {
 public:
  virtual ~Decoder() = default;
  // Runs tokens tok[0, n) at positions [position(), position() + n) (n >= 1; at most ctx in
  // all), caching their k and v, and writes the logits (config().vocab) of the last one.
  // Prefill passes the whole prompt at once; decoding passes one token.
  virtual void append(const int32_t* tok, int n, float* logits) = 0;
  // Positions held in the cache.
  virtual int position() const = 0;
  // Empties the cache: the next append starts at position 0.
  virtual void reset() = 0;
};

// A family's decoder over `params`, the flat buffer of `layout` (which must be whole(); both
// outlive the decoder). Family::make_decoder.
using DecoderFactory = std::unique_ptr<Decoder> (*)(const ParamLayout& layout, const float* params);

}  // namespace trn::model
