#include "launcher/client/grpc_log.h"

#include <grpc/support/log.h>

#include <cstring>
#include <mutex>
#include <string_view>

#include "collectives/core/log.h"

namespace trn::control {

static void to_trn_log(gpr_log_func_args* a) {
  std::string_view m = a->message ? a->message : "";
  while (!m.empty() && (m.back() == '\n' || m.back() == '.')) m.remove_suffix(1);
  const bool handshake = m.find("andshake") != std::string_view::npos;
  if (a->severity == GPR_LOG_SEVERITY_ERROR && !handshake)
    log::warn(log::Subsys::kCoord, "gRPC: {} ({}:{})", m, a->file ? a->file : "?", a->line);
  else
    log::debug(log::Subsys::kCoord, "gRPC: {} ({}:{})", m, a->file ? a->file : "?", a->line);
}

void route_grpc_logs() {
  static std::once_flag once;
  std::call_once(once, [] { gpr_set_log_function(to_trn_log); });
}

}  // namespace trn::control
