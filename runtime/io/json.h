// A small JSON reader, enough for safetensors headers: objects, arrays, strings, numbers, true,
// false, null. Errors throw std::runtime_error with the byte offset; callers add the file name.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace trn::io::json {

struct Value {
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  Kind kind = Kind::kNull;
  bool boolean = false;
  double number = 0.0;
  std::string text;  // a string's value, or a number's spelling
  std::vector<Value> items;
  std::vector<std::pair<std::string, Value>> members;

  const Value* get(std::string_view key) const;  // nullptr when absent or not an object
  bool is_integer() const;                         // a number spelled without . or exponent
};

Value parse(std::string_view text);

// A JSON string literal for s (quotes included).
std::string quote(std::string_view s);

}  // namespace trn::io::json
