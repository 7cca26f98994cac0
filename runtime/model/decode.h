// Incremental decoding of a whole model (one process, fp32): each family's Decoder runs tokens
// through its blocks one position after another, keeping every layer's k and v of the positions
// seen so far (the KV cache), so a new token costs one row of each matmul and one row of
// attention over the cache instead of recomputing the sequence. It reads the parameters through
// the same TensorSpecs and offsets the family's spec defines (gpt2_offsets, llama_offsets,
// ParamLayout::embedding / head / final_norm / extra). trn-generate samples with it.
#pragma once

#include <cmath>
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

std::unique_ptr<Decoder> make_gpt2_decoder(const ParamLayout& layout, const float* params);
std::unique_ptr<Decoder> make_llama_decoder(const ParamLayout& layout, const float* params);

namespace decode {

// Causal attention of n new query rows against a KV cache, grouped-query (GPT-2: K == H).
// q (n, q_stride): row i is position t0 + i, its H heads of hd values first. kc, vc (t0 + n,
// kv_stride): every cached position's K heads of k and v (the new rows already stored). Query
// head h reads KV head h / (H / K). out (n, H*hd). scores holds t0 + n floats. Scale 1/sqrt(hd).
inline void cached_attention(float* out, float* scores, const float* q, int q_stride, const float* kc,
                             const float* vc, int kv_stride, int t0, int n, int H, int K, int hd) {
  const float scale = 1.0f / std::sqrt(float(hd));
  const int group = H / K;
  for (int i = 0; i < n; ++i) {
    const int t = t0 + i;  // this row attends to positions [0, t]
    for (int h = 0; h < H; ++h) {
      const float* qh = q + size_t(i) * q_stride + size_t(h) * hd;
      const size_t kv_off = size_t(h / group) * hd;
      float maxv = -INFINITY;
      for (int j = 0; j <= t; ++j) {
        const float* kj = kc + size_t(j) * kv_stride + kv_off;
        float s = 0;
        for (int d = 0; d < hd; ++d) s += qh[d] * kj[d];
        s *= scale;
        scores[j] = s;
        maxv = s > maxv ? s : maxv;
      }
      float sum = 0;
      for (int j = 0; j <= t; ++j) {
        scores[j] = std::exp(scores[j] - maxv);
        sum += scores[j];
      }
      const float inv = 1.0f / sum;
      float* o = out + size_t(i) * H * hd + size_t(h) * hd;
      for (int d = 0; d < hd; ++d) o[d] = 0;
      for (int j = 0; j <= t; ++j) {
        const float p = scores[j] * inv;
        const float* vj = vc + size_t(j) * kv_stride + kv_off;
        for (int d = 0; d < hd; ++d) o[d] += p * vj[d];
      }
    }
  }
}

}  // namespace decode

}  // namespace trn::model
