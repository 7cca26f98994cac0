#include "runtime/data/tokenizer_json.h"

#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/utf8.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <climits>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <unordered_map>

#include "collectives/core/error.h"
#include "runtime/data/tokenizer.h"
#include "runtime/data/tokenizer_bpe.h"
#include "runtime/data/tokenizer_bytes.h"
#include "runtime/data/tokenizer_regex.h"
#include "runtime/io/input_file.h"

namespace trn::data {

namespace {

using json = nlohmann::json;

// GPT-2's pre-tokenizer pattern: what a ByteLevel pre-tokenizer with use_regex splits by.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct AddedToken {
  std::string content;
  int32_t id;
  bool lstrip, rstrip, normalized, special;
};

bool is_space_at(std::string_view s, size_t i, size_t* next) {
  UChar32 c;
  int32_t at = int32_t(i);
  U8_NEXT(reinterpret_cast<const uint8_t*>(s.data()), at, int32_t(s.size()), c);
  *next = size_t(at);
  return c >= 0 && u_isUWhiteSpace(c);
}

bool is_space_before(std::string_view s, size_t i, size_t* prev) {
  UChar32 c;
  int32_t at = int32_t(i);
  U8_PREV(reinterpret_cast<const uint8_t*>(s.data()), 0, at, c);
  *prev = size_t(at);
  return c >= 0 && u_isUWhiteSpace(c);
}

// Finds added tokens in a text: the leftmost match, and the longest of those starting there (as
// Hugging Face's added vocabulary does). lstrip and rstrip widen a match over the white space
// before and after it, which then belongs to the token.
class AddedMatcher {
 public:
  void add(const AddedToken* t) {
    auto& v = by_first_[uint8_t(t->content[0])];
    v.push_back(t);
    std::stable_sort(v.begin(), v.end(),
                     [](auto* a, auto* b) { return a->content.size() > b->content.size(); });
    any_ = true;
  }
  bool empty() const { return !any_; }
  struct Match {
    size_t begin, end;
    const AddedToken* token;
  };
  // The first match in text at or after `from`; lstrip reaches back no further than `floor`.
  std::optional<Match> find(std::string_view text, size_t from, size_t floor) const {
    for (size_t i = from; i < text.size(); ++i) {
      for (const AddedToken* t : by_first_[uint8_t(text[i])]) {
        if (text.compare(i, t->content.size(), t->content) != 0) continue;
        Match m{i, i + t->content.size(), t};
        size_t next;
        if (t->lstrip)
          while (m.begin > floor && is_space_before(text, m.begin, &next)) m.begin = next;
        if (t->rstrip)
          while (m.end < text.size() && is_space_at(text, m.end, &next)) m.end = next;
        return m;
      }
    }
    return std::nullopt;
  }

 private:
  std::array<std::vector<const AddedToken*>, 256> by_first_;
  bool any_ = false;
};

enum class Behavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext };

struct PreStep {
  bool byte_level = false;
  bool add_prefix_space = false;  // ByteLevel
  std::unique_ptr<SplitRegex> regex;
  Behavior behavior = Behavior::kIsolated;
};

// Pieces of one text, cut where a step splits it.
using Pieces = std::vector<std::string>;

void split(const SplitRegex& re, Behavior behavior, const std::string& piece, Pieces* out) {
  thread_local std::vector<std::pair<size_t, size_t>> m;
  m.clear();
  re.matches(piece, &m);
  std::string_view s(piece);
  size_t at = 0;      // the end of what was emitted
  std::string carry;  // MergedWithNext: the match waiting for the text after it
  auto emit = [&](std::string_view part) {
    if (!part.empty()) out->emplace_back(part);
  };
  for (auto [b, e] : m) {
    switch (behavior) {
      case Behavior::kIsolated:
        emit(s.substr(at, b - at));
        emit(s.substr(b, e - b));
        break;
      case Behavior::kRemoved:
        emit(s.substr(at, b - at));
        break;
      case Behavior::kMergedWithPrevious:
        emit(s.substr(at, e - at));
        break;
      case Behavior::kMergedWithNext:
        emit(carry.append(s.substr(at, b - at)));
        carry.assign(s.substr(b, e - b));
        break;
    }
    at = e;
  }
  if (behavior == Behavior::kMergedWithNext)
    emit(carry.append(s.substr(at)));
  else
    emit(s.substr(at));
}

