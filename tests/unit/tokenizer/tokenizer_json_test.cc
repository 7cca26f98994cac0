// The tokenizer.json tokenizer (runtime/data/tokenizer_json.h) on a small hand-made file: rank
// order of merges, ignore_merges, added tokens first (leftmost, longest, lstrip/rstrip), NFC,
// the Split behaviours, post-processors, decoding and streaming, and one-line refusals.
#include "runtime/data/tokenizer_json.h"

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "collectives/core/error.h"
#include "runtime/data/tokenizer.h"
#include "runtime/data/tokenizer_bytes.h"
#include "tests/support/process.h"

using namespace trn;
using json = nlohmann::json;
using Ids = std::vector<int32_t>;

namespace {

// GPT-2's spelling of some bytes.
std::string spell(std::string_view raw) {
  std::string s;
  for (char c : raw) data::bytes::append_utf8(data::bytes::byte_char(uint8_t(c)), &s);
  return s;
}

// Every byte is its own id (0..255); the merges below make ids from 256 on, in rank order.
json tiny() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[spell(std::string(1, char(b)))] = b;
  json merges = json::array();
  int next = 256;
  for (auto [l, r] : std::vector<std::pair<std::string, std::string>>{
           {"a", "a"}, {"b", "c"}, {"a", "b"}, {" ", "t"}, {"h", "e"}, {" t", "he"}, {"aa", "a"}}) {
    vocab[spell(l + r)] = next++;
    merges.push_back(spell(l) + " " + spell(r));
  }
  vocab["xyz"] = next++;  // 263: no merges make it
  const char* pattern =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  auto added = [](int id, const char* content, bool special, json extra = json::object()) {
    json t = {{"id", id},        {"content", content},  {"single_word", false}, {"lstrip", false},
              {"rstrip", false}, {"normalized", false}, {"special", special}};
    t.update(extra);
    return t;
  };
  return {
      {"version", "1.0"},
      {"added_tokens",
       {added(300, "<s>", true), added(301, "<|end|>", true), added(302, "<|e", false),
        added(303, "[L]", true, {{"lstrip", true}}), added(304, "[R]", true, {{"rstrip", true}}),
        added(305, "\xC3\xA9", false, {{"normalized", true}})}},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"}, {"pattern", {{"Regex", pattern}}}, {"behavior", "Isolated"}, {"invert", false}},
          {{"type", "ByteLevel"},
           {"add_prefix_space", false},
           {"trim_offsets", true},
           {"use_regex", false}}}}}},
      {"post_processor",
       {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}}},
      {"decoder",
       {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", merges}}},
  };
}

std::unique_ptr<data::JsonTokenizer> parse(const json& j) {
  return data::JsonTokenizer::parse(j.dump(), "tiny.json");
}

Ids ids(std::string_view text, const json& j = tiny(), bool special = false) {
  return parse(j)->encode(text, special);
}

// The one-line usage error parsing j gives.
std::string refusal(const std::string& text) {
  try {
    data::JsonTokenizer::parse(text, "bad.json");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kUsage);
    const std::string m = e.what();
    CHECK(m.find('\n') == std::string::npos);
    CHECK(m.rfind("tokenizer bad.json: ", 0) == 0);
    return m;
  }
  FAIL("parsing did not fail");
  return "";
}

}  // namespace

TEST_CASE("merges apply by rank, the leftmost of equal ranks first") {
  CHECK(ids("aaa") == Ids{262});        // a a -> aa, then aa a -> aaa
  CHECK(ids("aaaa") == Ids{256, 256});  // the first a a merges, then the second: never aaa + a
  CHECK(ids("abc") == Ids{'a', 257});   // b c ranks before a b
  CHECK(ids("ab") == Ids{258});
  CHECK(ids("the the") == Ids{'t', 260, 261});  // the split regex keeps the space before a word
  CHECK(ids("") == Ids{});
}

TEST_CASE("ignore_merges takes a pre-token that is a piece whole") {
  CHECK(ids("xyz") == Ids{'x', 'y', 'z'});
  json j = tiny();
  j["model"]["ignore_merges"] = true;
  CHECK(ids("xyz", j) == Ids{263});
  CHECK(ids("aaaa", j) == Ids{256, 256});
}

TEST_CASE("merges may be written as pairs, and a merge of pieces not in the vocabulary is refused") {
  json j = tiny();
  for (auto& m : j["model"]["merges"]) {
    const std::string s = m.get<std::string>();
    m = json::array({s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1)});
  }
  CHECK(ids("aaa", j) == Ids{262});
  j["model"]["merges"].push_back(json::array({"q", "q"}));
  CHECK_THAT(refusal(j.dump()), Catch::Contains("merge 7 ('q q'): what it makes is not in the vocabulary"));
}

