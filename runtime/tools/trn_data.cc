// trn-data: from a folder of text to token shards trn-train (and Megatron) read.
//
//   trn-data tokenizer train --input 'GLOB' --vocab N --model-type bpe|unigram --out tok.model
//   trn-data tokenize --tokenizer tok.model --input 'GLOB' --out DIR [--shard-tokens N]
//                     [--val-fraction F] [--threads N]
//   trn-data inspect DIR|PREFIX [--tokenizer tok.model]
//
// A document is one input file. Its tokens are the SentencePiece encodings of its non-empty lines
// (each line as the sentencepiece module's encode() gives it, the way the tokenizer was trained),
// back to back, then the model's end-of-sequence token when it has one. A document goes to val
// when the XXH64 hash of its bytes, as a fraction of 2^64, is below --val-fraction: the split
// depends on the text alone, not on file names or order. Documents are written in sorted path
// order, so the shards are the same bytes for any --threads.
#include <fmt/format.h>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "collectives/core/error.h"
#include "collectives/core/flags.h"
#include "collectives/core/main.h"
#include "runtime/data/indexed.h"
#include "runtime/data/tokenizer.h"

namespace {

using namespace trn;
namespace fs = std::filesystem;

struct Args {
  std::string input, out, tokenizer, model_type = "bpe";
  int vocab = 0;
  int threads = 1;
  int64_t shard_tokens = 100'000'000;
  double val_fraction = 0.05;
  uint64_t seed = 1;
  std::vector<std::string> positional;  // the command (and its operand)
};

flags::Table table(Args* a) {
  return {
      .program = "trn-data",
      .summary =
          "\nMakes token shards (Megatron's indexed dataset, .bin + .idx) from text files; a file is a "
          "document.\n"
          "  tokenizer train  train a SentencePiece model on the files' lines\n"
          "  tokenize         write DIR/train-NNNNN.{bin,idx} and DIR/val-NNNNN.{bin,idx}\n"
          "  inspect          shards, documents, tokens, dtype and a decoded sample\n",
      .flags =
          {
              {"--input", &a->input, "the text files: a quoted glob or a directory", "input", "GLOB"},
              {"--out", &a->out, "tokenizer train: the model file; tokenize: the output directory", "output",
               "PATH"},
              {"--tokenizer", &a->tokenizer, "the SentencePiece model (tokenize; inspect: decodes a sample)",
               "input", "FILE"},
              {"--vocab", &a->vocab, "the vocabulary size", "tokenizer train", "N", "", flags::Range::kMinMax,
               4, 1 << 30},
              {"--model-type", &a->model_type, "SentencePiece's algorithm", "tokenizer train", "", nullptr,
               flags::Range::kAny, 0, 0, "bpe|unigram"},
              {"--seed", &a->seed, "SentencePiece's random seed", "tokenizer train"},
              {"--shard-tokens", &a->shard_tokens, "start a new shard once one holds this many tokens",
               "tokenize", "N", nullptr, flags::Range::kPositive},
              {"--val-fraction", &a->val_fraction, "the share of documents held out for validation",
               "tokenize", "F", nullptr, flags::Range::kMinMax, 0, 1},
              {"--threads", &a->threads, "encoding threads (the output is the same for any)", "tokenize", "N",
               nullptr, flags::Range::kMinMax, 1, 256},
          },
      .positional = flags::Positional::kInterleaved,
      .rest = &a->positional,
      .usage =
          "tokenizer train --input 'GLOB' --vocab N --model-type bpe|unigram --out tok.model\n"
          "       trn-data tokenize --tokenizer tok.model --input 'GLOB' --out DIR [--shard-tokens N]\n"
          "                [--val-fraction F] [--threads N]\n"
          "       trn-data inspect DIR|PREFIX [--tokenizer tok.model]",
  };
}

// The regular files GLOB names (or, for a directory, the files in it), sorted: a usage error when
// there are none.
std::vector<std::string> expand(const std::string& pattern) {
  if (pattern.empty())
    throw usage_error("--input needs a file or a glob, for example --input 'corpus/*.txt'");
  // A directory stands for the files in it.
  const std::string glob_text = fs::is_directory(pattern) ? pattern + "/*" : pattern;
  glob_t g{};
  const int rc = ::glob(glob_text.c_str(), GLOB_NOSORT, nullptr, &g);
  std::vector<std::string> files;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i)
      if (fs::is_regular_file(g.gl_pathv[i])) files.emplace_back(g.gl_pathv[i]);
  ::globfree(&g);
  if (files.empty()) throw usage_error("the corpus is empty: --input '{}' matches no file", pattern);
  std::sort(files.begin(), files.end());
  return files;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw usage_error("cannot read {}", path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string mb(double bytes) { return fmt::format("{:.1f} MB", bytes / 1e6); }

// Progress on stderr, redrawn in place: only when stderr is a terminal.
class Progress {
 public:
  explicit Progress(size_t total) : total_(total), tty_(::isatty(STDERR_FILENO) == 1), t0_(now()) {}
  void update(size_t done) {
    if (!tty_) return;
    const double s = seconds();
    const double rate = s > 0 ? done / s : 0;
    const double eta = rate > 0 ? (total_ - done) / rate : 0;
    const double frac = total_ ? static_cast<double>(done) / total_ : 1;
    const int width = 30, fill = static_cast<int>(frac * width);
    fmt::print(stderr, "\r[{}{}] {:3.0f}%  {} / {}  {:.1f} MB/s  ETA {:.0f}s ", std::string(fill, '#'),
               std::string(width - fill, ' '), frac * 100, mb(done), mb(total_), rate / 1e6, eta);
    std::fflush(stderr);
  }
  void done() {
    if (tty_) fmt::print(stderr, "\n");
  }
  double seconds() const { return std::chrono::duration<double>(now() - t0_).count(); }

 private:
  static std::chrono::steady_clock::time_point now() { return std::chrono::steady_clock::now(); }
  size_t total_;
  bool tty_;
  std::chrono::steady_clock::time_point t0_;
};

// One split's shards: PREFIX-00000, PREFIX-00001, ..., a new one after --shard-tokens.
class Shards {
 public:
  Shards(std::string dir, std::string split, int64_t vocab, size_t shard_tokens)
      : dir_(std::move(dir)), split_(std::move(split)), vocab_(vocab), shard_tokens_(shard_tokens) {}
  void add(const std::vector<int32_t>& doc) {
    if (!w_)
      w_ = std::make_unique<data::IndexedWriter>(fmt::format("{}/{}-{:05d}", dir_, split_, count_), vocab_);
    w_->add_document(doc.data(), doc.size());
    ++docs_;
    tokens_ += doc.size();
    if (w_->tokens() >= shard_tokens_) close();
  }
  void close() {
    if (!w_) return;
    w_->finish();
    w_.reset();
    ++count_;
  }
  std::string summary() const {
    return fmt::format("{} {} documents, {} tokens in {} shard{}", split_, docs_, tokens_, count_,
                       count_ == 1 ? "" : "s");
  }

 private:
  std::string dir_, split_;
  int64_t vocab_;
  size_t shard_tokens_;
  std::unique_ptr<data::IndexedWriter> w_;
  int count_ = 0;
  size_t docs_ = 0, tokens_ = 0;
};

// A run of whole lines of one document, encoded by one thread.
struct Piece {
  size_t doc, begin, end;  // doc's text [begin, end)
  std::vector<int32_t> ids;
};

void encode_piece(const data::Tokenizer& tok, const std::string& text, Piece* p) {
  size_t start = p->begin;
  while (start < p->end) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos || end > p->end) end = p->end;
    if (end > start) {
      const auto ids = tok.encode(std::string_view(text).substr(start, end - start));
      p->ids.insert(p->ids.end(), ids.begin(), ids.end());
    }
    start = end + 1;
  }
}

