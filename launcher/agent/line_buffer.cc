#include "launcher/agent/line_buffer.h"

#include <algorithm>

namespace trn::launch {

void LineBuffer::feed(std::string_view bytes, const Emit& emit) {
  while (!bytes.empty()) {
    size_t room = max_line_ - partial_.size();  // partial_ is always shorter than max_line_
    size_t nl = bytes.find('\n');
    if (nl != std::string_view::npos && nl <= room) {
      partial_.append(bytes.substr(0, nl + 1));
      bytes.remove_prefix(nl + 1);
      emit(partial_);
      partial_.clear();
      continue;
    }
    size_t take = std::min(room, bytes.size());
    partial_.append(bytes.substr(0, take));
    bytes.remove_prefix(take);
    if (partial_.size() == max_line_) {
      partial_.push_back('\n');
      emit(partial_);
      partial_.clear();
    }
  }
}

void LineBuffer::flush(const Emit& emit) {
  if (partial_.empty()) return;
  partial_.push_back('\n');
  emit(partial_);
  partial_.clear();
}

}  // namespace trn::launch
