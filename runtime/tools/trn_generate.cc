// trn-generate: continue a prompt, or answer a chat, with a model trn-train saved (--save), trn-ckpt
// consolidated, or a Hugging Face directory (--init-hf).
//
//   trn-generate --model FILE.safetensors|--init-hf DIR [--tokenizer tok.model] --prompt TEXT
//                [--max-new-tokens N --temperature T --top-k K --top-p P --seed S]
//   trn-generate --init-hf DIR --chat [--system TEXT] [--messages FILE.json] [--prompt TEXT]
//
// The shape comes from the file's trn.model metadata (--preset for a file without it) or DIR's
// config.json, the weights load into the whole model (one process, fp32), and the family's
// KV-cached decoder (runtime/model/decode.h) prefills the prompt and then decodes one token at a
// time, until --max-new-tokens, the context length or a stop token: the tokenizer's eos, the
// eos ids of DIR's generation_config.json, and under --chat the format's end of turn. Text goes
// through the --tokenizer (SentencePiece or a tokenizer.json; DIR/tokenizer.json by default under
// --init-hf), or without one is byte-level: a prompt's UTF-8 bytes are its tokens (vocabulary
// 256) and each sampled token is printed as its byte. A model with more embedding rows than the
// tokenizer has ids (padding) is allowed, its padding ids never sampled; a tokenizer with more
// ids than the model has rows is refused before generating (Text).
//
// --chat formats the conversation (--system, the messages of --messages, then --prompt as the
// last user message) in the model's chat format (runtime/data/tokenizer_chat.h: Llama-3's or
// ChatML, read from tokenizer_config.json's chat_template, or --chat-format), ending with the
// assistant's header, and prints only the reply. --print-prompt prints the text the model would
// be given and exits. generation_config.json's sampling defaults (do_sample, temperature, top_p,
// top_k, max_new_tokens / max_length) apply to every flag not given; one stderr line says which.
// stdout gets the prompt (not under --chat) and its continuation as it is sampled; stderr one
// line of tokens/s for the prefill and the decode.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "collectives/core/error.h"
#include "collectives/core/flags.h"
#include "collectives/core/main.h"
#include "runtime/data/tokenizer.h"
#include "runtime/data/tokenizer_chat.h"
#include "runtime/io/hf_config.h"
#include "runtime/io/hf_dir.h"
#include "runtime/io/input_file.h"
#include "runtime/io/safetensors.h"
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
  bool chat = false, print_prompt = false, no_generation_prompt = false;
  std::string chat_format, system, messages;
  std::set<std::string> given;  // the flags on the command line (generation_config.json fills the others)
};