int tokenize(const Args& a) {
  if (a.tokenizer.empty())
    throw usage_error("tokenize needs --tokenizer FILE (make one with trn-data tokenizer train)");
  if (a.out.empty()) throw usage_error("tokenize needs --out DIR");
  const data::Tokenizer tok = data::Tokenizer::load(a.tokenizer);
  const auto files = expand(a.input);
  size_t total = 0;
  for (const auto& f : files) total += fs::file_size(f);
  if (total == 0)
    throw usage_error("the corpus is empty: the {} file(s) --input '{}' matches hold no text", files.size(),
                      a.input);
  fs::create_directories(a.out);
  Shards train(a.out, "train", tok.vocab(), a.shard_tokens), val(a.out, "val", tok.vocab(), a.shard_tokens);
  Progress progress(total);
  // Files are read a batch at a time (about 64 MB), cut into pieces of whole lines (about 1 MB)
  // that the threads encode in any order; the documents are then written in file order.
  constexpr size_t kBatchBytes = 64 << 20, kPieceBytes = 1 << 20;
  size_t next_file = 0, done_bytes = 0;
  while (next_file < files.size()) {
    std::vector<std::string> texts;
    size_t batch = 0;
    while (next_file < files.size() && (texts.empty() || batch < kBatchBytes)) {
      texts.push_back(read_file(files[next_file]));
      const size_t bad = data::utf8_error_offset(texts.back());
      if (bad != std::string_view::npos)
        throw usage_error("{} is not UTF-8 text (invalid byte at offset {})", files[next_file], bad);
      batch += texts.back().size();
      ++next_file;
    }
    std::vector<Piece> pieces;
    for (size_t d = 0; d < texts.size(); ++d) {
      const std::string& t = texts[d];
      size_t b = 0;
      do {
        size_t e = std::min(t.size(), b + kPieceBytes);
        if (e < t.size()) {
          const size_t nl = t.find('\n', e);
          e = nl == std::string::npos ? t.size() : nl + 1;
        }
        pieces.push_back({d, b, e, {}});
        b = e;
      } while (b < t.size());
    }
    std::atomic<size_t> next{0};
    std::atomic<bool> failed{false};
    auto work = [&] {
      for (size_t i; !failed && (i = next.fetch_add(1)) < pieces.size();) {
        try {
          encode_piece(tok, texts[pieces[i].doc], &pieces[i]);
        } catch (...) {
          failed = true;
        }
      }
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < std::min<int>(a.threads, static_cast<int>(pieces.size())); ++t)
      pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
    if (failed) throw internal_error("SentencePiece failed to encode a line of the corpus");
    size_t p = 0;
    for (size_t d = 0; d < texts.size(); ++d) {
      std::vector<int32_t> doc;
      for (; p < pieces.size() && pieces[p].doc == d; ++p)
        doc.insert(doc.end(), pieces[p].ids.begin(), pieces[p].ids.end());
      if (tok.eos() >= 0) doc.push_back(tok.eos());
      done_bytes += texts[d].size();
      if (doc.empty()) continue;  // no text and no EOS: nothing to write (a sequence is never empty)
      const uint64_t h = XXH64(texts[d].data(), texts[d].size(), 0);
      const bool held_out = static_cast<double>(h >> 11) * 0x1p-53 < a.val_fraction;
      (held_out ? val : train).add(doc);
    }
    progress.update(done_bytes);
  }
  train.close();
  val.close();
  progress.done();
  const double s = progress.seconds();
  fmt::print("tokenized {} files, {} in {:.2f}s ({:.1f} MB/s): {}; {} -> {}\n", files.size(), mb(total), s,
             s > 0 ? total / s / 1e6 : 0.0, train.summary(), val.summary(), a.out);
  return 0;
}

