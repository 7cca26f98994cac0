// HOST:PORT, as every trn program takes it: trnctl and trnrun --coordinator, TRN_COORDINATOR,
// trn-coordinator --listen, --advertise, --metrics-listen and its etcd endpoints, and
// trn-coordbench --coordinator all go through this one parser, so they accept and refuse the
// same text with the same line.
//
// HOST is a name (letters, digits, '-' and '_', in dot-separated labels of at most 63
// characters, 253 in all), an IPv4 address in dotted-quad form, or an IPv6 address in brackets
// ("[::1]:7000", a zone allowed: "[fe80::1%eth0]:7000"). PORT is decimal digits only. A port
// outside the range is refused, never wrapped: gRPC would dial 99999 as 34463.
#pragma once

#include <string>
#include <vector>

namespace trn::control {

enum class PortUse {
  kDial,    // an address to connect to: a port in 1-65535
  kListen,  // an address to listen on: 0-65535 (0: any free port), and HOST may be empty (every interface)
};

struct HostPort {
  std::string host;  // without brackets; empty only for a kListen address
  int port = 0;
  bool ipv6 = false;  // host is an IPv6 address (written in brackets)

  // As written for gRPC and in messages: "host:port", "[v6]:port".
  std::string str() const;
};

// Why `text` is not a HOST:PORT for `use` ("port 99999 is out of range"), or "" when it is one.
std::string address_problem(const std::string& text, PortUse use);

// The one usage line for a bad address, naming `what` (a flag or an environment variable), the
// value, what is wrong and the valid form and range:
//   "--coordinator 127.0.0.1:99999: port 99999 is out of range; expected HOST:PORT with a port in
//    1-65535 (HOST: a name, an IPv4 address or [IPv6])"
HostPort parse_address(const std::string& text, const std::string& what, PortUse use = PortUse::kDial);

// "a:1, b:2" (a coordinator's replicas) -> each parsed with parse_address (kDial); a usage error
// naming `what` for an empty entry or a bad address.
std::vector<HostPort> parse_address_list(const std::string& list, const std::string& what);

}  // namespace trn::control
