#include "runtime/data/tokenizer_chat.h"

#include <nlohmann/json.hpp>

#include "collectives/core/error.h"

namespace trn::data {

namespace {

using json = nlohmann::json;

constexpr const char* kQwenSystem = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";

// Python's str.isspace(): Unicode white space (bidirectional class WS, B or S, or category Zs).
bool python_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f ||
         c == 0x3000;
}

// The code point starting at s[i] and its length in bytes; an invalid sequence reads as one byte
// that is no space.
uint32_t code_point(std::string_view s, size_t i, size_t* len) {
  const auto b = [&](size_t k) { return uint8_t(s[i + k]); };
  const uint8_t c = b(0);
  int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
  if (n == 0 || i + n > s.size()) {
    *len = 1;
    return 0xfffd;
  }
  uint32_t cp = n == 1 ? c : c & (0x7f >> n);
  for (int k = 1; k < n; ++k) {
    if ((b(k) & 0xc0) != 0x80) {
      *len = 1;
      return 0xfffd;
    }
    cp = cp << 6 | (b(k) & 0x3f);
  }
  *len = n;
  return cp;
}

bool contains(std::string_view s, std::string_view what) { return s.find(what) != std::string_view::npos; }

// The default system message a ChatML template writes for a conversation without one: the text
// of a literal '<|im_start|>system\n...<|im_end|>' (Qwen2: "You are a helpful assistant.",
// Qwen2.5: "You are Qwen, ..."), jinja's \n escapes read; "" when the template has none.
std::string default_system(std::string_view t) {
  const std::string_view open = "<|im_start|>system", close = "<|im_end|>";
  for (size_t at = t.find(open); at != std::string_view::npos; at = t.find(open, at + 1)) {
    size_t i = at + open.size();
    if (t.substr(i, 2) == "\\n")
      i += 2;
    else if (t.substr(i, 1) == "\n")
      i += 1;
    else
      continue;
    const size_t end = t.find(close, i);
    if (end == std::string_view::npos) continue;
    const std::string_view text = t.substr(i, end - i);
    // A literal holds no quote, concatenation or tag; '<|im_start|>system\n' + messages[0]... is not one.
    if (text.empty() || text.find_first_of("'\"+{}") != std::string_view::npos) continue;
    std::string out;
    for (size_t k = 0; k < text.size(); ++k) {
      if (text[k] == '\\' && k + 1 < text.size()) {
        const char e = text[++k];
        out += e == 'n' ? '\n' : e == 't' ? '\t' : e;
      } else {
        out += text[k];
      }
    }
    return out;
  }
  return "";
}

std::string special_token_text(const json& c, const char* key) {
  const json& v = c.value(key, json());
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return "";
}

}  // namespace

std::string python_strip(std::string_view s) {
  size_t begin = 0, end = s.size();
  while (begin < end) {
    size_t n;
    if (!python_space(code_point(s, begin, &n))) break;
    begin += n;
  }
  // From the back: find the start of the last code point by walking forward from begin.
  size_t last_keep = begin;  // one past the last non-space code point
  for (size_t i = begin; i < end;) {
    size_t n;
    const uint32_t cp = code_point(s, i, &n);
    i += n;
    if (!python_space(cp)) last_keep = i;
  }
  return std::string(s.substr(begin, last_keep - begin));
}

ChatTemplate chat_template_named(const std::string& name, const std::string& flag) {
  ChatTemplate t;
  if (name == "llama3") {
    t.format = ChatTemplate::Format::kLlama3;
    t.bos = "<|begin_of_text|>";
    t.end_of_turn = "<|eot_id|>";
  } else if (name == "chatml") {
    t.format = ChatTemplate::Format::kChatml;
    t.default_system = kQwenSystem;
    t.end_of_turn = "<|im_end|>";
  } else {
    throw usage_error("{} takes llama3 or chatml, got '{}'", flag, name);
  }
  return t;
}