TEST_CASE("added tokens are matched first, leftmost and longest, and never merged") {
  CHECK(ids("a<s>b") == Ids{'a', 300, 'b'});
  CHECK(ids("<|end|>") == Ids{301});    // longer than <|e
  CHECK(ids("<|en") == Ids{302, 'n'});  // only <|e matches
  CHECK(ids("aa<s><s>aa") == Ids{256, 300, 300, 256});
  CHECK(ids("a  [L]  b") == Ids{'a', 303, ' ', ' ', 'b'});  // lstrip takes the spaces before it
  CHECK(ids("a  [R]  b") == Ids{'a', ' ', ' ', 304, 'b'});  // rstrip the ones after it
}

TEST_CASE("the post-processor's tokens come only with add_special") {
  json j = tiny();
  CHECK(ids("ab", j, true) == Ids{258});  // ByteLevel adds nothing
  j["post_processor"] = {{"type", "Sequence"},
                         {"processors",
                          {{{"type", "ByteLevel"}},
                           {{"type", "TemplateProcessing"},
                            {"single",
                             {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                              {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                              {{"SpecialToken", {{"id", "<|end|>"}, {"type_id", 0}}}}}},
                            {"special_tokens",
                             {{"<s>", {{"id", "<s>"}, {"ids", {300}}, {"tokens", {"<s>"}}}},
                              {"<|end|>", {{"id", "<|end|>"}, {"ids", {301}}, {"tokens", {"<|end|>"}}}}}}}}}};
  CHECK(ids("ab", j, true) == Ids{300, 258, 301});
  CHECK(ids("", j, true) == Ids{300, 301});
  CHECK(ids("ab", j, false) == Ids{258});
  CHECK(parse(j)->bos() == 300);
  j["post_processor"] = {{"type", "RobertaProcessing"}, {"cls", {"<s>", 300}}, {"sep", {"<|end|>", 301}}};
  CHECK(ids("ab", j, true) == Ids{300, 258, 301});
}

TEST_CASE(
    "the NFC normalizer composes before the pre-tokenizer, and normalized added tokens match after it") {
  const std::string decomposed = "e\xCC\x81";  // e + combining acute
  json j = tiny();
  CHECK(ids(decomposed, j) == Ids{'e', 0xCC, 0x81});
  CHECK(ids("\xC3\xA9", j) == Ids{305});  // the normalized added token é
  j["normalizer"] = {{"type", "NFC"}};
  CHECK(ids(decomposed, j) == Ids{305});
  CHECK(ids("a" + decomposed + "<s>", j) == Ids{'a', 305, 300});
  j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}}}};
  CHECK(ids(decomposed, j) == Ids{305});
}

