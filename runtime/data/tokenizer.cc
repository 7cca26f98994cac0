// The tokenizer over SentencePiece's C++ API (sentencepiece_processor.h, sentencepiece_trainer.h).
#include "runtime/data/tokenizer.h"

#include <fcntl.h>
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include "collectives/core/error.h"

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
  std::ifstream f(path, std::ios::binary);
  if (!f) throw usage_error("cannot read {}", path);
  std::ostringstream ss;
  ss << f.rdbuf();
  std::string text = ss.str();
  const size_t bad = utf8_error_offset(text);
  if (bad != std::string_view::npos)
    throw usage_error("{} is not UTF-8 text (invalid byte at offset {})", path, bad);
  return text;
}

// SentencePiece's status messages can span lines and start with the failed check's source line
// ("./src/trainer_interface.cc(660) [a == b] Vocabulary size too high"); the user gets one line,
// the sentence after the check.
std::string one_line(std::string m) {
  const size_t check = m.find("] ");
  if (m.find(".cc(") != std::string::npos && check != std::string::npos) m = m.substr(check + 2);
  for (char& c : m)
    if (c == '\n' || c == '\r') c = ' ';
  while (!m.empty() && m.back() == ' ') m.pop_back();
  return m;
}

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

void write_atomically(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw usage_error("cannot write {}", tmp);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w <= 0) {
      ::close(fd);
      ::unlink(tmp.c_str());
      throw usage_error("cannot write {} (disk full?)", tmp);
    }
    done += static_cast<size_t>(w);
  }
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  if (!synced || std::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    throw usage_error("cannot write {}", path);
  }
}

}  // namespace

struct Tokenizer::Impl {
  sentencepiece::SentencePieceProcessor sp;
  std::string path;  // the model file, for errors
};

Tokenizer::Tokenizer() : p_(std::make_unique<Impl>()) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::string& path) {
  if (::access(path.c_str(), R_OK) != 0)
    throw usage_error("tokenizer {} does not exist or is not readable", path);
  Tokenizer t;
  sentencepiece::util::Status st;
  try {
    st = t.p_->sp.Load(path);
  } catch (const std::exception& e) {  // SentencePiece's own parsers throw on some damaged models
    throw usage_error("{} is not a SentencePiece model: {}", path, one_line(e.what()));
  }
  if (!st.ok()) throw usage_error("{} is not a SentencePiece model: {}", path, one_line(st.message()));
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
      {"minloglevel", "2"},  // SentencePiece logs nothing but errors, which come back as a status
  };
  sentencepiece::SetRandomGeneratorSeed(o.seed);
  Lines it(std::move(lines));
  std::string model;
  const auto st = sentencepiece::SentencePieceTrainer::Train(kw, &it, &model);
  if (!st.ok())
    throw usage_error("cannot train a {}-token {} tokenizer: {}", o.vocab, o.model_type,
                      one_line(st.message()));
  Tokenizer check;
  if (!check.p_->sp.LoadFromSerializedProto(model).ok())
    throw internal_error("SentencePiece wrote a model it cannot load");
  if (check.vocab() != o.vocab)
    throw usage_error("the corpus supports a vocabulary of at most {} for {}, not --vocab {}", check.vocab(),
                      o.model_type, o.vocab);
  write_atomically(out, model);
}

int Tokenizer::vocab() const { return p_->sp.GetPieceSize(); }

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int> ids;
  const auto st = p_->sp.Encode(text, &ids);
  // A model SentencePiece loads can still lack what encoding needs (pieces that cover the
  // normalized text): a fault of the model file, not of trn.
  if (!st.ok())
    throw usage_error("tokenizer {} cannot encode this text: {}; the model is damaged or incomplete",
                      p_->path.empty() ? "(trained in this process)" : p_->path, one_line(st.message()));
  return {ids.begin(), ids.end()};
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  const std::vector<int> v(ids.begin(), ids.end());
  const auto st = p_->sp.Decode(v, &out);
  if (!st.ok()) throw usage_error("cannot decode these tokens: {}", one_line(st.message()));
  return out;
}

int32_t Tokenizer::eos() const { return p_->sp.eos_id(); }

}  // namespace trn::data
