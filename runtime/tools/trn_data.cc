// trn-data: from a folder of text to token shards trn-train (and Megatron) read.
//
//   trn-data tokenizer train --input 'GLOB' --vocab N --model-type bpe|unigram --out tok.model
//   trn-data tokenize --tokenizer tok.model --input 'GLOB' --out DIR [--shard-tokens N]
//                     [--val-fraction F] [--threads N]
//   trn-data inspect DIR|PREFIX [--tokenizer tok.model]
//   trn-data encode --tokenizer FILE < text      one line of ids per line of text
//   trn-data decode --tokenizer FILE < ids       one line of text per line of ids
//
// --tokenizer takes a SentencePiece model or a Hugging Face tokenizer.json (byte-level BPE, as
// Llama-3 and Qwen2 use); runtime/data/tokenizer.h tells them apart.
//
// A document is one input file. With a SentencePiece model its tokens are the encodings of its
// non-empty lines (each line as the sentencepiece module's encode() gives it, the way the
// tokenizer was trained), back to back. With a tokenizer.json they are the encoding of its whole
// text, newlines included, with the post-processor's tokens around it (Llama-3's
// <|begin_of_text|>), as Hugging Face's encode(text) gives them: each document is encoded whole by
// one thread (a cut inside it could split a run of white space differently, or add a ByteLevel
// prefix space where the text has none), so the threads share out the documents. Either way the model's end-of-sequence token follows when it has one (for a
// tokenizer.json, the eos_token of the tokenizer_config.json beside it). A document goes to val
// when the XXH64 hash of its bytes, as a fraction of 2^64, is below --val-fraction: the split
// depends on the text alone, not on file names or order. Documents are written in sorted path
// order, so the shards are the same bytes for any --threads.
//
// The output directory is a unit (runtime/data/dataset_dir.h): it is built beside --out in
// OUT.partial-<pid>, gets its manifest (trn-dataset.json) last, and is renamed to --out only when
// complete. --out must not exist yet or be an empty directory: tokenize refuses a non-empty one
// rather than replace it, so it never mixes two runs' shards and never deletes a user's files. A
// failure, SIGINT or SIGTERM removes the partial directory (a second signal ends at once; readers
// still refuse what is left, by its marker file).
#include <fmt/format.h>
#include <glob.h>
#include <signal.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "collectives/core/stop_signal.h"
#include "collectives/core/error.h"
#include "collectives/core/flags.h"
#include "collectives/core/main.h"
#include "runtime/data/data.h"
#include "runtime/data/dataset_dir.h"
#include "runtime/data/indexed.h"
#include "runtime/data/tokenizer.h"
#include "runtime/io/atomic_file.h"
#include "runtime/io/input_file.h"

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
          "  inspect          shards, documents, tokens, dtype and a decoded sample\n"
          "  encode           each line of stdin (without its newline) as its token ids, with the tokens the\n"
          "                   tokenizer adds to a text (a tokenizer.json's post-processor), on one line\n"
          "  decode           each line of stdin, token ids separated by spaces, as its text\n",
      .flags =
          {
              {"--input", &a->input, "the text files: a quoted glob or a directory", "input", "GLOB"},
              {"--out", &a->out, "tokenizer train: the model file; tokenize: the output directory, new or empty",
               "output", "PATH"},
              {"--tokenizer", &a->tokenizer,
               "a SentencePiece model or a tokenizer.json (tokenize, encode, decode; inspect: decodes a sample)",
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
          "       trn-data inspect DIR|PREFIX [--tokenizer tok.model]\n"
          "       trn-data encode|decode --tokenizer tok.model|tokenizer.json < lines",
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

// ---- stopping on SIGINT / SIGTERM ----

// tokenize stops at its next check (between files read, lines encoded and documents written:
// well within a second), removing its partial output as it unwinds (collectives/core/stop_signal.h).

struct Stopped {
  int signal;
};

bool stop_requested() { return stop_signal::received() != 0; }
void stop_point() {
  if (const int sig = stop_signal::received()) throw Stopped{sig};
}

// One library call can outlast the second a stop may take: SentencePiece encodes a line whole
// (a single 8 MB line takes it tens of seconds), a tokenizer.json a whole document (about a
// second per megabyte), and reading one multi-gigabyte input file takes
// seconds. A watchdog thread covers them: once a stop has waited kStopGrace for tokenize to reach
// a check, it removes the work directory itself and ends the process with tokenize's own stop
// line and exit code. `mu` orders it against the commit: the watchdog acts only while the
// dataset is uncommitted, and a commit that has passed its last check completes first.
struct Abandon {
  std::mutex mu;
  std::string dir;         // the work directory, once made
  bool committed = false;  // the dataset is in place at --out: nothing to abandon
  bool finished = false;   // tokenize returned or unwound: it handles the stop itself
};
Abandon g_abandon;
constexpr auto kStopGrace = std::chrono::milliseconds(700);

// ---- the output directory ----

// --out without trailing slashes; usage errors unless it can become the dataset: it does not
// exist (its parents are created), or it is an empty directory that is not a mount point (the
// finished dataset is renamed onto it, which a mount point refuses).
std::string check_out(std::string out) {
  if (out.empty()) throw usage_error("tokenize needs --out DIR");
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  struct stat st {};
  if (::lstat(out.c_str(), &st) != 0) {
    io::make_writable_dir("--out", data::parent_dir(out));
    return out;
  }
  if (S_ISLNK(st.st_mode) || !S_ISDIR(st.st_mode)) {
    if (::stat(out.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      throw usage_error("--out {} is a file, not a directory; tokenize writes a directory of shards: give a path "
                        "that does not exist yet",
                        out);
    out = fs::canonical(out).string();  // a link to a directory: the dataset goes where it points
  }
  std::error_code ec;
  const fs::directory_iterator first(out, ec);
  if (ec) throw usage_error("cannot read --out {}: {}", out, ec.message());
  if (first != fs::directory_iterator())
    throw usage_error("--out {} is not empty (it holds {}); tokenize writes a dataset whole and refuses to mix it "
                      "with other files or to delete them: remove the directory first (rm -r {}) or give a new one",
                      out, first->path().filename().string(), out);
  struct stat up {};
  if (::stat(data::parent_dir(out).c_str(), &up) == 0 && up.st_dev != st.st_dev)
    throw usage_error("--out {} is a mount point; tokenize builds the dataset beside it and renames it into place, "
                      "which a mount point cannot take: give a directory inside it, e.g. {}/tokens",
                      out, out);
  io::make_writable_dir("--out", data::parent_dir(out));
  return out;
}

// The dataset being written: OUT.partial-<pid>, holding the marker file until commit() puts the
// manifest in and renames it to OUT. Destroyed uncommitted (an error or a signal), it is removed
// with everything in it.
class Staging {
 public:
  explicit Staging(std::string out) : out_(std::move(out)), dir_(out_ + ".partial-" + std::to_string(::getpid())) {
    std::lock_guard<std::mutex> lock(g_abandon.mu);
    if (::mkdir(dir_.c_str(), 0755) != 0)
      throw usage_error("cannot create {} (tokenize's work directory beside --out): {}", dir_, std::strerror(errno));
    g_abandon.dir = dir_;  // once made by this run: the watchdog removes only what this run made
    io::write_file_atomic(dir_ + "/" + data::kDatasetPartial, "");
  }
  ~Staging() {
    if (committed_) return;
    std::lock_guard<std::mutex> lock(g_abandon.mu);  // never beside the watchdog's removal
    std::error_code ec;
    fs::remove_all(dir_, ec);
    g_abandon.dir.clear();
  }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  const std::string& dir() const { return dir_; }

  // The manifest names every file written; then the marker goes, and the directory becomes OUT.
  void commit() {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_))
      if (e.path().filename() != data::kDatasetPartial) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    data::write_dataset_manifest(dir_, names);
    std::lock_guard<std::mutex> lock(g_abandon.mu);  // the watchdog waits for the commit
    stop_point();  // the last moment to stop: after it, the dataset is complete
    if (::unlink((dir_ + "/" + data::kDatasetPartial).c_str()) != 0)
      throw usage_error("cannot finish {}: {}", dir_, std::strerror(errno));
    sync_dir(dir_);
    if (::rename(dir_.c_str(), out_.c_str()) != 0)
      throw usage_error("cannot put the dataset in place at --out {}: {} (did another process write there?)", out_,
                        std::strerror(errno));
    committed_ = true;
    g_abandon.committed = true;
    sync_dir(data::parent_dir(out_));
  }

 private:
  static void sync_dir(const std::string& d) {
    const int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
      ::fsync(fd);
      ::close(fd);
    }
  }
  std::string out_, dir_;
  bool committed_ = false;
};

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

// A stop request ends it after the current line (the batch is then dropped whole). A
// tokenizer.json's piece is its whole document (see the top of the file).
void encode_piece(const data::Tokenizer& tok, const std::string& text, Piece* p) {
  if (tok.kind() == data::Tokenizer::Kind::kTokenizerJson) {
    p->ids = tok.encode(std::string_view(text).substr(p->begin, p->end - p->begin));
    return;
  }
  size_t start = p->begin;
  while (start < p->end && !stop_requested()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos || end > p->end) end = p->end;
    if (end > start) {
      const auto ids = tok.encode(std::string_view(text).substr(start, end - start));
      p->ids.insert(p->ids.end(), ids.begin(), ids.end());
    }
    start = end + 1;
  }
}

