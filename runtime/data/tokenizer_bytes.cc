#include "runtime/data/tokenizer_bytes.h"

#include <vector>

namespace trn::data::bytes {

namespace {

struct Map {
  std::array<char32_t, 256> to_char{};
  std::vector<int16_t> to_byte;  // indexed by character, up to U+0143
  Map() {
    auto printable = [](int b) {
      return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    };
    char32_t next = 0x100;
    for (int b = 0; b < 256; ++b) to_char[b] = printable(b) ? char32_t(b) : next++;
    to_byte.assign(next, -1);
    for (int b = 0; b < 256; ++b) to_byte[to_char[b]] = int16_t(b);
  }
};

const Map& map() {
  static const Map m;
  return m;
}

// The range of the byte after a lead byte c, and the sequence's length; 0 for a byte that
// cannot start a character. Overlong forms, surrogates and code points past U+10FFFF have none.
int sequence(unsigned c, unsigned* lo, unsigned* hi) {
  *lo = 0x80, *hi = 0xBF;
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return 2;
  if (c == 0xE0) return *lo = 0xA0, 3;
  if (c == 0xED) return *hi = 0x9F, 3;
  if (c >= 0xE1 && c <= 0xEF) return 3;
  if (c == 0xF0) return *lo = 0x90, 4;
  if (c == 0xF4) return *hi = 0x8F, 4;
  if (c >= 0xF1 && c <= 0xF3) return 4;
  return 0;
}

// How many bytes from s[i] belong to a valid sequence (its whole length when complete, else
// the maximal valid prefix, at least 1 for an invalid lead byte), and whether it is complete.
size_t scan(std::string_view s, size_t i, bool* complete) {
  unsigned lo, hi;
  const int len = sequence(uint8_t(s[i]), &lo, &hi);
  if (len == 0) return *complete = false, 1;
  size_t k = 1;
  for (; k < size_t(len) && i + k < s.size(); ++k) {
    const unsigned b = uint8_t(s[i + k]);
    if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) break;
  }
  *complete = k == size_t(len);
  return k;
}

}  // namespace

char32_t byte_char(uint8_t b) { return map().to_char[b]; }

int char_byte(char32_t c) { return c < map().to_byte.size() ? map().to_byte[c] : -1; }

void append_utf8(char32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(char(c));
  } else if (c < 0x800) {
    out->push_back(char(0xC0 | (c >> 6)));
    out->push_back(char(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out->push_back(char(0xE0 | (c >> 12)));
    out->push_back(char(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(char(0x80 | (c & 0x3F)));
  } else {
    out->push_back(char(0xF0 | (c >> 18)));
    out->push_back(char(0x80 | ((c >> 12) & 0x3F)));
    out->push_back(char(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(char(0x80 | (c & 0x3F)));
  }
}

bool unmap(std::string_view s, std::string* out) {
  out->clear();
  for (size_t i = 0; i < s.size();) {
    bool complete;
    const size_t n = scan(s, i, &complete);
    if (!complete) return false;
    const auto* u = reinterpret_cast<const unsigned char*>(s.data() + i);
    char32_t c = n == 1   ? u[0]
                 : n == 2 ? ((u[0] & 0x1F) << 6 | (u[1] & 0x3F))
                          : 0x110000;  // the map ends below U+0800
    const int b = char_byte(c);
    if (b < 0) return false;
    out->push_back(char(b));
    i += n;
  }
  return true;
}

size_t incomplete_tail(std::string_view s) {
  // A character is at most 4 bytes: only the last 3 can start an unfinished one.
  for (size_t back = 1; back <= 3 && back <= s.size(); ++back) {
    const size_t i = s.size() - back;
    const unsigned c = uint8_t(s[i]);
    if (c >= 0x80 && c < 0xC0) continue;  // a continuation byte: its lead is further back
    unsigned lo, hi;
    if (sequence(c, &lo, &hi) < 2) return 0;  // ASCII, or a byte no character starts with
    bool complete;
    const size_t n = scan(s, i, &complete);
    return !complete && i + n == s.size() ? back : 0;
  }
  return 0;
}

void append_lossy(std::string_view s, std::string* out) {
  for (size_t i = 0; i < s.size();) {
    bool complete;
    const size_t n = scan(s, i, &complete);
    if (complete)
      out->append(s.data() + i, n);
    else
      out->append("\xEF\xBF\xBD");  // U+FFFD
    i += n;
  }
}

}  // namespace trn::data::bytes