// A literal split string as an Oniguruma pattern: ASCII punctuation escaped.
std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (uint8_t(c) < 0x80 && !std::isalnum(uint8_t(c))) out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

std::string type_of(const json& j) {
  if (!j.is_object()) return "";
  const auto it = j.find("type");
  return it != j.end() && it->is_string() ? it->get<std::string>() : "";
}

// The model's vocabulary and merges, as Reader takes them out of the file.
struct ModelLists {
  bool has_vocab = false, has_merges = false;
  std::vector<std::pair<std::string, int64_t>> vocab;       // piece (GPT-2's spelling), id
  std::vector<std::pair<std::string, std::string>> merges;  // in rank order
  std::string error;                                        // why the file was not read, when it was not
};

// Reads a tokenizer.json by SAX: the model's vocabulary and merges (hundreds of thousands of
// entries) go straight into ModelLists, everything else into a json tree. A tree of the whole
// file takes nlohmann five times as long to build as the file takes to read.
class Reader : public nlohmann::json_sax<json> {
 public:
  json root;
  ModelLists lists;

  bool null() override { return value(json()); }
  bool boolean(bool v) override { return value(v); }
  bool number_integer(number_integer_t v) override { return number(v); }
  bool number_unsigned(number_unsigned_t v) override {
    return number(v > uint64_t(INT64_MAX) ? INT64_MAX : int64_t(v));
  }
  bool number_float(number_float_t v, const string_t&) override { return value(v); }
  bool binary(binary_t&) override { return value(json()); }
  bool string(string_t& v) override {
    if (frames_.empty() || frames_.back().capture == kNone) return value(v);
    Frame& f = frames_.back();
    if (f.capture == kVocab) return entry_error();
    if (f.capture == kPair) {
      f.pair.push_back(std::move(v));
      return true;
    }
    const size_t sp = v.find(' ');  // kMerges: "A B"
    if (sp == std::string::npos || v.find(' ', sp + 1) != std::string::npos)
      return error(
          fmt::format("merge {} ('{}') is not two pieces separated by one space", lists.merges.size(), v));
    lists.merges.emplace_back(v.substr(0, sp), v.substr(sp + 1));
    return true;
  }
  bool start_object(std::size_t) override {
    if (capturing()) return frames_.back().capture == kVocab ? entry_error() : merge_error();
    if (at("vocab")) {
      lists.has_vocab = true;
      frames_.push_back({nullptr, true, {}, kVocab, {}});
      return true;
    }
    frames_.push_back({place(json::object()), true, {}, kNone, {}});
    return true;
  }
  bool key(string_t& k) override {
    frames_.back().key = std::move(k);
    return true;
  }
  bool end_object() override {
    frames_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    if (capturing()) {
      if (frames_.back().capture != kMerges)
        return frames_.back().capture == kVocab ? entry_error() : merge_error();
      frames_.push_back({nullptr, false, {}, kPair, {}});
      return true;
    }
    if (at("merges")) {
      lists.has_merges = true;
      frames_.push_back({nullptr, false, {}, kMerges, {}});
      return true;
    }
    frames_.push_back({place(json::array()), false, {}, kNone, {}});
    return true;
  }
  bool end_array() override {
    Frame& f = frames_.back();
    if (f.capture == kPair) {
      if (f.pair.size() != 2) return merge_error();
      lists.merges.emplace_back(std::move(f.pair[0]), std::move(f.pair[1]));
    }
    frames_.pop_back();
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    return error(fmt::format("not JSON: {}", e.what()));
  }

