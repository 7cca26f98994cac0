#include "runtime/model/stage.h"

#include <algorithm>

#include "collectives/core/error.h"
#include "runtime/model/family.h"

namespace trn::model {

template <typename T>
Stage<T>::Stage(const ParamLayout& layout, int batch, int seq_len, int slots, tp::Region* tp, int chunk)
    : lay_(layout), chunk_(layout.chunks().at(chunk)), B_(batch), T_(seq_len), slots_(std::max(slots, 1)) {
  body_ = family(layout.config().arch).stage<T>().make(layout, batch, seq_len, slots_, tp ? *tp : tp::single(), chunk);
}

template <typename T>
Stage<T>::~Stage() = default;

template <typename T>
size_t Stage<T>::activation_bytes(const ParamLayout& layout, int batch, int seq_len, int slots, int chunk) {
  return family(layout.config().arch).stage<T>().activation_bytes(layout, batch, seq_len, slots, chunk);
}

template <typename T>
WeightView<T> Stage<T>::whole_weights(const T* params) const {
  WeightView<T> w = WeightView<T>::whole(params, lay_.total());
  if (runs_bf16<T>(lay_)) {
    if (!pw_) throw internal_error("a bf16 stage ran without its bf16 weights (Stage::use_bf16_weights)");
    w.add_bf16(0, lay_.total(), pw_);
  }
  return w;
}

template <typename T>
void Stage<T>::check_weights(const WeightView<T>& w) const {
  // A sourced view's pieces are checked by their source (it builds each piece's bf16 form).
  if (runs_bf16<T>(lay_) && !w.source() && !w.has_bf16())
    throw internal_error("a bf16 stage ran without the bf16 form of its weights");
}

template class Stage<float>;
template class Stage<double>;

}  // namespace trn::model
