#include "collectives/fabric/messages.h"

#include <algorithm>
#include <charconv>
#include <cstring>

#include "collectives/core/error.h"
#include "collectives/fabric/shm_ring.h"

namespace trn::fabric {
namespace {

// A value for an error message: at most 64 bytes of it, control characters as '?'.
std::string shown(std::string_view v) {
  std::string s(v.substr(0, 64));
  for (char& c : s)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  return v.size() > 64 ? s + "..." : s;
}

std::string hex(std::string_view raw) {
  static const char* d = "0123456789abcdef";
  std::string s;
  s.reserve(2 * raw.size());
  for (unsigned char c : raw) s += {d[c >> 4], d[c & 15]};
  return s;
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string unhex(std::string_view key, std::string_view h) {
  std::string raw;
  bool ok = h.size() % 2 == 0;
  for (size_t i = 0; ok && i < h.size(); i += 2) {
    const int hi = hex_digit(h[i]), lo = hex_digit(h[i + 1]);
    ok = hi >= 0 && lo >= 0;
    raw += static_cast<char>(hi << 4 | lo);
  }
  if (!ok) throw remote_error("a malformed fabric address record: {}={} is not hex bytes", key, shown(h));
  return raw;
}

// A whole decimal (base 10) or hex (base 16) number, nothing else.
template <typename T>
bool number(std::string_view s, T* out, int base = 10) {
  if (s.empty() || s[0] == '-' || s[0] == '+') return false;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *out, base);
  return ec == std::errc() && end == s.data() + s.size();
}

// s split at single spaces.
std::vector<std::string_view> words(std::string_view s) {
  std::vector<std::string_view> w;
  for (;;) {
    const size_t at = s.find(' ');
    w.push_back(s.substr(0, at));
    if (at == std::string_view::npos) return w;
    s.remove_prefix(at + 1);
  }
}

}  // namespace

std::string AddressRecord::encode() const {
  std::string r = fmt::format("host={}\nid={}\nprov={}\nmain={}\nshm={}\nframing={}\nlive={}\n", host,
                               host_id, provider, hex(main), hex(shm), framing, live);
  if (!cpus.empty()) r += "cpus=" + hex(cpus) + "\n";
  if (rails.empty() && rail_numa.empty() && numa == -1 && !stripes) return r;  // one rail: as before rails
  std::string list;
  for (const auto& a : rails) {
    if (!list.empty()) list += ',';
    list += hex(a);
  }
  std::string nodes;
  for (int n : rail_numa) nodes += fmt::format("{}{}", nodes.empty() ? "" : ",", n);
  return r + fmt::format("rails={}\nrailnuma={}\nnuma={}\nstripes={}\n", list, nodes, numa, stripes ? 1 : 0);
}

AddressRecord AddressRecord::decode(std::string_view s) {
  AddressRecord r;
  while (!s.empty()) {
    const size_t nl = s.find('\n');
    const std::string_view line = s.substr(0, nl);
    s.remove_prefix(nl == std::string_view::npos ? s.size() : nl + 1);
    const size_t eq = line.find('=');
    if (eq == std::string_view::npos) continue;
    const std::string_view k = line.substr(0, eq), v = line.substr(eq + 1);
    if (k == "host")
      r.host = v;
    else if (k == "id")
      r.host_id = v;
    else if (k == "prov")
      r.provider = v;
    else if (k == "main")
      r.main = unhex(k, v);
    else if (k == "shm")
      r.shm = unhex(k, v);
    else if (k == "framing")
      r.framing = v;
    else if (k == "cpus") {
      r.cpus = unhex(k, v);
      if (r.cpus.size() > kMaxCpuBytes)
        throw remote_error("a malformed fabric address record: cpus= holds {} bytes, more than {}", r.cpus.size(),
                           kMaxCpuBytes);
    }
    else if (k == "live" && !(number(v, &r.live) && r.live <= 65535))
      throw remote_error("a malformed fabric address record: live={} is not a port number", shown(v));
    else if (k == "rails") {
      r.rails.clear();
      std::string_view rest = v;
      while (!rest.empty()) {
        const size_t comma = rest.find(',');
        r.rails.push_back(unhex(k, rest.substr(0, comma)));
        rest.remove_prefix(comma == std::string_view::npos ? rest.size() : comma + 1);
        if (comma != std::string_view::npos && rest.empty()) r.rails.push_back(unhex(k, rest));
      }
      for (const auto& a : r.rails)
        if (a.empty()) throw remote_error("a malformed fabric address record: rails={} has an empty address", shown(v));
      if (r.rails.size() + 1 > static_cast<size_t>(kMaxRails))
        throw remote_error("a malformed fabric address record: {} rails, more than {}", r.rails.size() + 1, kMaxRails);
    } else if (k == "railnuma" || k == "numa") {
      std::vector<int> nodes;
      std::string_view rest = v;
      for (bool more = !rest.empty(); more;) {
        const size_t comma = rest.find(',');
        const std::string_view one = rest.substr(0, comma);
        int n = -1;
        if (one != "-1" && !(number(one, &n) && n < 4096))
          throw remote_error("a malformed fabric address record: {}={} is not NUMA nodes", k, shown(v));
        nodes.push_back(n);
        more = comma != std::string_view::npos;
        rest.remove_prefix(more ? comma + 1 : rest.size());
        if (nodes.size() > static_cast<size_t>(kMaxRails))
          throw remote_error("a malformed fabric address record: {}={} lists too many", k, shown(v));
      }
      if (k == "numa") {
        if (nodes.size() != 1) throw remote_error("a malformed fabric address record: numa={} is not one node", shown(v));
        r.numa = nodes[0];
      } else {
        r.rail_numa = nodes;
      }
    } else if (k == "stripes") {
      if (v != "0" && v != "1") throw remote_error("a malformed fabric address record: stripes={} is not 0 or 1", shown(v));
      r.stripes = v == "1";
    }
  }
  if (!r.rails.empty() && r.rail_numa.size() != r.rails.size() + 1)
    throw remote_error("a malformed fabric address record: {} rails but {} NUMA nodes for them", r.rails.size() + 1,
                       r.rail_numa.size());
  return r;
}

std::string RingOffer::encode() const {
  return fmt::format("{} {} {} {:x} {:x}", name, capacity, pid, probe_addr, probe);
}

RingOffer RingOffer::decode(std::string_view s) {
  const auto w = words(s);
  RingOffer o;
  const bool ok = w.size() == 5 && number(w[1], &o.capacity) && number(w[2], &o.pid) &&
                  number(w[3], &o.probe_addr, 16) && number(w[4], &o.probe, 16);
  if (!ok)
    throw remote_error(
        "a malformed ring segment \"{}\": not \"<name> <capacity> <pid> <probe address> <probe>\"", shown(s));
  o.name = w[0];
  constexpr std::string_view kPrefix = "/trn-ring.";
  if (o.name.size() > 255 || o.name.rfind(kPrefix, 0) != 0 || o.name.find('/', 1) != std::string::npos ||
      o.name.find('\0') != std::string::npos)
    throw remote_error("a ring segment named \"{}\", not /trn-ring.*", shown(o.name));
  if (o.capacity < 4096 || o.capacity > ring_capacity_for(kRingMaxEager) || (o.capacity & (o.capacity - 1)))
    throw remote_error("a ring segment of {}-byte rings, not a power of two from 4096 to {}", o.capacity,
                       ring_capacity_for(kRingMaxEager));
  if (o.pid <= 0) throw remote_error("a ring segment of pid {}", o.pid);
  return o;
}

std::string encode_pull_report(const std::vector<int>& ranks) {
  std::string s = "pull";
  for (int r : ranks) s += fmt::format(" {}", r);
  return s;
}

std::vector<int> decode_pull_report(std::string_view s, int size) {
  const auto w = words(s);
  if (w[0] != "pull") throw remote_error("a malformed ring report \"{}\": not \"pull <rank>...\"", shown(s));
  std::vector<int> ranks;
  for (size_t i = 1; i < w.size(); ++i) {
    int r = -1;
    if (!number(w[i], &r) || r >= size || std::find(ranks.begin(), ranks.end(), r) != ranks.end())
      throw remote_error("a malformed ring report \"{}\": \"{}\" is not a new rank of a world of {}",
                         shown(s), shown(w[i]), size);
    ranks.push_back(r);
  }
  return ranks;
}

void check_handshake(const void* data, size_t bytes, int expected) {
  int32_t in = -1;
  if (bytes != sizeof(in))
    throw remote_error("fabric handshake: expected rank {} but heard {} bytes, not a 4-byte rank", expected,
                       bytes);
  std::memcpy(&in, data, sizeof(in));
  if (in != expected)
    throw remote_error("fabric handshake: expected rank {} but heard from rank {}", expected, in);
}

std::string encode_notice(int lost, std::string_view detail) {
  std::string text = fmt::format("L{} {}", lost, detail);
  text.resize(std::min(text.size(), kNoticeBytes));
  return text;
}

Notice decode_notice(std::string_view msg, int size) {
  Notice n;
  const char* end = msg.data() + msg.size();
  const char* at = msg.size() > 1 && msg[0] == 'L' && msg[1] >= '0' && msg[1] <= '9' ? msg.data() + 1 : end;
  const auto [after, ec] = std::from_chars(at, end, n.lost);
  if (at == end || ec != std::errc() || (after != end && *after != ' ') || msg.size() > kNoticeBytes)
    throw remote_error("a malformed loss notice \"{}\" ({} bytes): not \"L<rank> <what happened>\"",
                       shown(msg), msg.size());
  if (n.lost >= size)
    throw remote_error("a loss notice of rank {}, not a rank of a world of {}", n.lost, size);
  n.detail.assign(after == end ? end : after + 1, end);
  for (char& c : n.detail)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = ' ';
  return n;
}

}  // namespace trn::fabric