 private:
  enum Capture { kNone, kVocab, kMerges, kPair };
  struct Frame {
    json* node;  // the container being filled (kNone)
    bool object;
    std::string key;  // an object's latest key
    Capture capture;
    std::vector<std::string> pair;  // kPair: a merge written as ["A", "B"]
  };
  bool capturing() const { return !frames_.empty() && frames_.back().capture != kNone; }
  // Whether the next value is the model's `field`: root -> "model" -> field.
  bool at(const char* field) const {
    return frames_.size() == 2 && frames_[0].object && frames_[0].key == "model" && frames_[1].object &&
           frames_[1].key == field;
  }
  bool error(std::string why) {
    if (lists.error.empty()) lists.error = std::move(why);
    return false;
  }
  bool entry_error() {
    return error(fmt::format("the vocabulary entry '{}' has no integer id", frames_.back().key));
  }
  bool merge_error() {
    return error(fmt::format("merge {} is neither \"A B\" nor [\"A\", \"B\"]", lists.merges.size()));
  }
  bool number(int64_t v) {
    if (!capturing()) return value(v);
    if (frames_.back().capture != kVocab) return merge_error();
    lists.vocab.emplace_back(frames_.back().key, v);
    return true;
  }
  bool value(json v) {
    if (capturing()) return frames_.back().capture == kVocab ? entry_error() : merge_error();
    place(std::move(v));
    return true;
  }
  // Puts v where the parse is: the root, an object's latest key, or an array's end.
  json* place(json v) {
    if (frames_.empty()) {
      root = std::move(v);
      return &root;
    }
    Frame& f = frames_.back();
    if (f.object) {
      json& slot = (*f.node)[f.key];
      slot = std::move(v);
      return &slot;
    }
    f.node->push_back(std::move(v));
    return &f.node->back();
  }
  std::vector<Frame> frames_;
};
}  // namespace

struct JsonTokenizer::Impl {
  std::string name;
  BpeModel bpe;
  std::vector<std::unique_ptr<AddedToken>> added;
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> added_ids;
  AddedMatcher raw, normalized;  // added tokens matched before / after the normalizer
  bool nfc = false;
  std::vector<PreStep> pre;
  std::vector<int32_t> prefix, suffix;  // the post-processor's tokens around the text
  std::vector<std::string> bytes;       // by id: what each token decodes to
  std::vector<uint8_t> known;           // by id: whether it is a token
  int32_t eos = -1;

  template <typename... Args>
  [[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) const {
    throw usage_error("tokenizer {}: {}", name, fmt::format(f, std::forward<Args>(args)...));
  }
  void parse(const json& j, const ModelLists& lists);
  void parse_model(const json& m, const ModelLists& lists);
  void parse_normalizer(const json& n);
  void parse_pre_tokenizer(const json& p);
  void parse_post_processor(const json& p);
  void parse_decoder(const json& d);
  void set_bytes(int32_t id, std::string b);
  int32_t special_id(const std::string& content, const char* where) const;

  void encode_section(std::string_view text, std::vector<int32_t>* out) const;
  void encode_normalized(std::string_view text, std::vector<int32_t>* out) const;
  void pre_tokenize_and_merge(std::string_view text, std::vector<int32_t>* out) const;
};

void JsonTokenizer::Impl::set_bytes(int32_t id, std::string b) {
  if (id < 0) fail("token id {} is negative", id);
  // The tables are indexed by id: a vocabulary's ids are dense, and the largest real ones are a
  // few hundred thousand, so an id past 2^24 is a damaged file, not a reason to allocate gigabytes.
  if (id >= (1 << 24)) fail("token id {} is above the largest trn reads, {}", id, (1 << 24) - 1);
  if (size_t(id) >= bytes.size()) bytes.resize(id + 1), known.resize(id + 1);
  bytes[id] = std::move(b);
  known[id] = 1;
}

int32_t JsonTokenizer::Impl::special_id(const std::string& content, const char* where) const {
  if (const auto it = added_ids.find(content); it != added_ids.end()) return it->second;
  std::string b;
  if (bytes::unmap(content, &b))
    if (const int32_t id = bpe.find(b); id >= 0) return id;
  fail("the {} names the token '{}', which is not in the vocabulary", where, content);
}

void JsonTokenizer::Impl::parse(const json& j, const ModelLists& lists) {
  if (!j.is_object() || !j.contains("model"))
    fail(
        "not a tokenizer.json: no \"model\" object (trn reads Hugging Face's tokenizer.json and "
        "SentencePiece .model files)");
  parse_model(j["model"], lists);
  if (const auto it = j.find("added_tokens"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) fail("\"added_tokens\" is not a list");
    for (const json& t : *it) {
      if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() || !t.contains("content") ||
          !t["content"].is_string() || t["content"].get<std::string>().empty())
        fail("an entry of \"added_tokens\" has no integer \"id\" and non-empty \"content\": {}", t.dump());
      auto a = std::make_unique<AddedToken>();
      a->content = t["content"].get<std::string>();
      a->id = t["id"].get<int32_t>();
      a->special = t.value("special", false);
      a->lstrip = t.value("lstrip", false);
      a->rstrip = t.value("rstrip", false);
      a->normalized = t.value("normalized", !a->special);
      if (t.value("single_word", false))
        fail("the added token '{}' is single_word, which trn does not implement", a->content);
      if (utf8_error_offset(a->content) != std::string_view::npos)
        fail("the added token with id {} is not UTF-8", a->id);
      added_ids[a->content] = a->id;
      set_bytes(a->id, a->content);  // an added token decodes to its text, not through the byte map
      added.push_back(std::move(a));
    }
    for (const auto& a : added) (a->normalized ? normalized : raw).add(a.get());
  }
  parse_normalizer(j.value("normalizer", json()));
  parse_pre_tokenizer(j.value("pre_tokenizer", json()));
  parse_post_processor(j.value("post_processor", json()));
  parse_decoder(j.value("decoder", json()));
}

