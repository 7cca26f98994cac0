#include "launcher/server/validate.h"

#include <fmt/format.h>

#include <cctype>

namespace trn::control {

static Status invalid(std::string m) { return Status::Make(Code::kInvalidArgument, std::move(m)); }

// A name from a request, fit for a one-line message: at most 64 characters, each byte outside
// printable ASCII as \xNN.
static std::string shown(const std::string& name) {
  std::string out;
  for (size_t i = 0; i < name.size() && i < 64; ++i) {
    const auto c = static_cast<unsigned char>(name[i]);
    if (c >= 0x20 && c < 0x7f) out.push_back(static_cast<char>(c));
    else out += fmt::format("\\x{:02x}", c);
  }
  return name.size() > 64 ? out + "..." : out;
}

std::string one_line(std::string text) {
  for (char& c : text)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = ' ';
  return text;
}

Status validate_text(const char* what, std::string_view text) {
  for (size_t i = 0; i < text.size(); ++i)
    if (const auto c = static_cast<unsigned char>(text[i]); c < 0x20 || c == 0x7f)
      return invalid(fmt::format("{} has a control character (byte 0x{:02x} at offset {}); it must be text", what,
                                 c, i));
  return Status::Ok();
}

Status validate_job_id(const std::string& job_id) {
  if (job_id.empty()) return invalid("job_id is empty; give the job a name (e.g. --job-id my-run)");
  if (job_id.size() > 128) return invalid("job_id is longer than 128 characters");
  for (char c : job_id)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' || c == ':'))
      return invalid(fmt::format("job_id '{}' has a character other than letters, digits, '-', '_', "
                                 "'.' or ':'",
                                 shown(job_id)));
  return Status::Ok();
}

Status validate_key(const std::string& key, const Limits& limits) {
  if (key.empty()) return invalid("key is empty");
  if (key.size() > limits.max_key_bytes)
    return invalid(fmt::format("key is {} bytes; the limit is {}", key.size(), limits.max_key_bytes));
  return validate_text("key", key);
}

Status validate_wait_ms(const char* what, int64_t ms, const Limits& limits) {
  if (ms < 0 || ms > limits.max_wait_ms)
    return invalid(fmt::format("{} {} ms is out of range (0..{} ms)", what, ms, limits.max_wait_ms));
  return Status::Ok();
}

Status validate_join(const v1::JoinRequest& req, const Limits& limits) {
  if (auto s = validate_job_id(req.job_id()); !s.ok()) return s;
  if (req.node_id().empty() || req.node_id().size() > 256)
    return invalid("node_id must have 1 to 256 characters");
  if (req.host().size() > 256) return invalid("host is longer than 256 characters");
  if (auto s = validate_text("node_id", req.node_id()); !s.ok()) return s;
  if (auto s = validate_text("host", req.host()); !s.ok()) return s;
  if (req.nproc_per_node() < 1 || req.nproc_per_node() > limits.max_nproc)
    return invalid(fmt::format("nproc_per_node {} is out of range (1..{})", req.nproc_per_node(),
                               limits.max_nproc));
  if (req.min_nodes() < 1 || req.min_nodes() > limits.max_nodes)
    return invalid(fmt::format("min_nodes {} is out of range (1..{})", req.min_nodes(), limits.max_nodes));
  if (req.max_nodes() < req.min_nodes() || req.max_nodes() > limits.max_nodes)
    return invalid(fmt::format("max_nodes {} is out of range ({}..{}): it must be at least min_nodes",
                               req.max_nodes(), req.min_nodes(), limits.max_nodes));
  if (req.settle_ms() < 0 || req.settle_ms() > 600000)
    return invalid(fmt::format("settle_ms {} is out of range (0..600000)", req.settle_ms()));
  return validate_wait_ms("join timeout", req.timeout_ms(), limits);
}

Status validate_saved_job(const v1::Snapshot::Job& j, const Limits& limits) {
  if (auto s = validate_job_id(j.job_id()); !s.ok()) return s;
  if (j.generation() < 0 || j.restarts() < 0)
    return invalid(fmt::format("generation {} and restarts {} must not be negative", j.generation(), j.restarts()));
  if (j.min_nodes() < 0 || j.max_nodes() < 0 || j.min_nodes() > limits.max_nodes || j.max_nodes() > limits.max_nodes)
    return invalid(fmt::format("min_nodes {} and max_nodes {} must lie in 0..{}", j.min_nodes(), j.max_nodes(),
                               limits.max_nodes));
  if (j.members_size() > limits.max_nodes)
    return invalid(fmt::format("it has {} members; the limit is {}", j.members_size(), limits.max_nodes));
  // Members are saved in node-rank order, their ranks back to back.
  int64_t offset = 0;
  for (int i = 0; i < j.members_size(); ++i) {
    const v1::Member& m = j.members(i);
    if (m.node_rank() != i || m.nproc() < 1 || m.nproc() > limits.max_nproc || m.rank_offset() != offset ||
        m.node_id().empty() || m.node_id().size() > 256 || m.host().size() > 256)
      return invalid(fmt::format("members[{}] is not node rank {} with 1..{} processes from rank {}", i, i,
                                 limits.max_nproc, offset));
    offset += m.nproc();
  }
  for (int f : j.finished_nodes())
    if (f < 0 || f >= j.members_size())
      return invalid(fmt::format("finished node {} is not one of its {} members", f, j.members_size()));
  if (j.last_member_ids_size() > limits.max_nodes)
    return invalid(fmt::format("it names {} last members; the limit is {}", j.last_member_ids_size(), limits.max_nodes));
  if (static_cast<size_t>(j.kv_size()) > limits.max_keys_per_job)
    return invalid(fmt::format("it has {} keys; the limit is {}", j.kv_size(), limits.max_keys_per_job));
  size_t kv_bytes = 0;
  for (const auto& kv : j.kv()) {
    if (auto s = validate_key(kv.key(), limits); !s.ok()) return s;
    if (kv.value().size() > limits.max_value_bytes)
      return invalid(fmt::format("the value of a key is {} bytes; the limit is {}", kv.value().size(),
                                 limits.max_value_bytes));
    kv_bytes += kv.key().size() + kv.value().size();
  }
  if (kv_bytes > limits.max_kv_bytes_per_job)
    return invalid(fmt::format("its keys hold {} bytes; the limit is {}", kv_bytes, limits.max_kv_bytes_per_job));
  for (const auto& c : j.checkpoints())
    if (c.step() < 0) return invalid(fmt::format("a checkpoint has step {}", c.step()));
  // The token nonce: none, or 32 bytes in hex (Registry::ensure_token).
  const std::string& n = j.token_nonce();
  if (!n.empty() && (n.size() != 64 || n.find_first_not_of("0123456789abcdef") != std::string::npos))
    return invalid("its token nonce is not 64 hex digits");
  return Status::Ok();
}

}  // namespace trn::control
