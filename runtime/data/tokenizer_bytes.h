// Bytes and characters for the byte-level BPE tokenizer (tokenizer_json.h): GPT-2's byte-to-character
// map, in which tokenizer.json spells its vocabulary and merges, and the UTF-8 a decoder turns
// token bytes back into.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace trn::data::bytes {

// GPT-2's bijection between the 256 byte values and 256 printable characters: the bytes that are
// printable Latin-1 ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for themselves, every other byte, in
// increasing order, for U+0100, U+0101, ... A vocabulary entry "Ġthe" is the bytes " the".
char32_t byte_char(uint8_t b);
// The byte a character stands for, or -1 for a character outside the map.
int char_byte(char32_t c);

// Appends c's UTF-8 form to out.
void append_utf8(char32_t c, std::string* out);

// The bytes a byte-level spelling stands for ("Ġthe" -> " the"); false (out unspecified) when s
// is not UTF-8 or holds a character outside the map.
bool unmap(std::string_view s, std::string* out);

// How many bytes at the end of s start a UTF-8 character that more bytes could still complete
// (0 to 3): a streaming decoder holds them back until the next token.
size_t incomplete_tail(std::string_view s);

// s as UTF-8 text, each ill-formed part replaced by U+FFFD: a maximal prefix of a valid sequence
// counts as one part (the Unicode standard's recommended practice, as Rust's
// String::from_utf8_lossy and so Hugging Face's decoders do it).
void append_lossy(std::string_view s, std::string* out);

}  // namespace trn::data::bytes