void JsonTokenizer::Impl::parse_model(const json& m, const ModelLists& lists) {
  if (!m.is_object()) fail("\"model\" is not an object");
  std::string type = type_of(m);
  if (type.empty()) {  // older files leave the type to be told by the fields
    if (lists.has_merges || m.contains("merges"))
      type = "BPE";
    else if (m.contains("vocab") && m["vocab"].is_array())
      type = "Unigram";
    else if (m.contains("max_input_chars_per_word"))
      type = "WordPiece";
    else
      type = "WordLevel";
  }
  if (type == "WordPiece" || type == "Unigram" || type == "WordLevel")
    fail(
        "its model is {}; trn reads byte-level BPE tokenizer.json files (Llama-3, Qwen2, GPT-2) and "
        "SentencePiece "
        ".model files",
        type);
  if (type != "BPE") fail("its model type '{}' is not one trn reads (byte-level BPE only)", type);
  if (m.value("byte_fallback", false))
    fail(
        "its BPE model has byte_fallback (SentencePiece-style BPE, as Llama-2's); trn reads byte-level BPE "
        "only: "
        "give the model's SentencePiece tokenizer.model instead");
  if (const auto d = m.find("dropout"); d != m.end() && !d->is_null() && d->get<double>() > 0)
    fail("its BPE model has dropout {}, which makes encoding random; trn encodes with no dropout",
         d->get<double>());
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const auto it = m.find(k); it != m.end() && it->is_string() && !it->get<std::string>().empty())
      fail("its BPE model has a {} ('{}'), which byte-level BPE does not use and trn does not implement", k,
           it->get<std::string>());
  if (!lists.has_vocab) fail("its BPE model has no \"vocab\" object");
  if (!lists.has_merges) fail("its BPE model has no \"merges\" list");
  bpe.reserve(lists.vocab.size(), lists.merges.size());
  std::string b;
  for (const auto& [piece, id] : lists.vocab) {
    if (id < 0 || id > INT32_MAX)
      fail("the vocabulary entry '{}' has the id {}, outside 0..2^31-1", piece, id);
    if (size_t(id) < known.size() && known[id]) fail("the id {} is given to two pieces", id);
    if (bytes::unmap(piece, &b)) {
      bpe.add_piece(b, int32_t(id));
      set_bytes(int32_t(id), b);
    } else {
      set_bytes(int32_t(id),
                piece);  // not in the byte spelling: no text encodes to it; it decodes as written
    }
  }
  bpe.set_ignore_merges(m.value("ignore_merges", false));
  if (const auto u = m.find("unk_token"); u != m.end() && u->is_string()) {
    const auto it = std::find_if(lists.vocab.begin(), lists.vocab.end(),
                                 [&](const auto& e) { return e.first == u->get<std::string>(); });
    if (it == lists.vocab.end()) fail("its unk_token '{}' is not in the vocabulary", u->get<std::string>());
    bpe.set_unk(int32_t(it->second));
  }
  std::string left, right;
  for (size_t i = 0; i < lists.merges.size(); ++i) {
    const auto& [l, r] = lists.merges[i];
    if (!bytes::unmap(l, &left) || !bytes::unmap(r, &right))
      fail("merge {} ('{} {}') is not in GPT-2's byte spelling", i, l, r);
    if (const std::string why = bpe.add_merge(left, right); !why.empty())
      fail("merge {} ('{} {}'): {}", i, l, r, why);
  }
}

