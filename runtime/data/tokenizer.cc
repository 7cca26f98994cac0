// The tokenizer over SentencePiece's C++ API (sentencepiece_processor.h, sentencepiece_trainer.h).
#include "runtime/data/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#include <unistd.h>

#include <algorithm>
#include <string_view>
#include <unordered_map>

#include "collectives/core/error.h"
#include "runtime/data/tokenizer_bytes.h"
#include "runtime/data/tokenizer_json.h"
#include "runtime/io/atomic_file.h"
#include "runtime/io/input_file.h"

namespace trn::data {

size_t utf8_error_offset(std::string_view t) {
  const auto* s = reinterpret_cast<const unsigned char*>(t.data());
  const size_t n = t.size();
  size_t i = 0;
  while (i < n) {
    const unsigned c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    unsigned lo = 0x80, hi = 0xBF;  // the range of the second byte
    if (c >= 0xC2 && c <= 0xDF)
      len = 2;
    else if (c == 0xE0)
      len = 3, lo = 0xA0;  // no overlong 3-byte forms
    else if (c == 0xED)
      len = 3, hi = 0x9F;  // no surrogates
    else if (c >= 0xE1 && c <= 0xEF)
      len = 3;
    else if (c == 0xF0)
      len = 4, lo = 0x90;  // no overlong 4-byte forms
    else if (c == 0xF4)
      len = 4, hi = 0x8F;  // nothing above U+10FFFF
    else if (c >= 0xF1 && c <= 0xF3)
      len = 4;
    else
      return i;
    if (i + len > n) return i;
    if (s[i + 1] < lo || s[i + 1] > hi) return i;
    for (size_t k = 2; k < len; ++k)
      if (s[i + k] < 0x80 || s[i + k] > 0xBF) return i;
    i += len;
  }
  return std::string_view::npos;
}

namespace {

std::string read_text(const std::string& path) {
  std::string text = io::read_input_file("input file", path);
  const size_t bad = utf8_error_offset(text);
  if (bad != std::string_view::npos)
    throw usage_error("{} is not UTF-8 text (invalid byte at offset {})", path, bad);
  return text;
}

// SentencePiece's status messages can span lines and start with the failed check's source line
// ("./src/trainer_interface.cc(660) [a == b] Vocabulary size too high"); the user gets one line,
// the sentence after the check. Many checks carry no sentence ("./src/...cc(1101)
// [model_proto->ParseFromArray(...)] "): then the reason is `fallback` when the caller knows
// what that check means, else the check itself, so a reason is never empty.
std::string reason(std::string m, std::string_view fallback = {}) {
  std::string check;
  const size_t open = m.find(") ["), close = m.find("] ");
  if (m.find(".cc(") != std::string::npos && open != std::string::npos && close != std::string::npos &&
      open < close) {
    check = m.substr(open + 3, close - open - 3);
    m = m.substr(close + 2);
  }
  for (char& c : m)
    if (c == '\n' || c == '\r') c = ' ';
  while (!m.empty() && m.back() == ' ') m.pop_back();
  if (!m.empty()) return m;
  if (!fallback.empty()) return std::string(fallback);
  return check.empty() ? "SentencePiece gave no reason" : "SentencePiece's check " + check + " failed";
}

constexpr std::string_view kNotAModel =
    "its bytes do not parse as a SentencePiece model (the .model file trn-data tokenizer train or spm_train "
    "writes)";

// SentencePiece's trainer skips sentences longer than this many bytes (its max_sentence_length,
// set here to its default so the limit is ours to name).
constexpr size_t kMaxSentenceBytes = 4192;

// The non-empty lines of the corpus, in file order: SentencePiece's training sentences.
class Lines : public sentencepiece::SentenceIterator {
 public:
  explicit Lines(std::vector<std::string> lines) : lines_(std::move(lines)) {}
  bool done() const override { return i_ >= lines_.size(); }
  void Next() override { ++i_; }
  const std::string& value() const override { return lines_[i_]; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  std::vector<std::string> lines_;
  size_t i_ = 0;
};

}  // namespace

struct Tokenizer::Impl {
  sentencepiece::SentencePieceProcessor sp;
  std::unique_ptr<JsonTokenizer> json;  // set for a tokenizer.json, which then does all the work
  std::string path;                     // the model file, for errors
};

namespace {

// Whether a tokenizer file is a tokenizer.json: by its name, or (for any name) by its first
// non-blank byte, which no SentencePiece model (a protobuf, starting with a field tag) has.
bool is_tokenizer_json(const std::string& path, std::string_view bytes) {
  if (path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0) return true;
  const size_t first = bytes.find_first_not_of(" \t\r\n");
  return first != std::string_view::npos && bytes[first] == '{';
}

}  // namespace

Tokenizer::Tokenizer() : p_(std::make_unique<Impl>()) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::string& path) {
  // Read here, not by SentencePiece's Load(path): io::InputFile refuses a FIFO instead of
  // blocking on it.
  const std::string bytes = io::read_input_file("tokenizer", path);
  Tokenizer t;
  t.p_->path = path;
  if (is_tokenizer_json(path, bytes)) {
    t.p_->json = JsonTokenizer::load(path, bytes);
    return t;
  }
  sentencepiece::util::Status st;
  try {
    st = t.p_->sp.LoadFromSerializedProto(bytes);
  } catch (const std::exception& e) {  // SentencePiece's own parsers throw on some damaged models
    throw usage_error("{} is not a SentencePiece model: {}", path, reason(e.what(), kNotAModel));
  }
  if (!st.ok()) throw usage_error("{} is not a SentencePiece model: {}", path, reason(st.message(), kNotAModel));
  t.p_->path = path;
  return t;
}

void Tokenizer::train(const TrainOptions& o, const std::string& out) {
  if (o.model_type != "bpe" && o.model_type != "unigram")
    throw usage_error("--model-type takes bpe or unigram, got '{}'", o.model_type);
  if (o.files.empty()) throw usage_error("the corpus is empty: no input file");
  std::vector<std::string> lines;
  size_t bytes = 0;
  for (const auto& f : o.files) {
    const std::string text = read_text(f);
    size_t start = 0;
    while (start < text.size()) {
      size_t end = text.find('\n', start);
      if (end == std::string::npos) end = text.size();
      if (end > start) lines.emplace_back(text, start, end - start), bytes += end - start;
      start = end + 1;
    }
  }
  if (lines.empty()) throw usage_error("the corpus is empty: {} file(s) and no text", o.files.size());
  if (std::all_of(lines.begin(), lines.end(), [](const std::string& l) { return l.size() > kMaxSentenceBytes; }))
    throw usage_error("cannot train a {}-token {} tokenizer: every line of the corpus is longer than {} bytes, the "
                      "longest sentence SentencePiece trains on (it skips longer ones); break the text into shorter "
                      "lines",
                      o.vocab, o.model_type, kMaxSentenceBytes);
  // One thread, the whole corpus (no sampling, no shuffle) and a fixed seed: the same files make
  // the same model.
  const std::unordered_map<std::string, std::string> kw = {
      {"model_type", o.model_type},
      {"vocab_size", std::to_string(o.vocab)},
      {"num_threads", "1"},
      {"input_sentence_size", "0"},
      {"shuffle_input_sentence", "false"},
      // Every character of the corpus gets a piece: a small English corpus would otherwise lose
      // its rare letters to <unk>.
      {"character_coverage", "1.0"},
      {"max_sentence_length", std::to_string(kMaxSentenceBytes)},
      {"minloglevel", "2"},  // SentencePiece logs nothing but errors, which come back as a status
  };
  sentencepiece::SetRandomGeneratorSeed(o.seed);
  Lines it(std::move(lines));
  std::string model;
  const auto st = sentencepiece::SentencePieceTrainer::Train(kw, &it, &model);
  if (!st.ok())
    throw usage_error("cannot train a {}-token {} tokenizer: {}", o.vocab, o.model_type,
                      reason(st.message()));
  Tokenizer check;
  if (!check.p_->sp.LoadFromSerializedProto(model).ok())
    throw internal_error("SentencePiece wrote a model it cannot load");
  if (check.vocab() != o.vocab)
    throw usage_error("the corpus supports a vocabulary of at most {} for {}, not --vocab {}", check.vocab(),
                      o.model_type, o.vocab);
  io::write_file_atomic(out, model);
}

Tokenizer::Kind Tokenizer::kind() const { return p_->json ? Kind::kTokenizerJson : Kind::kSentencePiece; }

int Tokenizer::vocab() const { return p_->json ? p_->json->vocab() : p_->sp.GetPieceSize(); }

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special) const {
  if (p_->json) return p_->json->encode(text, add_special);
  std::vector<int> ids;
  const auto st = p_->sp.Encode(text, &ids);
  // A model SentencePiece loads can still lack what encoding needs (pieces that cover the
  // normalized text): a fault of the model file, not of trn.
  if (!st.ok())
    throw usage_error("tokenizer {} cannot encode this text: {}; the model is damaged or incomplete",
                      p_->path.empty() ? "(trained in this process)" : p_->path, reason(st.message()));
  return {ids.begin(), ids.end()};
}