TEST_CASE("Split behaviours and GPT-2's own regex") {
  json j = tiny();
  auto split = [&](const char* behavior, const char* pattern) {
    j["pre_tokenizer"] = {{"type", "Sequence"},
                          {"pretokenizers",
                           {{{"type", "Split"}, {"pattern", {{"String", pattern}}}, {"behavior", behavior}},
                            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
    return ids("aa-aa-a", j);
  };
  CHECK(split("Isolated", "-") == Ids{256, '-', 256, '-', 'a'});
  CHECK(split("Removed", "-") == Ids{256, 256, 'a'});
  CHECK(split("MergedWithPrevious", "-") == Ids{256, '-', 256, '-', 'a'});
  CHECK(split("MergedWithNext", "a-") == Ids{'a', 'a', '-', 'a', 'a', '-', 'a'});  // "a", "a-a", "a-a"
  CHECK(split("Isolated", "a-a") == Ids{'a', 'a', '-', 'a', 'a', '-', 'a'});
  // ByteLevel with use_regex splits by GPT-2's pattern and, with add_prefix_space, adds a space.
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  CHECK(ids("the", j) == Ids{261});
  CHECK(ids("aaaa", j) == Ids{' ', 256, 256});
}

TEST_CASE("decoding gives the text back, an added token as its text, a bad id as an error") {
  const auto t = parse(tiny());
  for (std::string s : {"the the", "héllo <s> wörld 😀\n\t", "a[L]b", "  aaaa  "}) {
    CHECK(t->decode(t->encode(s, true)) == s);
  }
  CHECK(t->decode(t->encode("a  [L]", true)) == "a[L]");  // lstrip's spaces are the token's
  CHECK(t->decode({300, 'a'}) == "<s>a");
  CHECK(t->decode({0xC3}) == "\xEF\xBF\xBD");  // half a character: U+FFFD
  CHECK_THROWS_WITH(t->decode({280}),
                    Catch::Contains("token id 280 is not in the vocabulary of tokenizer tiny.json"));
  CHECK_THROWS_WITH(t->decode({-1}), Catch::Contains("token id -1"));
  CHECK_THROWS_WITH(t->encode("a\xFF", false), Catch::Contains("not UTF-8 (invalid byte at offset 1)"));
  CHECK(t->vocab() == 306);
}

TEST_CASE(
    "load tells a tokenizer.json by its name or its first byte; the stream holds back unfinished "
    "characters") {
  test::TempDir tmp;
  const std::string path = tmp.path() + "/tok.bin";
  std::ofstream(path) << "\n  " << tiny().dump();
  const data::Tokenizer t = data::Tokenizer::load(path);
  CHECK(t.kind() == data::Tokenizer::Kind::kTokenizerJson);
  CHECK(t.eos() == -1);
  const std::string text = "ñ😀a";  // bytes C3 B1, F0 9F 98 80, 61: one token each
  const Ids all = t.encode(text);
  REQUIRE(all.size() == 7);
  auto s = t.stream();
  std::vector<std::string> parts;
  for (int32_t id : all) parts.push_back(s.push(id));
  CHECK(parts == std::vector<std::string>{"", "ñ", "", "", "", "😀", "a"});
  CHECK(s.finish().empty());
  auto cut = t.stream({'x', 0xF0, 0x9F});  // a context ending inside a character
  CHECK(cut.push(0x98).empty());
  CHECK(cut.push(0x80) == "😀");
  CHECK(cut.push(0xE2) == "");
  CHECK(cut.finish() == "\xEF\xBF\xBD");  // never completed

  // eos from the tokenizer_config.json beside it, by its content.
  const std::string dir = tmp.path() + "/model";
  std::filesystem::create_directory(dir);
  std::ofstream(dir + "/tokenizer.json") << tiny().dump();
  std::ofstream(dir + "/tokenizer_config.json") << R"({"eos_token": {"content": "<|end|>"}})";
  CHECK(data::Tokenizer::load(dir + "/tokenizer.json").eos() == 301);
  std::ofstream(dir + "/tokenizer_config.json") << R"({"eos_token": "<nope>"})";
  CHECK_THROWS_WITH(data::Tokenizer::load(dir + "/tokenizer.json"),
                    Catch::Contains("its eos_token '<nope>' is not a token"));
}

TEST_CASE("what trn does not implement is refused by name, in one line") {
  CHECK_THAT(refusal("{\"model\": "), Catch::Contains("not JSON"));
  CHECK_THAT(refusal("[]"), Catch::Contains("no \"model\" object"));
  for (const char* type : {"WordPiece", "Unigram", "WordLevel"}) {
    json j = tiny();
    j["model"]["type"] = type;
    CHECK_THAT(refusal(j.dump()),
               Catch::Contains(std::string("its model is ") + type + "; trn reads byte-level BPE"));
  }
  json j = tiny();
  j["model"].erase("type");
  j["model"].erase("merges");
  j["model"]["vocab"] = json::array({json::array({"a", 0.0})});
  CHECK_THAT(refusal(j.dump()), Catch::Contains("its model is Unigram"));
  j = tiny();
  j["model"]["byte_fallback"] = true;
  CHECK_THAT(refusal(j.dump()), Catch::Contains("byte_fallback"));
  j = tiny();
  j["normalizer"] = {{"type", "Lowercase"}};
  CHECK_THAT(refusal(j.dump()), Catch::Contains("its normalizer is Lowercase"));
  j = tiny();
  j["pre_tokenizer"] = {{"type", "Metaspace"}};
  CHECK_THAT(refusal(j.dump()), Catch::Contains("its pre-tokenizer is Metaspace"));
  j = tiny();
  j["pre_tokenizer"] = j["pre_tokenizer"]["pretokenizers"][0];
  CHECK_THAT(refusal(j.dump()), Catch::Contains("no ByteLevel step"));
  j = tiny();
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  CHECK_THAT(refusal(j.dump()), Catch::Contains("does not compile"));
  j = tiny();
  j["decoder"] = {{"type", "WordPiece"}};
  CHECK_THAT(refusal(j.dump()), Catch::Contains("its decoder is WordPiece"));
  j = tiny();
  j["post_processor"] = {{"type", "Frobnicate"}};
  CHECK_THAT(refusal(j.dump()), Catch::Contains("its post-processor is Frobnicate"));
  j = tiny();
  j["model"]["vocab"] = "nope";
  CHECK_THAT(refusal(j.dump()), Catch::Contains("no \"vocab\" object"));
  j = tiny();
  j["added_tokens"][0]["single_word"] = true;
  CHECK_THAT(refusal(j.dump()), Catch::Contains("single_word"));
}