void JsonTokenizer::Impl::parse_normalizer(const json& n) {
  if (n.is_null()) return;
  const std::string type = type_of(n);
  if (type == "NFC") {
    nfc = true;
  } else if (type == "Sequence" && n.contains("normalizers") && n["normalizers"].is_array()) {
    for (const json& s : n["normalizers"]) parse_normalizer(s);
  } else {
    fail("its normalizer is {}; trn implements none, NFC, or a Sequence of NFC",
         type.empty() ? n.dump() : type);
  }
}

void JsonTokenizer::Impl::parse_pre_tokenizer(const json& p) {
  if (p.is_null()) return;
  const std::string type = type_of(p);
  if (type == "Sequence" && p.contains("pretokenizers") && p["pretokenizers"].is_array()) {
    for (const json& s : p["pretokenizers"]) parse_pre_tokenizer(s);
    return;
  }
  PreStep step;
  if (type == "ByteLevel") {
    step.byte_level = true;
    step.add_prefix_space = p.value("add_prefix_space", true);
    if (p.value("use_regex", true))
      step.regex = std::make_unique<SplitRegex>(kGpt2Pattern, "tokenizer " + name);
  } else if (type == "Split") {
    const json& pat = p.value("pattern", json());
    if (pat.is_object() && pat.contains("Regex") && pat["Regex"].is_string())
      step.regex = std::make_unique<SplitRegex>(pat["Regex"].get<std::string>(), "tokenizer " + name);
    else if (pat.is_object() && pat.contains("String") && pat["String"].is_string())
      step.regex =
          std::make_unique<SplitRegex>(escape(pat["String"].get<std::string>()), "tokenizer " + name);
    else
      fail("its Split pre-tokenizer has no \"pattern\" with a Regex or String");
    if (p.value("invert", false)) fail("its Split pre-tokenizer is inverted, which trn does not implement");
    const std::string b = p.value("behavior", "");
    if (b == "Isolated")
      step.behavior = Behavior::kIsolated;
    else if (b == "Removed")
      step.behavior = Behavior::kRemoved;
    else if (b == "MergedWithPrevious")
      step.behavior = Behavior::kMergedWithPrevious;
    else if (b == "MergedWithNext")
      step.behavior = Behavior::kMergedWithNext;
    else
      fail(
          "its Split pre-tokenizer's behavior is '{}'; trn implements Isolated, Removed, MergedWithPrevious "
          "and "
          "MergedWithNext",
          b);
  } else {
    fail("its pre-tokenizer is {}; trn implements Split, ByteLevel and a Sequence of them",
         type.empty() ? p.dump() : type);
  }
  pre.push_back(std::move(step));
}

void JsonTokenizer::Impl::parse_post_processor(const json& p) {
  if (p.is_null()) return;
  const std::string type = type_of(p);
  if (type == "ByteLevel") return;  // it trims offsets, which trn does not report
  if (type == "Sequence" && p.contains("processors") && p["processors"].is_array()) {
    for (const json& s : p["processors"]) parse_post_processor(s);
    return;
  }
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    auto token = [&](const char* k) {
      const json& t = p.value(k, json());
      if (!t.is_array() || t.size() != 2 || !t[1].is_number_integer())
        fail("its {} has no [\"token\", id] for \"{}\"", type, k);
      return t[1].get<int32_t>();
    };
    prefix.push_back(token("cls"));
    suffix.insert(suffix.begin(), token("sep"));
    return;
  }
  if (type == "TemplateProcessing") {
    const json& single = p.value("single", json());
    const json& specials = p.value("special_tokens", json::object());
    if (!single.is_array()) fail("its TemplateProcessing has no \"single\" template");
    bool seen_text = false;
    for (const json& piece : single) {
      if (piece.contains("Sequence")) {
        if (seen_text) fail("its TemplateProcessing's single template holds the text twice");
        seen_text = true;
        continue;
      }
      if (!piece.contains("SpecialToken") || !piece["SpecialToken"].contains("id"))
        fail(
            "its TemplateProcessing's single template has an item that is neither a Sequence nor a "
            "SpecialToken: {}",
            piece.dump());
      const std::string tid = piece["SpecialToken"]["id"].get<std::string>();
      const json& spec = specials.value(tid, json());
      if (!spec.is_object() || !spec.contains("ids") || !spec["ids"].is_array())
        fail("its TemplateProcessing uses the special token '{}' but \"special_tokens\" gives no ids for it",
             tid);
      for (const json& id : spec["ids"]) (seen_text ? suffix : prefix).push_back(id.get<int32_t>());
    }
    if (!seen_text) fail("its TemplateProcessing's single template has no place for the text (a Sequence)");
    return;
  }
  fail(
      "its post-processor is {}; trn implements ByteLevel, TemplateProcessing, RobertaProcessing, "
      "BertProcessing "
      "and a Sequence of them",
      type.empty() ? p.dump() : type);
}