flags::Table table(Args* a) {
  return {
      .program = "trn-generate",
      .summary = "\nContinues --prompt with the model in --model, KV-cached, through --tokenizer (or as bytes).\n"
                 "Prints the prompt and its continuation; tokens/s of the prefill and the decode go to stderr.\n"
                 "--temperature 0 is greedy (bit-reproducible); otherwise temperature, top-k and top-p\n"
                 "sampling from a generator seeded by --seed. Under --init-hf, generation_config.json's\n"
                 "defaults apply to the sampling flags not given. --chat answers a conversation in the\n"
                 "model's chat format (Llama-3 or ChatML) and prints the reply.\n",
      .flags =
          {
              {"--model", &a->model, "the model: a safetensors file saved by trn-train --save or trn-ckpt", "", "FILE",
               ""},
              {"--init-hf", &a->init_hf,
               "the model as a Hugging Face directory (config.json and its safetensors), instead of --model", "",
               "DIR", ""},
              {"--tokenizer", &a->tokenizer,
               "a SentencePiece model (trn-data tokenizer train) or a Hugging Face tokenizer.json (default under "
               "--init-hf: DIR/tokenizer.json when there is one); without it text is bytes (vocabulary 256)",
               "",
               "tok.model", ""},
              {"--preset", &a->preset,
               "the shape of a file without trn.model metadata: a trn-train --model preset (tiny, llama-tiny, ...)",
               "", "NAME", ""},
              {"--prompt", &a->prompt, "the text to continue (under --chat: the user's message)", "", "TEXT", ""},
              {"--max-new-tokens", &a->max_new_tokens, "tokens to generate (fewer at the context length)", "", "N",
               nullptr, flags::Range::kNonNegative},
              {"--temperature", &a->temperature, "0: greedy; otherwise the logits are divided by it", "Sampling", "T",
               nullptr, flags::Range::kNonNegative},
              {"--top-k", &a->top_k, "sample among the K most likely tokens (0: all)", "Sampling", "K", nullptr,
               flags::Range::kNonNegative},
              {"--top-p", &a->top_p, "sample among the most likely tokens whose probabilities sum to P", "Sampling",
               "P", nullptr, flags::Range::kMinMax, 0.0, 1.0},
              {"--seed", &a->seed, "the sampling generator's seed", "Sampling", "S"},
              {"--chat", &a->chat,
               "answer a conversation: --system, the messages of --messages, then --prompt as the user's message, "
               "in the model's chat format; prints the reply",
               "Chat"},
              {"--system", &a->system, "the system message, first in the conversation", "Chat", "TEXT", ""},
              {"--messages", &a->messages,
               "the conversation as JSON: [{\"role\": \"system|user|assistant\", \"content\": \"...\"}, ...] "
               "(or {\"messages\": [...]})",
               "Chat", "FILE", ""},
              {"--chat-format", &a->chat_format,
               "the chat format, instead of the one tokenizer_config.json's chat_template names", "Chat", "", "",
               flags::Range::kAny, 0, 0, "llama3|chatml"},
              {"--no-generation-prompt", &a->no_generation_prompt,
               "end the formatted conversation with its last message, without the assistant's header "
               "(add_generation_prompt=False)",
               "Chat"},
              {"--print-prompt", &a->print_prompt,
               "print the text the model would be given (the formatted conversation under --chat) and exit, loading "
               "no weights",
               "Chat"},
              {"--dump-logits", &a->dump_logits,
               "write the logits each token was chosen from, float32 rows of the vocabulary (for tests)", "Testing",
               "FILE", ""},
          },
      .usage = "--model FILE.safetensors|--init-hf DIR [--tokenizer tok.model] --prompt TEXT --max-new-tokens N "
               "[--temperature T --top-k K --top-p P --seed S]\n"
               "       trn-generate --init-hf DIR --chat [--system TEXT] [--messages FILE.json] [--prompt TEXT]",
  };
}