// Reads the next files, about kBatchBytes of them (at least one), checking each is UTF-8.
std::vector<std::string> read_batch(const std::vector<std::string>& files, size_t* next) {
  constexpr size_t kBatchBytes = 64 << 20;
  std::vector<std::string> texts;
  size_t batch = 0;
  while (*next < files.size() && (texts.empty() || batch < kBatchBytes)) {
    stop_point();
    texts.push_back(io::read_input_file("input file", files[*next]));
    const size_t bad = data::utf8_error_offset(texts.back());
    if (bad != std::string_view::npos)
      throw usage_error("{} is not UTF-8 text (invalid byte at offset {})", files[*next], bad);
    batch += texts.back().size();
    ++*next;
  }
  return texts;
}

// The texts cut into pieces of whole lines, about kPieceBytes each, in order; with `whole`, one
// piece per text.
std::vector<Piece> cut_pieces(const std::vector<std::string>& texts, bool whole) {
  constexpr size_t kPieceBytes = 1 << 20;
  std::vector<Piece> pieces;
  for (size_t d = 0; d < texts.size(); ++d) {
    const std::string& t = texts[d];
    size_t b = 0;
    do {
      size_t e = whole ? t.size() : std::min(t.size(), b + kPieceBytes);
      if (e < t.size()) {
        const size_t nl = t.find('\n', e);
        e = nl == std::string::npos ? t.size() : nl + 1;
      }
      pieces.push_back({d, b, e, {}});
      b = e;
    } while (b < t.size());
  }
  return pieces;
}

