// The byte-level pieces of the tokenizer.json tokenizer (runtime/data/tokenizer_bytes.h): GPT-2's
// byte map, the held-back tail of a stream, and lossy UTF-8.
#include "runtime/data/tokenizer_bytes.h"

#include <catch2/catch.hpp>
#include <set>

using namespace trn::data;

TEST_CASE("the byte map is a bijection onto printable characters, with GPT-2's spelling of a space") {
  std::set<char32_t> seen;
  for (int b = 0; b < 256; ++b) {
    const char32_t c = bytes::byte_char(uint8_t(b));
    CHECK(bytes::char_byte(c) == b);
    seen.insert(c);
  }
  CHECK(seen.size() == 256);
  CHECK(bytes::byte_char(' ') == U'Ġ');
  CHECK(bytes::byte_char('\n') == U'Ċ');
  CHECK(bytes::byte_char('A') == U'A');
  CHECK(bytes::byte_char(0xE9) == U'é');  // printable Latin-1 stands for itself
  CHECK(bytes::char_byte(U'€') == -1);
  std::string out;
  REQUIRE(bytes::unmap("Ġthe", &out));
  CHECK(out == " the");
  REQUIRE(bytes::unmap("Ã©", &out));  // the two bytes of é
  CHECK(out == "\xC3\xA9");
  CHECK_FALSE(bytes::unmap("€", &out));
  CHECK_FALSE(bytes::unmap("\xC3", &out));
}

TEST_CASE("a stream holds back only the start of a character more bytes can complete") {
  CHECK(bytes::incomplete_tail("") == 0);
  CHECK(bytes::incomplete_tail("abc") == 0);
  CHECK(bytes::incomplete_tail("a\xC3") == 1);
  CHECK(bytes::incomplete_tail("a\xC3\xA9") == 0);
  CHECK(bytes::incomplete_tail("\xE2\x82") == 2);      // € needs one more
  CHECK(bytes::incomplete_tail("\xF0\x9F\x98") == 3);  // 😀 needs one more
  CHECK(bytes::incomplete_tail("\xF0\x9F\x98\x80") == 0);
  CHECK(bytes::incomplete_tail("a\xFF") == 0);     // no character starts with 0xFF
  CHECK(bytes::incomplete_tail("a\xC0") == 0);     // an overlong lead byte
  CHECK(bytes::incomplete_tail("\xE0\x80") == 0);  // an overlong form: already invalid
  CHECK(bytes::incomplete_tail("\xED\xA0") == 0);  // a surrogate
  CHECK(bytes::incomplete_tail("a\x80") == 0);     // a stray continuation byte
}

TEST_CASE("lossy UTF-8 replaces each maximal ill-formed part with one U+FFFD") {
  auto lossy = [](std::string_view s) {
    std::string out;
    bytes::append_lossy(s, &out);
    return out;
  };
  CHECK(lossy("héllo 😀") == "héllo 😀");
  CHECK(lossy("a\xFF!") == "a\xEF\xBF\xBD!");
  CHECK(lossy("\xE2\x82!") == "\xEF\xBF\xBD!");  // an unfinished € is one part
  CHECK(lossy("\xE2\x82") == "\xEF\xBF\xBD");
  CHECK(lossy("\x80\x80") == "\xEF\xBF\xBD\xEF\xBF\xBD");  // each stray byte is its own
  CHECK(lossy("\xF0\x9F\x98") == "\xEF\xBF\xBD");
}
