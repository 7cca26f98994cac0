// gRPC's own log lines (by default written to stderr in gRPC's format, outside trn's log), routed
// through trn's log once per process. A failed TLS handshake or a refused certificate, which gRPC
// reports as an error on every retry, goes to the debug level: the client diagnoses it itself
// (tls_probe.h, or the failed call's status) and says it in one line; every other gRPC error is
// a warning. protobuf's log goes the same way: its line for each message it refuses to parse (the
// caller refuses the message itself) at the debug level, any other line as a warning.
#pragma once

namespace trn::control {

void route_grpc_logs();

}  // namespace trn::control
