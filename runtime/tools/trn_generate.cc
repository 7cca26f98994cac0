// trn-generate: continue a prompt with a model trn-train saved (--save) or trn-ckpt consolidated.
//
//   trn-generate --model FILE.safetensors [--tokenizer tok.model] --prompt TEXT --max-new-tokens N
//                [--temperature T --top-k K --top-p P --seed S]
//
// The shape comes from the file's trn.model metadata (--preset for a file without it), the
// weights load into the whole model (one process, fp32), and the family's KV-cached decoder
// (runtime/model/decode.h) prefills the prompt and then decodes one token at a time, until
// --max-new-tokens, the context length or the tokenizer's eos. Text goes through the --tokenizer
// (SentencePiece or a tokenizer.json), or without one is byte-level: a prompt's UTF-8 bytes are its tokens
// (vocabulary 256) and each sampled token is printed as its byte. A model vocabulary padded past
// the tokenizer's (to a multiple) is allowed, its padding ids never sampled; any other mismatch
// is refused before generating (Text). stdout gets the prompt and its
// continuation as it is sampled; stderr one line of tokens/s for the prefill and the decode.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "collectives/core/error.h"
#include "collectives/core/flags.h"
#include "collectives/core/main.h"
#include "runtime/data/tokenizer.h"
#include "runtime/io/safetensors.h"
#include "runtime/io/hf_config.h"
#include "runtime/io/hf_dir.h"
#include "runtime/model/config.h"
#include "runtime/model/decode.h"
#include "runtime/model/family.h"

namespace {

using namespace trn;

struct Args {
  std::string model, init_hf, tokenizer, preset, prompt, dump_logits;
  int max_new_tokens = 64;
  double temperature = 0.0;
  int top_k = 0;
  double top_p = 1.0;
  uint64_t seed = 1337;
};

flags::Table table(Args* a) {
  return {
      .program = "trn-generate",
      .summary = "\nContinues --prompt with the model in --model, KV-cached, through --tokenizer (or as bytes).\n"
                 "Prints the prompt and its continuation; tokens/s of the prefill and the decode go to stderr.\n"
                 "--temperature 0 is greedy (bit-reproducible); otherwise temperature, top-k and top-p\n"
                 "sampling from a generator seeded by --seed.\n",
      .flags =
          {
              {"--model", &a->model, "the model: a safetensors file saved by trn-train --save or trn-ckpt", "", "FILE",
               ""},
              {"--init-hf", &a->init_hf,
               "the model as a Hugging Face directory (config.json and its safetensors), instead of --model", "",
               "DIR", ""},
              {"--tokenizer", &a->tokenizer,
               "a SentencePiece model (trn-data tokenizer train) or a Hugging Face tokenizer.json; without it text is "
               "bytes (vocabulary 256)",
               "",
               "tok.model", ""},
              {"--preset", &a->preset,
               "the shape of a file without trn.model metadata: a trn-train --model preset (tiny, llama-tiny, ...)",
               "", "NAME", ""},
              {"--prompt", &a->prompt, "the text to continue", "", "TEXT", ""},
              {"--max-new-tokens", &a->max_new_tokens, "tokens to generate (fewer at the context length)", "", "N",
               nullptr, flags::Range::kNonNegative},
              {"--temperature", &a->temperature, "0: greedy; otherwise the logits are divided by it", "Sampling", "T",
               nullptr, flags::Range::kNonNegative},
              {"--top-k", &a->top_k, "sample among the K most likely tokens (0: all)", "Sampling", "K", nullptr,
               flags::Range::kNonNegative},
              {"--top-p", &a->top_p, "sample among the most likely tokens whose probabilities sum to P", "Sampling",
               "P", nullptr, flags::Range::kMinMax, 0.0, 1.0},
              {"--seed", &a->seed, "the sampling generator's seed", "Sampling", "S"},
              {"--dump-logits", &a->dump_logits,
               "write the logits each token was chosen from, float32 rows of the vocabulary (for tests)", "Testing",
               "FILE", ""},
          },
      .usage = "--model FILE.safetensors|--init-hf DIR [--tokenizer tok.model] --prompt TEXT --max-new-tokens N [--temperature T --top-k K --top-p P "
               "--seed S]",
  };
}

model::Config config_of(const Args& a) {
  if (!a.init_hf.empty()) return io::read_hf_config(a.init_hf).config;
  const auto meta = io::read_safetensors_metadata(a.model);  // a usage error naming a missing or corrupt file
  const auto it = meta.find("trn.model");
  if (!a.preset.empty()) return model::preset(a.preset);
  if (it == meta.end())
    throw usage_error("--model {} has no trn.model metadata (trn-train --save and trn-ckpt consolidate write it); "
                      "pass --preset NAME with its shape",
                      a.model);
  return model::parse_config(it->second);
}

// Picks the next token from logits (V). Greedy: the first of the largest. Otherwise softmax of
// logits / temperature over the top-k, then the smallest set of most likely tokens whose
// probabilities reach top-p, renormalised, sampled with one uniform draw of rng.
class Sampler {
 public:
  explicit Sampler(const Args& a) : temperature_(a.temperature), top_k_(a.top_k), top_p_(a.top_p), rng_(a.seed) {}