const char* dtype_name(int code) {
  switch (code) {
    case 1:
      return "uint8";
    case 2:
      return "int8";
    case 3:
      return "int16";
    case 4:
      return "int32";
    case 5:
      return "int64";
    case 6:
      return "float64";
    case 7:
      return "float32";
    case 8:
      return "uint16";
    default:
      return "unknown";
  }
}

int inspect(const Args& a, std::string target) {
  while (target.size() > 1 && target.back() == '/') target.pop_back();
  std::vector<std::string> prefixes;
  if (fs::is_directory(target)) {
    for (const auto& e : fs::directory_iterator(target))
      if (e.path().extension() == ".idx")
        prefixes.push_back((e.path().parent_path() / e.path().stem()).string());
    if (prefixes.empty()) throw usage_error("{} holds no shard (no .idx file)", target);
    std::sort(prefixes.begin(), prefixes.end());
  } else {
    for (const char* ext : {".bin", ".idx"})
      if (target.size() > 4 && target.ends_with(ext)) target.resize(target.size() - 4);
    if (!fs::exists(target + ".idx"))
      throw usage_error("{} is neither a directory nor a shard ({}.idx does not exist)", target, target);
    prefixes.push_back(target);
  }
  std::optional<data::Tokenizer> tok;
  if (!a.tokenizer.empty()) tok = data::Tokenizer::load(a.tokenizer);
  size_t docs = 0, tokens = 0;
  std::vector<int32_t> sample;
  for (const auto& p : prefixes) {
    const auto ds = data::IndexedDataset::open(p);
    fmt::print("{}  {}  {} sequences  {} documents  {} tokens  max id {}\n", p, dtype_name(ds.dtype()),
               ds.sequences(), ds.documents(), ds.tokens(), ds.max_token());
    if (tok && ds.max_token() >= tok->vocab())
      throw usage_error("{} holds token {}, outside {}'s vocabulary of {}", p, ds.max_token(), a.tokenizer,
                        tok->vocab());
    docs += ds.documents();
    tokens += ds.tokens();
    if (sample.empty() && ds.sequences() > 0) {
      ds.read(0, &sample);
      if (sample.size() > 40) sample.resize(40);
    }
  }
  fmt::print("total: {} shard{}, {} documents, {} tokens\n", prefixes.size(), prefixes.size() == 1 ? "" : "s",
             docs, tokens);
  if (!sample.empty()) {
    fmt::print("sample ({} tokens of {}'s first document): {}\n", sample.size(), prefixes[0],
               fmt::join(sample, " "));
    if (tok) {
      std::string text = tok->decode(sample);
      for (char& c : text)
        if (c == '\n') c = ' ';
      fmt::print("decoded: {}\n", text);
    }
  }
  return 0;
}