int32_t Tokenizer::token_id(std::string_view text) const {
  if (p_->json) return p_->json->token_id(text);
  const int id = p_->sp.PieceToId(text);
  return id == p_->sp.unk_id() && text != p_->sp.IdToPiece(id) ? -1 : int32_t(id);
}

std::vector<int32_t> Tokenizer::add_special(std::vector<int32_t> ids) const {
  return p_->json ? p_->json->add_special(std::move(ids)) : ids;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const { return decode(*p_, ids); }

std::string Tokenizer::decode(const Impl& p, const std::vector<int32_t>& ids) {
  if (p.json) return p.json->decode(ids);
  std::string out;
  const std::vector<int> v(ids.begin(), ids.end());
  const auto st = p.sp.Decode(v, &out);
  if (!st.ok()) throw usage_error("cannot decode these tokens: {}", reason(st.message()));
  return out;
}

int32_t Tokenizer::eos() const { return p_->json ? p_->json->eos() : p_->sp.eos_id(); }

Tokenizer::Stream Tokenizer::stream(const std::vector<int32_t>& context) const {
  Stream s(p_.get());
  if (p_->json) {
    std::string b;
    for (int32_t id : context) p_->json->append_bytes(id, &b);
    s.pending_ = b.substr(b.size() - bytes::incomplete_tail(b));
  } else {
    s.ids_ = context;
    s.shown_ = decode(context);
  }
  return s;
}

// tokenizer.json: the bytes of the tokens so far, less those of an unfinished character.
// SentencePiece: a piece can change how its neighbours decode (the space before a word), so the
// whole is decoded again and what it adds to the text shown so far is returned; a trailing U+FFFD
// (SentencePiece's decoding of a byte piece that starts a character) waits for the next token.
std::string Tokenizer::Stream::push(int32_t id) {
  std::string out;
  if (const JsonTokenizer* j = model_->json.get()) {
    j->append_bytes(id, &pending_);
    const size_t keep = bytes::incomplete_tail(pending_);
    bytes::append_lossy(std::string_view(pending_).substr(0, pending_.size() - keep), &out);
    pending_.erase(0, pending_.size() - keep);
    return out;
  }
  ids_.push_back(id);
  std::string all = Tokenizer::decode(*model_, ids_);
  constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
  if (all.size() >= kReplacement.size() && all.compare(all.size() - 3, 3, kReplacement) == 0) all.resize(all.size() - 3);
  if (all.size() <= shown_.size() || all.compare(0, shown_.size(), shown_) != 0) return out;
  out = all.substr(shown_.size());
  shown_ = std::move(all);
  return out;
}

std::string Tokenizer::Stream::finish() {
  std::string out;
  if (model_->json) {
    bytes::append_lossy(pending_, &out);
    pending_.clear();
    return out;
  }
  std::string all = Tokenizer::decode(*model_, ids_);
  if (all.size() > shown_.size() && all.compare(0, shown_.size(), shown_) == 0) out = all.substr(shown_.size());
  shown_ = std::move(all);
  return out;
}

}  // namespace trn::data
