// A pre-tokenizer's split pattern, run by Oniguruma (Debian's libonig): the engine Hugging Face's
// tokenizers library runs these patterns with, in its default syntax, on UTF-8 with Unicode
// classes (\p{L}, \p{N}, \s as White_Space), case-insensitive groups and lookahead.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace trn::data {

class SplitRegex {
 public:
  // A usage error "WHAT: the pattern ... does not compile: REASON" when Oniguruma refuses it.
  SplitRegex(const std::string& pattern, const std::string& what);
  ~SplitRegex();
  SplitRegex(const SplitRegex&) = delete;
  SplitRegex& operator=(const SplitRegex&) = delete;

  // The [begin, end) byte ranges of the successive non-overlapping matches in text, leftmost
  // first; an empty match is skipped by one character. text must be UTF-8. Safe to call from
  // several threads at once.
  void matches(std::string_view text, std::vector<std::pair<size_t, size_t>>* out) const;

 private:
  void* regex_;  // OnigRegex
};

}  // namespace trn::data