// The table, recording in a->given each flag the command line sets.
flags::Table recorded_table(Args* a) {
  flags::Table t = table(a);
  for (flags::Flag& f : t.flags) {
    const std::string name = f.name;
    f.then = [a, name](const std::string&, const std::string&) { a->given.insert(name); };
  }
  return t;
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

// Tokens and text: the tokenizer's (SentencePiece or a tokenizer.json), or bytes. The
// continuation is printed as it grows, through the tokenizer's stream decoder
// (data::Tokenizer::Stream), which holds back an unfinished character.
//
// The model and the tokenizer are checked against each other before anything is generated: the
// model must have an embedding row for every id of the tokenizer. It may have more: checkpoints
// pad their embeddings past the tokenizer (Qwen2.5: 151936 rows for 151665 ids; Megatron rounds
// up to a multiple of 128 x tp), and those rows are never sampled (sampled_vocab). Byte-level
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
    sampled_vocab_ = tok_->vocab();
  }
  const data::Tokenizer* tokenizer() const { return tok_ ? &*tok_ : nullptr; }
  // The ids that may be sampled, [0, sampled_vocab()): the tokenizer's, not the model's padding.
  int sampled_vocab() const { return sampled_vocab_; }
  // add_special: with the tokens the tokenizer adds to a whole text (a tokenizer.json's
  // post-processor, e.g. Llama-3's <|begin_of_text|>; SentencePiece adds none). A chat prompt
  // has its own (the template writes bos_token), as apply_chat_template's ids do.
  std::vector<int32_t> encode(const std::string& s, bool add_special = true) {
    if (tok_) {
      const std::vector<int32_t> ids = tok_->encode(s, add_special);
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

bool exists(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_regular_file(path, ec);
}

// The chat format: --chat-format's, else the one tokenizer_config.json's chat_template names,
// that file read beside the tokenizer, else in the --init-hf directory.
data::ChatTemplate chat_template(const Args& a) {
  if (!a.chat_format.empty()) return data::chat_template_named(a.chat_format, "--chat-format");
  std::vector<std::string> candidates;
  if (!a.tokenizer.empty())
    candidates.push_back((std::filesystem::path(a.tokenizer).parent_path() / "tokenizer_config.json").string());
  if (!a.init_hf.empty()) candidates.push_back(a.init_hf + "/tokenizer_config.json");
  for (const std::string& path : candidates)
    if (exists(path)) return data::chat_template_of_config(io::read_input_file("tokenizer config", path), path);
  throw usage_error("--chat: no tokenizer_config.json {} tells the model's chat format; pass --chat-format llama3 or "
                    "--chat-format chatml",
                    a.tokenizer.empty() ? fmt::format("in --init-hf {}", a.init_hf)
                                        : fmt::format("beside --tokenizer {}", a.tokenizer));
}

// The conversation of --chat: --system, --messages' messages, then --prompt as the user's.
std::vector<data::ChatMessage> conversation(const Args& a) {
  std::vector<data::ChatMessage> messages;
  if (a.given.count("--system")) messages.push_back({"system", a.system});
  if (!a.messages.empty()) {
    auto more = data::parse_chat_messages(io::read_input_file("--messages", a.messages), a.messages);
    if (!messages.empty() && !more.empty() && more[0].role == "system")
      throw usage_error("--system and --messages {} both give the system message: keep one", a.messages);
    messages.insert(messages.end(), more.begin(), more.end());
  }
  if (a.given.count("--prompt")) messages.push_back({"user", a.prompt});
  if (messages.empty())
    throw usage_error("--chat needs a conversation: --prompt TEXT (the user's message), --messages FILE, or both");
  return messages;
}

// The sampling settings and stop ids generation_config.json gives the flags not on the command
// line (transformers' generate(): do_sample false or absent is greedy), and a stderr line saying
// what it took.
void apply_generation_config(const io::HfGeneration& g, const std::string& where, Args* a,
                             std::set<int32_t>* stop, int prompt_tokens) {
  std::vector<std::string> took;
  for (int32_t id : g.eos) stop->insert(id);
  if (!g.eos.empty()) took.push_back(fmt::format("stop at ids {}", fmt::join(g.eos, " ")));
  const bool sample = g.do_sample.value_or(false);
  if (!a->given.count("--temperature")) {
    a->temperature = sample ? g.temperature.value_or(1.0) : 0.0;
    took.push_back(sample           ? fmt::format("temperature {}", a->temperature)
                   : g.do_sample ? "greedy (do_sample false)"
                                 : "greedy (no do_sample)");
  }
  if (sample && g.top_p && !a->given.count("--top-p")) {
    a->top_p = *g.top_p;
    took.push_back(fmt::format("top_p {}", a->top_p));
  }
  if (sample && g.top_k && !a->given.count("--top-k")) {
    a->top_k = *g.top_k;
    took.push_back(fmt::format("top_k {}", a->top_k));
  }
  if (!a->given.count("--max-new-tokens")) {
    if (g.max_new_tokens) {
      a->max_new_tokens = *g.max_new_tokens;
      took.push_back(fmt::format("max_new_tokens {}", a->max_new_tokens));
    } else if (g.max_length) {  // prompt and continuation together
      a->max_new_tokens = std::max(0, *g.max_length - prompt_tokens);
      took.push_back(fmt::format("max_length {} ({} new tokens)", *g.max_length, a->max_new_tokens));
    }
  }
  std::string line = fmt::format("trn-generate: {}: {}", where,
                                 took.empty() ? "nothing taken" : fmt::format("{}", fmt::join(took, ", ")));
  if (!g.unused.empty()) line += fmt::format("; not applied: {}", fmt::join(g.unused, ", "));
  std::fprintf(stderr, "%s\n", line.c_str());
}

int run(const std::vector<std::string>& args) {
  Args a;
  if (args.empty()) {
    std::fputs(flags::help(table(&a)).c_str(), stderr);
    return 2;
  }
  if (!flags::parse(recorded_table(&a), args)) return 0;
  if (a.model.empty() == a.init_hf.empty())
    throw usage_error("give the model by exactly one of --model (a safetensors file saved by trn-train --save) and "
                      "--init-hf (a Hugging Face directory)");
  if (!a.init_hf.empty() && !a.preset.empty())
    throw usage_error("--init-hf {} takes the model's shape from its config.json; drop --preset", a.init_hf);
  if (!a.chat)
    for (const char* f : {"--system", "--messages", "--chat-format", "--no-generation-prompt"})
      if (a.given.count(f)) throw usage_error("{} formats a conversation: add --chat", f);
  // A Hugging Face directory carries its tokenizer.
  if (a.tokenizer.empty() && !a.init_hf.empty() && exists(a.init_hf + "/tokenizer.json"))
    a.tokenizer = a.init_hf + "/tokenizer.json";

  std::string prompt_text = a.prompt;
  std::optional<data::ChatTemplate> chat;
  if (a.chat) {
    const std::vector<data::ChatMessage> messages = conversation(a);
    chat = chat_template(a);
    prompt_text = data::format_chat(*chat, messages, !a.no_generation_prompt);
  } else if (a.prompt.empty()) {
    throw usage_error("--prompt is required and must not be empty: generation continues a text");
  }
  if (a.print_prompt) {
    std::fwrite(prompt_text.data(), 1, prompt_text.size(), stdout);
    std::fflush(stdout);
    return 0;
  }

  const model::Config c = config_of(a);
  c.validate();
  Text text(a.tokenizer, c.vocab, a.init_hf.empty() ? a.model : "--init-hf " + a.init_hf);
  const std::vector<int32_t> prompt = text.encode(prompt_text, /*add_special=*/!chat);
  if (prompt.empty()) throw usage_error("--prompt '{}' encodes to no tokens: generation continues a text", a.prompt);
  if (int(prompt.size()) > c.ctx)
    throw usage_error("--prompt is {} tokens; the model's context (ctx) holds {}: shorten it", prompt.size(), c.ctx);

  // Generation stops at any of these: the tokenizer's eos, generation_config.json's, and the
  // chat format's end of turn (an instruct model ends its reply with it).
  std::set<int32_t> stop;
  if (text.eos() >= 0) stop.insert(text.eos());
  if (chat) {
    const int32_t id = text.tokenizer() ? text.tokenizer()->token_id(chat->end_of_turn) : -1;
    if (id < 0)
      throw usage_error("--chat: the {} format ends a turn with {}, which is no token of --tokenizer {}", chat->name(),
                        chat->end_of_turn, a.tokenizer.empty() ? "(none: byte-level text)" : a.tokenizer);
    stop.insert(id);
  }
  if (!a.init_hf.empty())
    if (const auto g = io::read_hf_generation(a.init_hf))
      apply_generation_config(*g, a.init_hf + "/generation_config.json", &a, &stop, int(prompt.size()));

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

  if (!chat) {  // a chat prints its reply only
    std::fwrite(a.prompt.data(), 1, a.prompt.size(), stdout);
    std::fflush(stdout);
  }
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
    if (stop.count(next)) break;
    text.add(next);
    ++sampled;
    if (i + 1 < new_tokens) {  // the last token's logits are not needed
      decoder->append(&next, 1, logits.data());
      ++decoded;
    }
  }
  const double decode_s = seconds_since(t1);
  const std::string stopped = sampled < new_tokens            ? ", stopped at eos"
                              : new_tokens < a.max_new_tokens ? fmt::format(", stopped at the context length {}", c.ctx)
                                                              : "";
  text.finish();
  std::fputc('\n', stdout);
  std::fflush(stdout);
  if (dump && std::fclose(dump) != 0) throw usage_error("--dump-logits {}: writing it failed", a.dump_logits);
  std::fprintf(stderr, "trn-generate: prefill %zu tokens in %.3f s (%s), decode %d tokens in %.3f s (%s)%s\n",
               prompt.size(), prefill_s, rate(int(prompt.size()), prefill_s).c_str(), decoded, decode_s,
               rate(decoded, decode_s).c_str(), stopped.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return trn::run_main("trn-generate", [&] { return run(std::vector<std::string>(argv + 1, argv + argc)); });
}
