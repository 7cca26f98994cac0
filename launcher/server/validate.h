// Request checks shared by the registry: a bad request is answered with INVALID_ARGUMENT and a
// message that names the field and the allowed range, before anything changes.
#pragma once

#include <string>

#include "launcher/server/registry.h"

namespace trn::control {

Status validate_job_id(const std::string& job_id);
Status validate_key(const std::string& key, const Limits& limits);
Status validate_wait_ms(const char* what, int64_t ms, const Limits& limits);
Status validate_join(const v1::JoinRequest& req, const Limits& limits);

}  // namespace trn::control
