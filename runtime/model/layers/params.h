// The TensorSpecs of the layers (layers/README.md): what a family's spec adds for each layer, in
// Hugging Face's names and shapes, with its tensor-parallel split and initialisation. The spec
// names the tensors and their order (the order backward finishes them); these say how each kind
// of layer is laid out.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "runtime/model/config.h"
#include "runtime/model/layers/linear.h"
#include "runtime/model/layers/norm.h"

namespace trn::model {

// How a linear layer is split over the tensor-parallel ranks: whole on each, by its output
// features (column-parallel) or by its input features (row-parallel).
enum class Split { kReplicated, kColumn, kRow };

// A linear layer's weight: global [in, out] (Orientation::kInOut) or [out, in] (kOutIn); this
// rank's `local` features of the split dimension from tp_rank x local, in each of `interleave`
// equal parts (GPT-2's c_attn: q, k and v each split by heads). A matmul weight, N(0, std).
inline size_t add_linear_weight(ParamLayout& lay, const std::string& name, Orientation o, int64_t in, int64_t out,
                                Split split, int64_t local = 0, double std = 0.02, int interleave = 1) {
  const bool in_first = o == Orientation::kInOut;
  std::vector<int64_t> shape = in_first ? std::vector<int64_t>{in, out} : std::vector<int64_t>{out, in};
  int dim = -1;
  if (split == Split::kColumn) dim = in_first ? 1 : 0;
  if (split == Split::kRow) dim = in_first ? 0 : 1;
  const int64_t first = dim < 0 ? 0 : lay.placement().tp_rank * local;
  TensorSpec& t = lay.add(name, std::move(shape), dim, first, dim < 0 ? 0 : local, interleave);
  t.init_std = std;
  t.matmul = true;
  return t.offset;
}

// A linear layer's bias [out], zeros: split with the output features under kColumn, whole
// otherwise (a row-parallel layer adds it once, after the sum).
inline size_t add_linear_bias(ParamLayout& lay, const std::string& name, int64_t out, Split split, int64_t local = 0,
                              int interleave = 1) {
  const bool split_out = split == Split::kColumn;
  TensorSpec& t = lay.add(name, {out}, split_out ? 0 : -1, split_out ? lay.placement().tp_rank * local : 0,
                          split_out ? local : 0, interleave);
  t.init = TensorSpec::Init::kZeros;
  return t.offset;
}

// A norm's weight (ones, `weight`) and, for LayerNorm, its bias (zeros, `bias`), replicated over
// the tensor-parallel ranks. Returns their offsets (the bias's 0 for RMSNorm).
inline std::pair<size_t, size_t> add_norm(ParamLayout& lay, NormKind kind, const std::string& weight,
                                          const std::string& bias, int64_t C) {
  TensorSpec& w = lay.add(weight, {C});
  w.init = TensorSpec::Init::kOnes;
  if (kind != NormKind::kLayerNorm) return {w.offset, 0};
  const size_t wo = w.offset;  // (add may move the spec vector)
  TensorSpec& b = lay.add(bias, {C});
  b.init = TensorSpec::Init::kZeros;
  return {wo, b.offset};
}

}  // namespace trn::model
