// Request checks shared by the registry: a bad request is answered with INVALID_ARGUMENT and a
// message that names the field and the allowed range, before anything changes.
#pragma once

#include <string>
#include <string_view>

#include "launcher/server/registry.h"

namespace trn::control {

Status validate_job_id(const std::string& job_id);
// text with every control character (newlines, tabs, ...) replaced by a space: what a caller sent
// that other callers' one-line messages will quote.
std::string one_line(std::string text);
// INVALID_ARGUMENT naming `what` when text has a control character: names, keys and hosts are
// quoted in other callers' one-line messages, events and logs.
Status validate_text(const char* what, std::string_view text);
Status validate_key(const std::string& key, const Limits& limits);
Status validate_wait_ms(const char* what, int64_t ms, const Limits& limits);
Status validate_join(const v1::JoinRequest& req, const Limits& limits);
// A job as a state log or etcd holds it (save_job): what Registry::restore relies on. The bytes
// are checksummed, but a file trn did not write, or an etcd another program wrote, gets here too.
Status validate_saved_job(const v1::Snapshot::Job& job, const Limits& limits);

}  // namespace trn::control