  int32_t pick(const float* logits, int V) {
    if (temperature_ == 0) return int32_t(std::max_element(logits, logits + V) - logits);
    idx_.resize(V);
    std::iota(idx_.begin(), idx_.end(), 0);
    // Most likely first; ties by id, so the order (and the draw) depends on nothing else.
    std::sort(idx_.begin(), idx_.end(), [&](int x, int y) { return logits[x] > logits[y] || (logits[x] == logits[y] && x < y); });
    int n = top_k_ > 0 ? std::min(top_k_, V) : V;
    prob_.resize(n);
    const double mx = logits[idx_[0]];
    double sum = 0;
    for (int i = 0; i < n; ++i) sum += prob_[i] = std::exp((logits[idx_[i]] - mx) / temperature_);
    double kept = 0;
    int m = 0;
    while (m < n && (m == 0 || kept < top_p_ * sum)) kept += prob_[m++];
    // 53 random bits as a double in [0, 1): the same on every platform for a seed.
    const double u = double(rng_() >> 11) * 0x1.0p-53 * kept;
    double acc = 0;
    for (int i = 0; i < m; ++i) {
      acc += prob_[i];
      if (u < acc) return idx_[i];
    }
    return idx_[m - 1];
  }

 private:
  double temperature_;
  int top_k_;
  double top_p_;
  std::mt19937_64 rng_;
  std::vector<int> idx_;
  std::vector<double> prob_;
};

// The most a model's vocabulary may be padded past its tokenizer's: Megatron rounds it up to a
// multiple of 128 x the tensor-parallel size (--make-vocab-size-divisible-by), so up to 1024 at
// tp 8; GPT-2's 50257 becomes 50304, a multiple of 64 and 128.
constexpr int kMaxPaddingMultiple = 1024;

// Whether a model vocabulary of `model` ids is `pieces` rounded up to a multiple of a power of
// two up to kMaxPaddingMultiple, the largest dividing `model` (the padding tokens are never
// trained, so never worth sampling); any other difference means the two were not made
// together.
bool padded_vocab(int model, int pieces) {
  const int multiple = std::min(model & -model, kMaxPaddingMultiple);  // the largest power of 2 dividing it
  return model >= pieces && model - pieces < multiple;
}

// Tokens and text: the tokenizer's (SentencePiece or a tokenizer.json), or bytes. The
// continuation is printed as it grows, through the tokenizer's stream decoder
// (data::Tokenizer::Stream), which holds back an unfinished character.
//
// The model and the tokenizer are checked against each other before anything is generated: the
// model's vocabulary must be the tokenizer's, or it padded up to a multiple (padded_vocab); then
// only the tokenizer's ids are ever sampled (sampled_vocab), the padding ids masked. Byte-level
// text takes a model of vocabulary 256 only: a larger one was trained on some tokenizer's ids.
class Text {
 public:
  Text(const std::string& tokenizer, int vocab, const std::string& model) : sampled_vocab_(vocab) {
    if (tokenizer.empty()) {
      if (vocab != 256)
        throw usage_error("--model {} has a vocabulary of {}; pass its --tokenizer (byte-level text needs vocab 256)",
                          model, vocab);
      return;
    }
    tok_.emplace(data::Tokenizer::load(tokenizer));
    if (tok_->vocab() > vocab)
      throw usage_error("--tokenizer {} has {} pieces but --model {} a vocabulary of {}: they were not trained together",
                        tokenizer, tok_->vocab(), model, vocab);
    if (!padded_vocab(vocab, tok_->vocab()))
      throw usage_error("--model {} has a vocabulary of {} but --tokenizer {} {} pieces: more than padding to a "
                        "multiple (at most {}) adds, so they were not trained together; pass the model's own tokenizer",
                        model, vocab, tokenizer, tok_->vocab(), kMaxPaddingMultiple);
    sampled_vocab_ = tok_->vocab();
  }
  // The ids that may be sampled, [0, sampled_vocab()): the tokenizer's, not the model's padding.
  int sampled_vocab() const { return sampled_vocab_; }
  std::vector<int32_t> encode(const std::string& s) {
    if (tok_) {
      // With the tokens the tokenizer adds to a whole text (a tokenizer.json's post-processor,
      // e.g. Llama-3's <|begin_of_text|>); SentencePiece adds none.
      const std::vector<int32_t> ids = tok_->encode(s, /*add_special=*/true);
      stream_.emplace(tok_->stream(ids));
      return ids;
    }
    std::vector<int32_t> ids(s.begin(), s.end());
    for (auto& t : ids) t = int32_t(uint8_t(t));
    return ids;
  }
  int32_t eos() const { return tok_ ? tok_->eos() : -1; }
  // Appends a sampled token and prints what it adds to the text.
  void add(int32_t t) {
    if (!tok_) {
      std::fputc(char(uint8_t(t)), stdout);
      std::fflush(stdout);
      return;
    }
    print(stream_->push(t));
  }
  // Prints what the tokenizer still held back (an unfinished character).
  void finish() {
    if (stream_) print(stream_->finish());
  }

