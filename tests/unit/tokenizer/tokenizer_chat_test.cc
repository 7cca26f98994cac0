// Chat prompts (runtime/data/tokenizer_chat.h) in one process: the formats' text on small cases
// written out by hand (the real templates are checked with jinja2 in
// tests/integration/generate/hf_generate_test.cc), the format read from a chat_template, what is
// refused, and Python's str.strip() white space.
#include <catch2/catch.hpp>
#include <functional>
#include <nlohmann/json.hpp>

#include "collectives/core/error.h"
#include "runtime/data/tokenizer_chat.h"

using namespace trn;
using namespace trn::data;
using json = nlohmann::json;

namespace {

std::string config_with(const std::string& chat_template, const std::string& bos = "<|begin_of_text|>") {
  return json{{"chat_template", chat_template}, {"bos_token", bos}}.dump();
}

// Fragments of the real templates: what the format detection reads.
const std::string kLlama3 =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 "
    "%}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";
const std::string kQwen2 =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
    "'<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + "
    "message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt "
    "%}{{ '<|im_start|>assistant\\n' }}{% endif %}";

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("llama3: bos, headers, trimmed contents, and the assistant's header as the generation prompt") {
  const ChatTemplate t = chat_template_of_config(config_with(kLlama3), "tokenizer_config.json");
  CHECK(t.name() == "llama3");
  CHECK(t.end_of_turn == "<|eot_id|>");
  CHECK_FALSE(t.always_generation_prompt);
  const std::vector<ChatMessage> chat = {{"system", " Be brief.\n"}, {"user", "\u3000Hi\u00a0"}};
  CHECK(format_chat(t, chat, true) ==
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
  CHECK(format_chat(t, chat, false).ends_with("Hi<|eot_id|>"));
  // Meta's first template has no add_generation_prompt: it always ends with the header.
  std::string first = kLlama3;
  first.replace(first.find("{% if add_generation_prompt %}"), 30, "");
  first.replace(first.rfind("{% endif %}"), 11, "");
  const ChatTemplate always = chat_template_of_config(config_with(first), "tokenizer_config.json");
  CHECK(always.always_generation_prompt);
  CHECK(format_chat(always, chat, false).ends_with("<|start_header_id|>assistant<|end_header_id|>\n\n"));
}

TEST_CASE("chatml: the template's default system message, a given one instead, a later one kept in order") {
  const ChatTemplate t = chat_template_of_config(config_with(kQwen2, ""), "tokenizer_config.json");
  CHECK(t.name() == "chatml");
  CHECK(t.default_system == "You are a helpful assistant.");
  CHECK(format_chat(t, {{"user", " hi "}}, true) ==
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n hi <|im_end|>\n"
        "<|im_start|>assistant\n");
  CHECK(format_chat(t, {{"system", ""}, {"user", "a"}, {"system", "b"}}, false) ==
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\na<|im_end|>\n<|im_start|>system\nb<|im_end|>\n");
  // Without a default in the template, none; --chat-format chatml takes Qwen2.5's.
  const ChatTemplate plain = chat_template_of_config(
      config_with("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}"
                  "{% endfor %}"),
      "x");
  CHECK(plain.default_system.empty());
  CHECK(chat_template_named("chatml", "--chat-format").default_system ==
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
}

TEST_CASE("chat templates trn does not build in, and bad conversations, are one usage error") {
  const auto refused = [](const std::string& config) {
    return error_of([&] { chat_template_of_config(config, "DIR/tokenizer_config.json"); });
  };
  CHECK_THAT(refused(R"({"bos_token": "x"})"), Catch::Contains("no chat_template") && Catch::Contains("--chat-format"));
  CHECK_THAT(refused(config_with("{{ messages }}")), Catch::Contains("neither Llama-3's"));
  CHECK_THAT(refused(config_with(kLlama3 + "Cutting Knowledge Date: December 2023")), Catch::Contains("Llama-3.1"));
  CHECK_THAT(refused(config_with(kQwen2 + "<think>")), Catch::Contains("reasoning"));
  CHECK_THAT(refused("{"), Catch::Contains("not JSON"));
  CHECK_THAT(error_of([] { chat_template_named("gemma", "--chat-format"); }),
             Catch::Contains("--chat-format takes llama3 or chatml, got 'gemma'"));
  const ChatTemplate t = chat_template_named("llama3", "--chat-format");
  CHECK_THAT(error_of([&] { format_chat(t, {}, true); }), Catch::Contains("no message"));
  CHECK_THAT(error_of([&] { format_chat(t, {{"tool", "x"}}, true); }), Catch::Contains("role is 'tool'"));
}

TEST_CASE("a messages file: a list, or an object holding it; anything else refused by message") {
  const auto m = parse_chat_messages(R"([{"role": "user", "content": "hi"}])", "m.json");
  REQUIRE(m.size() == 1);
  CHECK((m[0].role == "user" && m[0].content == "hi"));
  CHECK(parse_chat_messages(R"({"messages": [{"role": "system", "content": ""}]})", "m.json").size() == 1);
  CHECK_THAT(error_of([] { parse_chat_messages(R"({"role": "user"})", "m.json"); }), Catch::Contains("a list"));
  CHECK_THAT(error_of([] { parse_chat_messages(R"([{"role": "user", "content": null}])", "m.json"); }),
             Catch::Contains("message 0"));
  CHECK_THAT(error_of([] { parse_chat_messages("[", "m.json"); }), Catch::Contains("m.json: not JSON"));
}

TEST_CASE("python_strip removes what Python's str.strip() removes, Unicode white space included") {
  CHECK(python_strip(" \t\n\v\f\r\x1c\x1d\x1e\x1fx y\x85") == "x y\x85");  // \x85 alone is no UTF-8 character
  CHECK(python_strip("\u00a0\u1680\u2000\u200a\u2028\u2029\u202f\u205f\u3000a\u00a0b\u0085") == "a\u00a0b");
  CHECK(python_strip("\u200b zero-width space is no white space \u200b") ==
        "\u200b zero-width space is no white space \u200b");
  CHECK(python_strip("") == "");
  CHECK(python_strip(" \u3000 ") == "");
}