ChatTemplate chat_template_of_config(std::string_view config_text, const std::string& where) {
  json c;
  try {
    c = json::parse(config_text);
  } catch (const json::exception& e) {
    throw usage_error("{}: not JSON: {}", where, e.what());
  }
  const json& tmpl = c.is_object() ? c.value("chat_template", json()) : json();
  std::string text;
  if (tmpl.is_string()) {
    text = tmpl.get<std::string>();
  } else if (tmpl.is_array()) {  // named templates: [{"name": "default", "template": ...}, ...]
    for (const json& e : tmpl)
      if (e.is_object() && e.value("name", "") == "default" && e.contains("template") && e["template"].is_string())
        text = e["template"].get<std::string>();
  }
  if (text.empty())
    throw usage_error("{} has no chat_template, so the model's chat format is unknown; pass --chat-format llama3 or "
                      "--chat-format chatml",
                      where);
  if (contains(text, "<think>") || contains(text, "reasoning_content"))
    throw usage_error("{}: its chat_template writes reasoning blocks (<think>), which trn does not build in; pass "
                      "--chat-format chatml to format the conversation as Qwen2.5's",
                      where);
  if (contains(text, "<|im_start|>")) {
    ChatTemplate t = chat_template_named("chatml", "--chat-format");
    t.default_system = default_system(text);
    return t;
  }
  if (contains(text, "<|start_header_id|>")) {
    if (contains(text, "Cutting Knowledge Date") || contains(text, "date_string") || contains(text, "ipython"))
      throw usage_error("{}: its chat_template is Llama-3.1's or later (date and tool lines in the system turn), "
                        "which trn does not build in; pass --chat-format llama3 to format the conversation as "
                        "Llama-3's",
                        where);
    ChatTemplate t = chat_template_named("llama3", "--chat-format");
    t.bos = special_token_text(c, "bos_token");
    t.always_generation_prompt = !contains(text, "add_generation_prompt");
    return t;
  }
  throw usage_error("{}: its chat_template is neither Llama-3's (<|start_header_id|>) nor ChatML "
                    "(<|im_start|>), the formats trn builds in; pass --chat-format llama3 or --chat-format chatml "
                    "to use one",
                    where);
}

std::string format_chat(const ChatTemplate& t, const std::vector<ChatMessage>& messages, bool add_generation_prompt) {
  if (messages.empty()) throw usage_error("the conversation has no message: give --prompt, --system or --messages");
  for (const ChatMessage& m : messages)
    if (m.role != "system" && m.role != "user" && m.role != "assistant")
      throw usage_error("a chat message's role is '{}'; trn's chat formats take system, user and assistant", m.role);
  std::string out;
  if (t.format == ChatTemplate::Format::kLlama3) {
    for (size_t i = 0; i < messages.size(); ++i) {
      if (i == 0) out += t.bos;
      out += "<|start_header_id|>" + messages[i].role + "<|end_header_id|>\n\n";
      out += python_strip(messages[i].content);
      out += "<|eot_id|>";
    }
    if (add_generation_prompt || t.always_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
    return out;
  }
  // ChatML: the first message's system turn, or the default; every later message in order (a
  // later system message too).
  size_t first = 0;
  if (messages[0].role == "system") {
    out += "<|im_start|>system\n" + messages[0].content + "<|im_end|>\n";
    first = 1;
  } else if (!t.default_system.empty()) {
    out += "<|im_start|>system\n" + t.default_system + "<|im_end|>\n";
  }
  for (size_t i = first; i < messages.size(); ++i)
    out += "<|im_start|>" + messages[i].role + "\n" + messages[i].content + "<|im_end|>\n";
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

std::vector<ChatMessage> parse_chat_messages(std::string_view text, const std::string& where) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw usage_error("{}: not JSON: {}", where, e.what());
  }
  if (j.is_object() && j.contains("messages")) j = j["messages"];
  if (!j.is_array())
    throw usage_error("{}: expected a list of {{\"role\": ..., \"content\": ...}} messages (or an object holding it "
                      "as \"messages\")",
                      where);
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < j.size(); ++i) {
    const json& m = j[i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
        !m["content"].is_string())
      throw usage_error("{}: message {} is not {{\"role\": \"...\", \"content\": \"...\"}} with string values", where,
                        i);
    out.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
  }
  return out;
}

}  // namespace trn::data
