#include "launcher/client/address.h"

#include <arpa/inet.h>
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <string_view>

#include "collectives/core/error.h"

namespace trn::control {
namespace {

bool alnum_or(const std::string& s, const char* allowed_punct) {
  for (unsigned char c : s)
    if (!std::isalnum(c) && std::string_view(allowed_punct).find(static_cast<char>(c)) == std::string_view::npos)
      return false;
  return true;
}

// Why `port` (the text after the last ':') is no port for `use`; "" when it is one.
std::string port_problem(const std::string& port, PortUse use, int* out) {
  if (port.empty()) return "no port after ':'";
  if (port.find_first_not_of("0123456789") != std::string::npos) return fmt::format("port '{}' is not a number", port);
  const size_t first = std::min(port.find_first_not_of('0'), port.size());
  const std::string digits = port.substr(first);  // no leading zeros; "" for 0
  const long value = digits.size() > 5 ? 100000 : digits.empty() ? 0 : std::stol(digits);
  if (value > 65535 || (value == 0 && use == PortUse::kDial)) return fmt::format("port {} is out of range", port);
  *out = static_cast<int>(value);
  return "";
}

// Why `host` (brackets removed) is not an IPv6 address, optionally with a %zone; "" when it is.
std::string ipv6_problem(const std::string& host) {
  const size_t pct = host.find('%');
  const std::string addr = host.substr(0, pct);
  in6_addr a;
  if (::inet_pton(AF_INET6, addr.c_str(), &a) != 1) return fmt::format("[{}] is not an IPv6 address", host);
  if (pct != std::string::npos && (pct + 1 == host.size() || !alnum_or(host.substr(pct + 1), "._-")))
    return fmt::format("[{}] has an empty or malformed zone after '%'", host);
  return "";
}

// Why `host` is neither an IPv4 address nor a host name; "" when it is one. A host of digits and
// dots only is read as IPv4 (no top-level domain is all digits), so "10.0.0.256" is refused
// rather than looked up as a name.
std::string name_problem(const std::string& host) {
  if (host.find_first_not_of("0123456789.") == std::string::npos) {
    in_addr a;
    return ::inet_pton(AF_INET, host.c_str(), &a) == 1 ? "" : fmt::format("{} is not an IPv4 address", host);
  }
  std::string name = host;
  if (!name.empty() && name.back() == '.') name.pop_back();  // a fully qualified "host.example."
  if (name.empty() || name.size() > 253) return fmt::format("'{}' is not a host name", host);
  for (size_t start = 0; start <= name.size();) {
    size_t dot = name.find('.', start);
    if (dot == std::string::npos) dot = name.size();
    const std::string label = name.substr(start, dot - start);
    if (label.empty() || label.size() > 63 || !alnum_or(label, "-_") || label.front() == '-' || label.back() == '-')
      return fmt::format("'{}' is not a host name (letters, digits, '-' and '_' in dot-separated labels)", host);
    start = dot + 1;
  }
  return "";
}

// Why text is not a HOST:PORT for `use` ("" when it is one); *hp holds what was read.
std::string split(const std::string& text, PortUse use, HostPort* hp) {
  if (text.find("://") != std::string::npos) return "a URL; give HOST:PORT, without a scheme";
  size_t colon;
  std::string why;
  if (!text.empty() && text.front() == '[') {
    const size_t close = text.find(']');
    if (close == std::string::npos) return "'[' without ']'";
    hp->host = text.substr(1, close - 1);
    hp->ipv6 = true;
    if (close + 1 >= text.size() || text[close + 1] != ':') return "no :PORT after the ']'";
    colon = close + 1;
    why = ipv6_problem(hp->host);
  } else {
    colon = text.rfind(':');
    if (colon == std::string::npos) return "no :PORT";
    hp->host = text.substr(0, colon);
    if (hp->host.find(':') != std::string::npos) return "an IPv6 host goes in brackets ([ADDR]:PORT)";
    if (hp->host.empty() && use == PortUse::kDial) return "no host before ':'";
    if (!hp->host.empty()) why = name_problem(hp->host);
  }
  return why.empty() ? port_problem(text.substr(colon + 1), use, &hp->port) : why;
}

}  // namespace

std::string HostPort::str() const { return ipv6 ? fmt::format("[{}]:{}", host, port) : fmt::format("{}:{}", host, port); }

std::string address_problem(const std::string& text, PortUse use) {
  HostPort hp;
  return split(text, use, &hp);
}

HostPort parse_address(const std::string& text, const std::string& what, PortUse use) {
  HostPort hp;
  const std::string why = split(text, use, &hp);
  if (!why.empty())
    throw usage_error("{} {}: {}; expected HOST:PORT with a port in {}-65535 (HOST: a name, an IPv4 address or "
                      "[IPv6]{})",
                      what, text, why, use == PortUse::kDial ? 1 : 0,
                      use == PortUse::kListen ? ", empty for every interface" : "");
  return hp;
}

std::vector<HostPort> parse_address_list(const std::string& list, const std::string& what) {
  std::vector<HostPort> out;
  size_t start = 0;
  for (;;) {
    const size_t comma = list.find(',', start);
    std::string a = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    while (!a.empty() && std::isspace(static_cast<unsigned char>(a.back()))) a.pop_back();
    while (!a.empty() && std::isspace(static_cast<unsigned char>(a.front()))) a.erase(a.begin());
    if (a.empty())
      throw usage_error("{} '{}': an empty address; expected HOST:PORT[,HOST:PORT...] with ports in 1-65535", what,
                        list);
    out.push_back(parse_address(a, what, PortUse::kDial));
    if (comma == std::string::npos) return out;
    start = comma + 1;
  }
}

}  // namespace trn::control