 private:
  static void print(const std::string& s) {
    if (s.empty()) return;
    std::fwrite(s.data(), 1, s.size(), stdout);
    std::fflush(stdout);
  }
  std::optional<data::Tokenizer> tok_;
  std::optional<data::Tokenizer::Stream> stream_;  // decodes the continuation, after the prompt
  int sampled_vocab_;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string rate(int tokens, double s) {
  return s > 0 ? fmt::format("{:.1f} tokens/s", tokens / s) : std::string("- tokens/s");
}

int run(const std::vector<std::string>& args) {
  Args a;
  if (args.empty()) {
    std::fputs(flags::help(table(&a)).c_str(), stderr);
    return 2;
  }
  if (!flags::parse(table(&a), args)) return 0;
  if (a.model.empty() == a.init_hf.empty())
    throw usage_error("give the model by exactly one of --model (a safetensors file saved by trn-train --save) and "
                      "--init-hf (a Hugging Face directory)");
  if (!a.init_hf.empty() && !a.preset.empty())
    throw usage_error("--init-hf {} takes the model's shape from its config.json; drop --preset", a.init_hf);
  if (a.prompt.empty()) throw usage_error("--prompt is required and must not be empty: generation continues a text");
  const model::Config c = config_of(a);
  c.validate();
  Text text(a.tokenizer, c.vocab, a.init_hf.empty() ? a.model : "--init-hf " + a.init_hf);
  const std::vector<int32_t> prompt = text.encode(a.prompt);
  if (prompt.empty()) throw usage_error("--prompt '{}' encodes to no tokens: generation continues a text", a.prompt);
  if (int(prompt.size()) > c.ctx)
    throw usage_error("--prompt is {} tokens; the model's context (ctx) holds {}: shorten it", prompt.size(), c.ctx);

  const model::ParamLayout layout(c);
  std::vector<float> params(layout.total());
  if (a.init_hf.empty())
    io::load_gpt2(a.model, layout, params.data());
  else
    io::load_hf(a.init_hf, layout, params.data());
  auto decoder = model::family(c.arch).make_decoder(layout, params.data());

  const int room = c.ctx - int(prompt.size());
  const int new_tokens = std::min(a.max_new_tokens, room);
  std::FILE* dump = nullptr;
  if (!a.dump_logits.empty() && !(dump = std::fopen(a.dump_logits.c_str(), "wb")))
    throw usage_error("--dump-logits {}: cannot write it", a.dump_logits);

  std::fwrite(a.prompt.data(), 1, a.prompt.size(), stdout);
  std::fflush(stdout);
  std::vector<float> logits(c.vocab);
  Sampler sampler(a);
  const auto t0 = std::chrono::steady_clock::now();
  decoder->append(prompt.data(), int(prompt.size()), logits.data());
  const double prefill_s = seconds_since(t0);
  const auto t1 = std::chrono::steady_clock::now();
  int decoded = 0, sampled = 0;
  for (int i = 0; i < new_tokens; ++i) {
    if (dump) std::fwrite(logits.data(), sizeof(float), logits.size(), dump);
    const int32_t next = sampler.pick(logits.data(), text.sampled_vocab());  // padding ids are never picked
    if (next == text.eos()) break;
    text.add(next);
    ++sampled;
    if (i + 1 < new_tokens) {  // the last token's logits are not needed
      decoder->append(&next, 1, logits.data());
      ++decoded;
    }
  }
  const double decode_s = seconds_since(t1);
  const std::string stop = sampled < new_tokens            ? ", stopped at eos"
                           : new_tokens < a.max_new_tokens ? fmt::format(", stopped at the context length {}", c.ctx)
                                                           : "";
  text.finish();
  std::fputc('\n', stdout);
  std::fflush(stdout);
  if (dump && std::fclose(dump) != 0) throw usage_error("--dump-logits {}: writing it failed", a.dump_logits);
  std::fprintf(stderr, "trn-generate: prefill %zu tokens in %.3f s (%s), decode %d tokens in %.3f s (%s)%s\n",
               prompt.size(), prefill_s, rate(int(prompt.size()), prefill_s).c_str(), decoded, decode_s,
               rate(decoded, decode_s).c_str(), stop.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return trn::run_main("trn-generate", [&] { return run(std::vector<std::string>(argv + 1, argv + argc)); });
}
