#include "launcher/server/validate.h"

#include <fmt/format.h>

#include <cctype>

namespace trn::control {

static Status invalid(std::string m) { return Status::Make(Code::kInvalidArgument, std::move(m)); }

Status validate_job_id(const std::string& job_id) {
  if (job_id.empty()) return invalid("job_id is empty; give the job a name (e.g. --job-id my-run)");
  if (job_id.size() > 128) return invalid("job_id is longer than 128 characters");
  for (char c : job_id)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' || c == ':'))
      return invalid(fmt::format("job_id '{}' has a character other than letters, digits, '-', '_', "
                                 "'.' or ':'",
                                 job_id.size() > 64 ? job_id.substr(0, 64) + "..." : job_id));
  return Status::Ok();
}

Status validate_key(const std::string& key, const Limits& limits) {
  if (key.empty()) return invalid("key is empty");
  if (key.size() > limits.max_key_bytes)
    return invalid(fmt::format("key is {} bytes; the limit is {}", key.size(), limits.max_key_bytes));
  return Status::Ok();
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

}  // namespace trn::control