int run(const std::vector<std::string>& args) {
  Args a;
  if (args.empty()) {
    std::fputs(flags::help(table(&a)).c_str(), stderr);
    return 2;
  }
  if (!flags::parse(table(&a), args)) return 0;
  const auto& pos = a.positional;
  if (pos.empty())
    throw usage_error("no command given: use tokenizer train, tokenize or inspect; run trn-data --help");
  const std::string& cmd = pos[0];
  if (cmd == "tokenizer") {
    if (pos.size() < 2 || pos[1] != "train")
      throw usage_error("tokenizer takes one command, train: trn-data tokenizer train ...");
    if (pos.size() > 2) throw usage_error("unexpected argument '{}'", pos[2]);
    if (a.out.empty())
      throw usage_error("tokenizer train needs --out FILE (the model to write, e.g. tok.model)");
    if (a.vocab == 0) throw usage_error("tokenizer train needs --vocab N (e.g. --vocab 4000)");
    data::TrainOptions o;
    o.files = expand(a.input);
    o.vocab = a.vocab;
    o.model_type = a.model_type;
    o.seed = static_cast<uint32_t>(a.seed);
    data::Tokenizer::train(o, a.out);
    const auto t = data::Tokenizer::load(a.out);
    fmt::print("wrote {} ({} {} tokens, from {} files)\n", a.out, t.vocab(), a.model_type, o.files.size());
    return 0;
  }
  if (pos.size() > 2 || (cmd == "tokenize" && pos.size() > 1))
    throw usage_error("unexpected argument '{}'", pos.back());
  if (cmd == "tokenize") return tokenize(a);
  if (cmd == "inspect") {
    if (pos.size() < 2)
      throw usage_error("inspect needs a directory or a shard prefix: trn-data inspect DIR|PREFIX");
    return inspect(a, pos[1]);
  }
  throw usage_error("unknown command '{}': use tokenizer train, tokenize or inspect", cmd);
}

}  // namespace

int main(int argc, char** argv) {
  return trn::run_main("trn-data", [&] { return run(std::vector<std::string>(argv + 1, argv + argc)); });
}
