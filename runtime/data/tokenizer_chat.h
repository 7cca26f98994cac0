// Chat prompts: a conversation (system, user and assistant messages) as the text an instruct
// model was trained on, in the two formats trn builds in, without a template engine:
//   llama3  Meta's Llama-3-Instruct: bos_token, then per message
//           "<|start_header_id|>ROLE<|end_header_id|>\n\n" + trim(content) + "<|eot_id|>";
//           the generation prompt is the assistant's header.
//   chatml  Qwen2/2.5's ChatML: per message "<|im_start|>ROLE\n" + content + "<|im_end|>\n",
//           a default system message first when the conversation has none (Qwen2.5's "You are
//           Qwen, created by Alibaba Cloud. ..." as its template writes it; none when the
//           template has none); the generation prompt is "<|im_start|>assistant\n".
// The text equals what transformers' apply_chat_template(messages, tokenize=False,
// add_generation_prompt=...) renders from the real tokenizer_config.json's chat_template
// (tests/reference/chat_template.py checks it with jinja2 on the real files).
//
// Which format, and its details, come from tokenizer_config.json's chat_template text: one
// naming <|im_start|> is chatml, one naming <|start_header_id|> is llama3. Templates that add
// more than these (Llama-3.1's dates and tools, reasoning blocks) are refused rather than
// formatted differently from Hugging Face.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace trn::data {

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

struct ChatTemplate {
  enum class Format { kLlama3, kChatml };
  Format format = Format::kChatml;
  std::string bos;             // llama3: tokenizer_config.json's bos_token, before the first message
  std::string default_system;  // chatml: the system message of a conversation without one ("": none)
  // Meta's first Llama-3-Instruct template ends with the assistant's header whatever
  // add_generation_prompt says; its later revision (and every chatml one) only when it is set.
  bool always_generation_prompt = false;
  std::string end_of_turn;  // the token that ends a message: <|eot_id|>, <|im_end|>
  std::string name() const { return format == Format::kLlama3 ? "llama3" : "chatml"; }
};

// The format named by `name` ("llama3" or "chatml"), with Meta's and Qwen2.5's details; a usage
// error naming `flag` for any other name.
ChatTemplate chat_template_named(const std::string& name, const std::string& flag);

// The format of a tokenizer_config.json (its text; `where` names it in errors): read from its
// chat_template and bos_token. A usage error, one line, when it has no chat_template or one that
// is neither format.
ChatTemplate chat_template_of_config(std::string_view config_text, const std::string& where);

// The conversation as text; add_generation_prompt: ending with the assistant's header, for the
// model to write the reply. A usage error for an empty conversation or a role other than
// system, user and assistant.
std::string format_chat(const ChatTemplate& t, const std::vector<ChatMessage>& messages, bool add_generation_prompt);

// A JSON messages file (its text): a list of {"role": ..., "content": "..."} objects, or an
// object holding that list as "messages" (as chat datasets and OpenAI-style requests write it).
// Usage errors, one line naming `where` and the message, for anything else.
std::vector<ChatMessage> parse_chat_messages(std::string_view text, const std::string& where);

// Python's str.strip() (jinja2's trim): s without leading and trailing Unicode white space.
std::string python_strip(std::string_view s);

}  // namespace trn::data
