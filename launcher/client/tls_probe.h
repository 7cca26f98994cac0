// Why a coordinator's TLS refuses a client, found by making the handshake the client's channel
// makes, with OpenSSL directly. gRPC answers every such failure with the same UNAVAILABLE ("tcp
// handshaker shutdown") that a coordinator restarting gives, so the client would retry it until
// its deadline (a join's is minutes); the client asks this once such an answer comes, and a
// reason ends the call at once as a usage error, in one line.
#pragma once

#include <string>

#include "collectives/core/deadline.h"
#include "launcher/client/coordinator_client.h"

namespace trn::control {

// The reason no retry can fix: the coordinator's certificate does not verify against the CA (or
// does not name `address`), the coordinator speaks no TLS to a TLS client, requires a client
// certificate the client lacks, or does not accept the one it has, or serves TLS to a plaintext
// client. "" when the handshake succeeds, or the coordinator cannot be reached at all (it may be
// starting), so the caller retries as before. Waits at most about `timeout`.
std::string diagnose_tls(const std::string& address, const ClientOptions& options, Duration timeout);

}  // namespace trn::control
