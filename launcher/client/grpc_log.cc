#include "launcher/client/grpc_log.h"

#include <google/protobuf/stubs/logging.h>
#include <grpc/support/log.h>

#include <cstring>
#include <mutex>
#include <string_view>

#include "collectives/core/log.h"

namespace trn::control {

static void to_trn_log(gpr_log_func_args* a) {
  std::string_view m = a->message ? a->message : "";
  while (!m.empty() && (m.back() == '\n' || m.back() == '.')) m.remove_suffix(1);
  // A TLS failure (a handshake, or a peer refusing the certificate) is logged by gRPC on every
  // retry; the call's own error says it once.
  const bool handshake = m.find("andshake") != std::string_view::npos || m.find("SSL routines") != m.npos ||
                         m.find("TSI_") != m.npos || m.find("Corruption detected") != m.npos;
  if (a->severity == GPR_LOG_SEVERITY_ERROR && !handshake)
    log::warn(log::Subsys::kCoord, "gRPC: {} ({}:{})", m, a->file ? a->file : "?", a->line);
  else
    log::debug(log::Subsys::kCoord, "gRPC: {} ({}:{})", m, a->file ? a->file : "?", a->line);
}

// protobuf reports a message it refuses to parse (a string that is not UTF-8) through its log,
// once per message, before the caller sees the failure and answers it (gRPC with a status, the
// agent by dropping the datagram): at the debug level, so a client cannot fill the log.
static void protobuf_to_trn_log(google::protobuf::LogLevel level, const char* file, int line, const std::string& m) {
  std::string_view msg = m;
  while (!msg.empty() && (msg.back() == '\n' || msg.back() == ' ')) msg.remove_suffix(1);
  const bool refused_input = msg.find("parsing") != msg.npos || msg.find("UTF-8") != msg.npos;
  if (level == google::protobuf::LOGLEVEL_FATAL)
    log::error(log::Subsys::kCoord, "protobuf: {} ({}:{})", msg, file ? file : "?", line);
  else if (refused_input)
    log::debug(log::Subsys::kCoord, "protobuf: {} ({}:{})", msg, file ? file : "?", line);
  else
    log::warn(log::Subsys::kCoord, "protobuf: {} ({}:{})", msg, file ? file : "?", line);
}

void route_grpc_logs() {
  static std::once_flag once;
  std::call_once(once, [] {
    gpr_set_log_function(to_trn_log);
    google::protobuf::SetLogHandler(protobuf_to_trn_log);
  });
}

}  // namespace trn::control