// Encodes the pieces on `threads` threads, in any order. The first error any thread meets is
// rethrown here; a stop request ends every thread after its current piece.
void encode_pieces(const data::Tokenizer& tok, const std::vector<std::string>& texts, std::vector<Piece>* pieces,
                   int threads) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr first_error;
  std::mutex error_mu;
  auto work = [&] {
    for (size_t i; !failed && !stop_requested() && (i = next.fetch_add(1)) < pieces->size();) {
      try {
        encode_piece(tok, texts[(*pieces)[i].doc], &(*pieces)[i]);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (!first_error) first_error = std::current_exception();
        failed = true;
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < std::min<int>(threads, static_cast<int>(pieces->size())); ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (first_error) std::rethrow_exception(first_error);
  stop_point();
}

int tokenize(const Args& a) {
  if (a.tokenizer.empty())
    throw usage_error("tokenize needs --tokenizer FILE (make one with trn-data tokenizer train)");
  const std::string out = check_out(a.out);
  const data::Tokenizer tok = data::Tokenizer::load(a.tokenizer);
  const auto files = expand(a.input);
  size_t total = 0;
  for (const auto& f : files) total += fs::file_size(f);
  if (total == 0)
    throw usage_error("the corpus is empty: the {} file(s) --input '{}' matches hold no text", files.size(),
                      a.input);
  Staging staging(out);
  Shards train(staging.dir(), "train", tok.vocab(), a.shard_tokens),
      val(staging.dir(), "val", tok.vocab(), a.shard_tokens);
  Progress progress(total);
  // Files are read a batch at a time (about 64 MB), cut into pieces of whole lines (about 1 MB;
  // a tokenizer.json's documents stay whole) that the threads encode in any order; the documents
  // are then written in file order.
  size_t next_file = 0, done_bytes = 0;
  while (next_file < files.size()) {
    const std::vector<std::string> texts = read_batch(files, &next_file);
    std::vector<Piece> pieces = cut_pieces(texts, tok.kind() == data::Tokenizer::Kind::kTokenizerJson);
    encode_pieces(tok, texts, &pieces, a.threads);
    size_t p = 0;
    for (size_t d = 0; d < texts.size(); ++d) {
      stop_point();
      std::vector<int32_t> doc;
      for (; p < pieces.size() && pieces[p].doc == d; ++p)
        doc.insert(doc.end(), pieces[p].ids.begin(), pieces[p].ids.end());
      if (!doc.empty()) doc = tok.add_special(std::move(doc));
      if (tok.eos() >= 0 && (doc.empty() || doc.back() != tok.eos())) doc.push_back(tok.eos());
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
  staging.commit();
  progress.done();
  const double s = progress.seconds();
  fmt::print("tokenized {} files, {} in {:.2f}s ({:.1f} MB/s): {}; {} -> {}\n", files.size(), mb(total), s,
             s > 0 ? total / s / 1e6 : 0.0, train.summary(), val.summary(), a.out);
  return 0;
}

void print_stopped(int sig, const std::string& out) {
  if (::isatty(STDERR_FILENO) == 1) fmt::print(stderr, "\n");  // after the progress line
  fmt::print(stderr, "trn-data: stopped by {}; nothing written: --out {} was left as it was\n", strsignal(sig), out);
}

// Ends the process for a stop tokenize has not reached a check for in kStopGrace (see Abandon).
void watch_for_stop(const std::string& out) {
  using Clock = std::chrono::steady_clock;
  std::optional<Clock::time_point> since;
  for (;; std::this_thread::sleep_for(std::chrono::milliseconds(20))) {
    const int sig = stop_signal::received();
    std::unique_lock<std::mutex> lock(g_abandon.mu);
    if (g_abandon.finished || g_abandon.committed) return;
    if (!sig) continue;
    if (!since) since = Clock::now();
    if (Clock::now() - *since < kStopGrace) continue;
    // Held until the process ends: no commit can start behind the removal.
    if (!g_abandon.dir.empty()) {
      // The main thread may still be writing a shard (it takes the lock only at the commit):
      // a few tries remove what it added meanwhile.
      std::error_code ec;
      for (int i = 0; i < 10 && fs::exists(g_abandon.dir, ec); ++i) fs::remove_all(g_abandon.dir, ec);
    }
    print_stopped(sig, out);
    std::fflush(stdout);
    std::_Exit(128 + sig);  // the encoding threads are mid-call: no destructor may run under them
  }
}

// tokenize, stopped cleanly by SIGINT or SIGTERM: one line, exit 128 + the signal.
int tokenize_until_stopped(const Args& a) {
  stop_signal::install();
  std::thread watchdog(watch_for_stop, a.out);
  const auto finish = [&] {
    {
      std::lock_guard<std::mutex> lock(g_abandon.mu);
      g_abandon.finished = true;
    }
    watchdog.join();
  };
  try {
    const int rc = tokenize(a);
    finish();
    return rc;
  } catch (const Stopped& s) {
    finish();
    print_stopped(s.signal, a.out);
    return 128 + s.signal;
  } catch (...) {
    finish();
    throw;
  }
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
  const bool is_dir = fs::is_directory(target);
  if (!is_dir) {
    for (const char* ext : {".bin", ".idx"})
      if (target.size() > 4 && target.ends_with(ext)) target.resize(target.size() - 4);
    if (!fs::exists(target + ".idx"))
      throw usage_error("{} is neither a directory nor a shard ({}.idx does not exist)", target, target);
  }
  // An unfinished or mixed trn-data directory is refused before anything in it is read.
  const bool manifest =
      data::check_dataset_dir(is_dir ? target : data::parent_dir(target), "inspect").has_value();
  if (is_dir) {
    for (const auto& e : fs::directory_iterator(target))
      if (e.path().extension() == ".idx")
        prefixes.push_back((e.path().parent_path() / e.path().stem()).string());
    if (prefixes.empty()) throw usage_error("{} holds no shard (no .idx file)", target);
    std::sort(prefixes.begin(), prefixes.end());
  } else {
    prefixes.push_back(target);
  }
  std::optional<data::Tokenizer> tok;
  if (!a.tokenizer.empty()) tok = data::Tokenizer::load(a.tokenizer);
  const std::vector<data::IndexedDataset> shards = data::open_shards(prefixes, "inspect");
  size_t docs = 0, tokens = 0;
  std::vector<int32_t> sample;
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string& p = prefixes[i];
    const data::IndexedDataset& ds = shards[i];
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
  fmt::print("{}\n", manifest ? fmt::format("complete: {} names every file, with its size and hash", data::kDatasetManifest)
                              : fmt::format("no {}: not written by trn-data tokenize, read as it is", data::kDatasetManifest));
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

// Calls f with each line of stdin, without its newline, and the line's number (from 1).
template <typename F>
void for_each_line(F&& f) {
  std::string line;
  std::vector<char> buf(1 << 16);
  size_t number = 0;
  bool partial = false;
  while (size_t n = std::fread(buf.data(), 1, buf.size(), stdin)) {
    size_t at = 0;
    while (at < n) {
      const char* nl = static_cast<const char*>(std::memchr(buf.data() + at, '\n', n - at));
      const size_t end = nl ? size_t(nl - buf.data()) : n;
      line.append(buf.data() + at, end - at);
      partial = !nl;
      if (nl) {
        f(line, ++number);
        line.clear();
      }
      at = end + 1;
    }
  }
  if (std::ferror(stdin)) throw usage_error("reading stdin failed: {}", std::strerror(errno));
  if (partial) f(line, ++number);  // a last line without a newline
}

// Writes out to stdout once it holds some, and at the end: one write per block, not per line.
void flush(std::string* out, bool all) {
  if (out->size() < (1 << 16) && !all) return;
  if (std::fwrite(out->data(), 1, out->size(), stdout) != out->size() || (all && std::fflush(stdout) != 0))
    throw usage_error("writing stdout failed: {}", std::strerror(errno));
  out->clear();
}

data::Tokenizer tokenizer_for(const Args& a, const std::string& cmd) {
  if (a.tokenizer.empty())
    throw usage_error("{} needs --tokenizer FILE (a SentencePiece model or a tokenizer.json)", cmd);
  return data::Tokenizer::load(a.tokenizer);
}

int encode(const Args& a) {
  const data::Tokenizer tok = tokenizer_for(a, "encode");
  std::string out;
  for_each_line([&](const std::string& line, size_t number) {
    if (const size_t bad = data::utf8_error_offset(line); bad != std::string_view::npos)
      throw usage_error("line {} of stdin is not UTF-8 (invalid byte at offset {})", number, bad);
    fmt::format_to(std::back_inserter(out), "{}\n", fmt::join(tok.encode(line, /*add_special=*/true), " "));
    flush(&out, false);
  });
  flush(&out, true);
  return 0;
}

int decode(const Args& a) {
  const data::Tokenizer tok = tokenizer_for(a, "decode");
  std::string out;
  std::vector<int32_t> ids;
  for_each_line([&](const std::string& line, size_t number) {
    ids.clear();
    const char* p = line.data();
    const char* end = p + line.size();
    while (p < end) {
      if (*p == ' ' || *p == '\t' || *p == '\r') {
        ++p;
        continue;
      }
      int32_t id = 0;
      const auto r = std::from_chars(p, end, id);
      if (r.ec != std::errc() || (r.ptr < end && *r.ptr != ' ' && *r.ptr != '\t' && *r.ptr != '\r')) {
        const char* word_end = std::find_if(p, end, [](char c) { return c == ' ' || c == '\t'; });
        throw usage_error("line {} of stdin: '{}' is not a token id (give ids separated by spaces)", number,
                          std::string(p, word_end));
      }
      if (id < 0 || id >= tok.vocab())
        throw usage_error("line {} of stdin: token id {} is outside the vocabulary of {} ({} ids)", number, id,
                          a.tokenizer, tok.vocab());
      ids.push_back(id);
      p = r.ptr;
    }
    out += tok.decode(ids);
    out += '\n';
    flush(&out, false);
  });
  flush(&out, true);
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
    throw usage_error("no command given: use tokenizer train, tokenize, inspect, encode or decode; run trn-data --help");
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
  if (pos.size() > 2 || ((cmd == "tokenize" || cmd == "encode" || cmd == "decode") && pos.size() > 1))
    throw usage_error("unexpected argument '{}'", pos.back());
  if (cmd == "tokenize") return tokenize_until_stopped(a);
  if (cmd == "encode") return encode(a);
  if (cmd == "decode") return decode(a);
  if (cmd == "inspect") {
    if (pos.size() < 2)
      throw usage_error("inspect needs a directory or a shard prefix: trn-data inspect DIR|PREFIX");
    return inspect(a, pos[1]);
  }
  throw usage_error("unknown command '{}': use tokenizer train, tokenize, inspect, encode or decode", cmd);
}

}  // namespace

int main(int argc, char** argv) {
  return trn::run_main("trn-data", [&] { return run(std::vector<std::string>(argv + 1, argv + argc)); });
}