void JsonTokenizer::Impl::parse_decoder(const json& d) {
  const std::string type = type_of(d);
  if (type == "ByteLevel") return;
  if (type == "Sequence" && d.contains("decoders") && d["decoders"].is_array() && d["decoders"].size() == 1)
    return parse_decoder(d["decoders"][0]);
  fail("its decoder is {}; trn decodes byte-level BPE (a ByteLevel decoder) only", d.is_null()
                                                                                       ? std::string("none")
                                                                                   : type.empty() ? d.dump()
                                                                                                  : type);
}

JsonTokenizer::JsonTokenizer() : p_(std::make_unique<Impl>()) {}
JsonTokenizer::~JsonTokenizer() = default;

std::unique_ptr<JsonTokenizer> JsonTokenizer::parse(std::string_view text, const std::string& name) {
  std::unique_ptr<JsonTokenizer> t(new JsonTokenizer());
  t->p_->name = name;
  Reader reader;
  if (!json::sax_parse(text, &reader)) t->p_->fail("{}", reader.lists.error);
  try {
    t->p_->parse(reader.root, reader.lists);
  } catch (const json::exception& e) {  // a field of the wrong type, deep inside
    t->p_->fail("not a tokenizer.json trn can read: {}", e.what());
  }
  bool byte_level = false;
  for (const auto& s : t->p_->pre) byte_level |= s.byte_level;
  if (!byte_level)
    t->p_->fail(
        "its pre-tokenizer has no ByteLevel step, so it is not byte-level BPE (trn reads Llama-3, Qwen2 "
        "and GPT-2 style tokenizer.json files)");
  for (const auto* ids : {&t->p_->prefix, &t->p_->suffix})
    for (int32_t id : *ids)
      if (id < 0 || size_t(id) >= t->p_->known.size() || !t->p_->known[id])
        t->p_->fail("its post-processor adds the id {}, which is no token", id);
  return t;
}

std::unique_ptr<JsonTokenizer> JsonTokenizer::load(const std::string& path, std::string_view text) {
  auto t = parse(text, path);
  // HF keeps the end-of-text token in tokenizer_config.json, not in tokenizer.json.
  const std::filesystem::path config = std::filesystem::path(path).parent_path() / "tokenizer_config.json";
  std::error_code ec;
  if (std::filesystem::is_regular_file(config, ec)) {
    json c;
    try {
      c = json::parse(io::read_input_file("tokenizer config", config.string()));
    } catch (const json::exception& e) {
      throw usage_error("tokenizer config {}: not JSON: {}", config.string(), e.what());
    }
    const json& eos = c.is_object() ? c.value("eos_token", json()) : json();
    std::string content;
    if (eos.is_string()) content = eos.get<std::string>();
    if (eos.is_object() && eos.contains("content") && eos["content"].is_string())
      content = eos["content"].get<std::string>();
    if (!content.empty()) {
      const int32_t id = t->token_id(content);
      if (id < 0)
        throw usage_error("tokenizer config {}: its eos_token '{}' is not a token of {}", config.string(),
                          content, path);
      t->set_eos(id);
    }
  }
  return t;
}

