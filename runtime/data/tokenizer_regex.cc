#include "runtime/data/tokenizer_regex.h"

#include <oniguruma.h>

#include <mutex>

#include "collectives/core/error.h"

namespace trn::data {

namespace {

void init_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    OnigEncoding encodings[] = {ONIG_ENCODING_UTF8};
    onig_initialize(encodings, 1);
  });
}

std::string onig_message(int code, OnigErrorInfo* info) {
  OnigUChar buf[ONIG_MAX_ERROR_MESSAGE_LEN];
  const int n = info ? onig_error_code_to_str(buf, code, info) : onig_error_code_to_str(buf, code);
  return std::string(reinterpret_cast<char*>(buf), n > 0 ? size_t(n) : 0);
}

// One match region per thread, reused across calls (Oniguruma's search itself keeps no state in
// the compiled pattern).
struct Region {
  OnigRegion* r = onig_region_new();
  ~Region() { onig_region_free(r, 1); }
};

}  // namespace

SplitRegex::SplitRegex(const std::string& pattern, const std::string& what) {
  init_once();
  OnigRegex re = nullptr;
  OnigErrorInfo info{};
  const auto* p = reinterpret_cast<const OnigUChar*>(pattern.data());
  const int rc =
      onig_new(&re, p, p + pattern.size(), ONIG_OPTION_NONE, ONIG_ENCODING_UTF8, ONIG_SYNTAX_DEFAULT, &info);
  if (rc != ONIG_NORMAL)
    throw usage_error("{}: the pattern '{}' does not compile: {}", what, pattern, onig_message(rc, &info));
  regex_ = re;
}

SplitRegex::~SplitRegex() { onig_free(static_cast<OnigRegex>(regex_)); }

void SplitRegex::matches(std::string_view text, std::vector<std::pair<size_t, size_t>>* out) const {
  thread_local Region region;
  const auto* s = reinterpret_cast<const OnigUChar*>(text.data());
  const auto* end = s + text.size();
  size_t at = 0;
  while (at < text.size()) {
    const int pos =
        onig_search(static_cast<OnigRegex>(regex_), s, end, s + at, end, region.r, ONIG_OPTION_NONE);
    if (pos == ONIG_MISMATCH) break;
    if (pos < 0) throw usage_error("the split pattern failed on a text: {}", onig_message(pos, nullptr));
    const size_t b = size_t(region.r->beg[0]), e = size_t(region.r->end[0]);
    if (e > b) {
      out->emplace_back(b, e);
      at = e;
    } else {  // an empty match: go on after the character it stands before
      at = b + 1;
      while (at < text.size() && (uint8_t(text[at]) & 0xC0) == 0x80) ++at;
    }
  }
}

}  // namespace trn::data