int JsonTokenizer::vocab() const { return int(p_->known.size()); }
int32_t JsonTokenizer::eos() const { return p_->eos; }
int32_t JsonTokenizer::bos() const { return p_->prefix.empty() ? -1 : p_->prefix[0]; }
void JsonTokenizer::set_eos(int32_t id) { p_->eos = id; }

int32_t JsonTokenizer::token_id(std::string_view text) const {
  if (const auto it = p_->added_ids.find(text); it != p_->added_ids.end()) return it->second;
  std::string b;
  return bytes::unmap(text, &b) ? p_->bpe.find(b) : -1;
}

void JsonTokenizer::Impl::pre_tokenize_and_merge(std::string_view text, std::vector<int32_t>* out) const {
  if (text.empty()) return;
  Pieces pieces{std::string(text)}, next;
  for (const PreStep& step : pre) {
    if (step.add_prefix_space)
      for (auto& p : pieces)
        if (p[0] != ' ') p.insert(p.begin(), ' ');
    if (!step.regex) continue;
    next.clear();
    for (const auto& p : pieces) split(*step.regex, step.behavior, p, &next);
    pieces.swap(next);
  }
  for (const auto& p : pieces) bpe.encode(p, out);
}

void JsonTokenizer::Impl::encode_normalized(std::string_view text, std::vector<int32_t>* out) const {
  if (normalized.empty()) return pre_tokenize_and_merge(text, out);
  size_t at = 0;
  while (auto m = normalized.find(text, at, at)) {
    pre_tokenize_and_merge(text.substr(at, m->begin - at), out);
    out->push_back(m->token->id);
    at = m->end;
  }
  pre_tokenize_and_merge(text.substr(at), out);
}

void JsonTokenizer::Impl::encode_section(std::string_view text, std::vector<int32_t>* out) const {
  if (text.empty()) return;
  if (!nfc) return encode_normalized(text, out);
  UErrorCode ec = U_ZERO_ERROR;
  const icu::Normalizer2* n = icu::Normalizer2::getNFCInstance(ec);
  if (U_FAILURE(ec)) throw internal_error("ICU has no NFC normalizer: {}", u_errorName(ec));
  const icu::StringPiece sp(text.data(), int32_t(text.size()));
  if (n->isNormalizedUTF8(sp, ec) && U_SUCCESS(ec)) return encode_normalized(text, out);
  ec = U_ZERO_ERROR;
  std::string norm;
  icu::StringByteSink<std::string> sink(&norm);
  n->normalizeUTF8(0, sp, sink, nullptr, ec);
  if (U_FAILURE(ec)) throw internal_error("ICU's NFC failed: {}", u_errorName(ec));
  encode_normalized(norm, out);
}

std::vector<int32_t> JsonTokenizer::encode(std::string_view text, bool add_special) const {
  if (const size_t bad = utf8_error_offset(text); bad != std::string_view::npos)
    throw usage_error("tokenizer {}: the text is not UTF-8 (invalid byte at offset {})", p_->name, bad);
  std::vector<int32_t> out;
  if (add_special) out = p_->prefix;
  size_t at = 0;
  if (!p_->raw.empty()) {
    while (auto m = p_->raw.find(text, at, at)) {
      p_->encode_section(text.substr(at, m->begin - at), &out);
      out.push_back(m->token->id);
      at = m->end;
    }
  }
  p_->encode_section(text.substr(at), &out);
  if (add_special) out.insert(out.end(), p_->suffix.begin(), p_->suffix.end());
  return out;
}

std::vector<int32_t> JsonTokenizer::add_special(std::vector<int32_t> ids) const {
  ids.insert(ids.begin(), p_->prefix.begin(), p_->prefix.end());
  ids.insert(ids.end(), p_->suffix.begin(), p_->suffix.end());
  return ids;
}

void JsonTokenizer::append_bytes(int32_t id, std::string* out) const {
  if (id < 0 || size_t(id) >= p_->known.size() || !p_->known[id])
    throw usage_error("token id {} is not in the vocabulary of tokenizer {} ({} ids)", id, p_->name, vocab());
  out->append(p_->bytes[id]);
}

std::string JsonTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string raw, out;
  for (int32_t id : ids) append_bytes(id, &raw);
  bytes::append_lossy(raw, &out);
  return out;
}

}  // namespace trn::data
