// connect(): provider choice, endpoints, the address exchange through the store, and a ring
// handshake that proves messages flow before anyone relies on them.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <dirent.h>
#include <poll.h>
#include <sched.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/sysinfo.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <utility>

#include "collectives/core/log.h"
#include "collectives/core/settings.h"
#include "collectives/fabric/endpoint.h"
#include "collectives/fabric/fabric.h"
#include "collectives/fabric/messages.h"
#include "collectives/fabric/rails.h"
#include "collectives/fabric/tag.h"
#include "collectives/fabric/transport.h"

namespace trn::fabric {
namespace {

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s.empty() ? "none" : s;
}

std::string hostname() {
  char buf[256] = {};
  gethostname(buf, sizeof(buf) - 1);
  return buf;
}

// Ranks share a host when they share a hostname and a kernel boot: shm works between them.
std::string host_id() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string boot;
  std::getline(f, boot);
  return hostname() + "/" + boot;
}

// TRN_FABRIC_IFACE must name an interface of this host (or one of its addresses); otherwise
// libfabric finds no tcp endpoint and the error would blame the provider.
void check_iface(const std::string& iface) {
  ifaddrs* list = nullptr;
  if (iface.empty() || getifaddrs(&list) != 0) return;
  std::vector<std::string> names, addrs;
  bool found = false;
  unsigned char want[sizeof(in6_addr)];
  const int family = inet_pton(AF_INET, iface.c_str(), want) == 1    ? AF_INET
                     : inet_pton(AF_INET6, iface.c_str(), want) == 1 ? AF_INET6
                                                                    : 0;
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (std::find(names.begin(), names.end(), i->ifa_name) == names.end()) names.push_back(i->ifa_name);
    found |= family == 0 && iface == i->ifa_name;
    if (!i->ifa_addr || (i->ifa_addr->sa_family != AF_INET && i->ifa_addr->sa_family != AF_INET6)) continue;
    const void* a = i->ifa_addr->sa_family == AF_INET
                        ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr)
                        : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr);
    char text[INET6_ADDRSTRLEN] = {};
    inet_ntop(i->ifa_addr->sa_family, a, text, sizeof(text));
    addrs.push_back(fmt::format("{} {}", i->ifa_name, text));
    found |= family == i->ifa_addr->sa_family &&
             std::memcmp(a, want, family == AF_INET ? sizeof(in_addr) : sizeof(in6_addr)) == 0;
  }
  freeifaddrs(list);
  if (found) return;
  if (family == 0)
    throw usage_error("TRN_FABRIC_IFACE={}: no network interface {} on this host (interfaces: {}); name one of "
                      "them or an address of one, or unset it", iface, iface, join(names));
  throw usage_error("TRN_FABRIC_IFACE={}: no interface of this host has that address (addresses: {}); name one "
                    "of them or an interface, or unset it", iface, join(addrs));
}

// libfabric's shm provider refuses to start when /dev/shm cannot hold its region: say so, with
// what it takes, instead of letting same-host ranks fall back to the network unannounced.
void warn_no_shm(const std::string& why, int ranks_here, const Options& o, const std::string& main) {
  constexpr uint64_t kProviderRegion = uint64_t{16} << 20;  // libfabric shm's region per rank, about
  const uint64_t rings = o.ring ? ranks_here * ring_footprint(ring_capacity_for(o.ring_eager)) : 0;
  struct statvfs st {};
  const bool known = statvfs("/dev/shm", &st) == 0;
  const auto mib = [](double b) { return fmt::format("{:.1f} MiB", b / (1 << 20)); };
  log::warn(log::Subsys::kFabric,
            "shared memory is unavailable ({}): the {} ranks on this host talk over {} instead, which is slower. "
            "Each needs about {} of /dev/shm ({} for libfabric's shm region{}), {} in all, and /dev/shm has {} "
            "free: give it more room (docker run --shm-size={}m){}, or set TRN_FABRIC_SHM=0 to use {} on purpose",
            why, ranks_here, main, mib(kProviderRegion + rings), mib(kProviderRegion),
            o.ring ? fmt::format(" and {} for trn's rings", mib(rings)) : "", mib(ranks_here * (kProviderRegion + rings)),
            known ? mib(static_cast<double>(st.f_bavail) * st.f_frsize) : "an unknown amount",
            (ranks_here * (kProviderRegion + rings) >> 20) + 64,
            o.ring ? ", set TRN_FABRIC_RING=0 to need less" : "", main);
}

InfoPtr select_main(const Options& o, int rank) {
  static const std::set<std::string> kChoices = {"auto", "efa", "tcp", "udp", "shm", "sockets"};
  if (!kChoices.count(o.provider))
    throw usage_error("TRN_FABRIC_PROVIDER={} is not one of auto, efa, tcp, udp, shm, sockets", o.provider);
  if (o.provider != "shm" && o.provider != "efa") check_iface(o.iface);  // the ip providers bind it
  std::string why;
  if (o.provider == "auto") {
    if (InfoPtr efa = query("efa", o.iface, &why)) return efa;
    InfoPtr tcp = query("tcp;ofi_rxm", o.iface, &why);
    if (!tcp)
      throw usage_error("no usable libfabric provider: neither efa nor tcp;ofi_rxm is present (available: {})",
                        join(available_providers()));
    if (rank == 0)
      log::warn(log::Subsys::kFabric,
                "NO EFA DEVICE FOUND: falling back to tcp;ofi_rxm, far slower than EFA. If this host "
                "should have EFA, check the efa driver and libfabric; set TRN_FABRIC_PROVIDER=tcp to "
                "choose TCP on purpose and silence this warning");
    return tcp;
  }
  InfoPtr info = query(libfabric_name(o.provider), o.iface, &why);
  if (!info)
    throw usage_error("TRN_FABRIC_PROVIDER={} but libfabric has no such provider with reliable tagged "
                      "messaging here{} ({}); available: {}",
                      o.provider, o.iface.empty() ? "" : " on " + o.iface, why, join(available_providers()));
  return info;
}

int read_int_file(const std::string& path) {
  std::ifstream f(path);
  int v = -1;
  if (!(f >> v)) return -1;
  return v;
}

// The NUMA node of a rail's device (an efa device or a network interface), -1 when sysfs does
// not say (virtual interfaces have no device).
int numa_of_rail(const std::string& name) {
  for (const char* dir : {"/sys/class/infiniband/", "/sys/class/net/"}) {
    const int n = read_int_file(std::string(dir) + name + "/device/numa_node");
    if (n >= 0) return n;
  }
  return -1;
}

// The NUMA node all of this process's CPUs are on, -1 when they span several or sysfs has none.
int numa_of_this_process() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return -1;
  int node = -1;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set)) continue;
    int found = -1;
    const std::string dir = fmt::format("/sys/devices/system/cpu/cpu{}", cpu);
    if (DIR* d = opendir(dir.c_str())) {
      while (dirent* e = readdir(d))
        if (std::strncmp(e->d_name, "node", 4) == 0 && std::isdigit(static_cast<unsigned char>(e->d_name[4])))
          found = std::atoi(e->d_name + 4);
      closedir(d);
    }
    if (found < 0 || (node >= 0 && found != node)) return -1;
    node = found;
  }
  return node;
}

// The rails TRN_FABRIC_RAILS names for the main provider prov: empty for one rail (the main
// endpoint as TRN_FABRIC_IFACE chose it).
std::vector<std::string> rail_names(const Options& o, const std::string& prov) {
  const std::string& spec = o.rails;
  if (spec.empty() || spec == "1") return {};
  if (!o.iface.empty())
    throw usage_error("TRN_FABRIC_IFACE={} and TRN_FABRIC_RAILS={} are both set: name the interfaces in "
                      "TRN_FABRIC_RAILS alone", o.iface, spec);
  std::vector<std::string> names;
  if (spec == "auto") {
    // Only efa's devices are known to be rails; an ip provider's interfaces may be anything.
    if (prov != "efa") return {};
    names = provider_domains(prov);
  } else if (spec.find_first_not_of("0123456789") == std::string::npos) {
    const auto all = provider_domains(prov);
    const size_t n = std::strtoul(spec.c_str(), nullptr, 10);
    if (n == 0 || n > all.size())
      throw usage_error("TRN_FABRIC_RAILS={}: {} has {} domain(s) here ({})", spec, prov, all.size(), join(all));
    names.assign(all.begin(), all.begin() + static_cast<long>(n));
  } else {
    for (size_t at = 0; at <= spec.size();) {
      const size_t comma = std::min(spec.find(',', at), spec.size());
      const std::string one = spec.substr(at, comma - at);
      if (one.empty()) throw usage_error("TRN_FABRIC_RAILS={}: an empty rail name", spec);
      if (std::find(names.begin(), names.end(), one) != names.end())
        throw usage_error("TRN_FABRIC_RAILS={}: rail {} is named twice", spec, one);
      names.push_back(one);
      at = comma + 1;
    }
  }
  if (names.size() > static_cast<size_t>(kMaxRails))
    throw usage_error("TRN_FABRIC_RAILS={}: {} rails, more than {}", spec, names.size(), kMaxRails);
  return names;
}

// Which rails reach other hosts: a connect to a peer's liveness port (peer_watch.h) on each
// rail's address, for the first rank of the next and the previous host, all at once, for at most
// kRailCheck. The kernel of a live host answers at once, so a connect left unanswered or refused
// means the rail is down between them. Bit r of the result is rail r; rail 0 is taken as up (the
// handshake runs on it). Ranks without rails, or without liveness sockets (efa), report all up.
constexpr auto kRailCheck = std::chrono::seconds(3);
uint32_t rails_reaching_others(int rank, const std::vector<AddressRecord>& all, size_t rails, int listen_fd,
                               std::string* why) {
  const uint32_t every = all_rails(rails);
  if (rails <= 1) return every;
  std::vector<int> hosts;  // the first rank of each host, in rank order
  for (int p = 0; p < static_cast<int>(all.size()); ++p) {
    bool first = true;
    for (int q = 0; q < p && first; ++q) first = all[q].host_id != all[p].host_id;
    if (first) hosts.push_back(p);
  }
  int mine = 0;
  while (all[hosts[mine]].host_id != all[rank].host_id) ++mine;
  std::vector<int> targets;
  for (int step : {1, -1}) {
    const int h = (mine + step + static_cast<int>(hosts.size())) % static_cast<int>(hosts.size());
    if (h != mine && std::find(targets.begin(), targets.end(), hosts[h]) == targets.end()) targets.push_back(hosts[h]);
  }
  struct Attempt {
    int fd, peer;
    size_t rail;
  };
  std::vector<Attempt> attempts;
  uint32_t up = every;
  for (int p : targets) {
    for (size_t r = 1; r < rails && r <= all[p].rails.size(); ++r) {
      sockaddr_storage a{};
      const socklen_t len = liveness_address(all[p].rails[r - 1], all[p].live, &a);
      if (len == 0) continue;  // no liveness socket: nothing to check with
      // From this rank's own address on the rail, so the connect takes that rail's interface.
      const int fd = rail_socket(all[rank].rails[r - 1]);
      if (fd < 0) continue;
      if (::connect(fd, reinterpret_cast<sockaddr*>(&a), len) != 0 && errno != EINPROGRESS) {
        if (up >> r & 1) *why = fmt::format("rail {}: connecting to rank {} (host {}) failed: {}", r, p, all[p].host,
                                            std::strerror(errno));
        up &= ~(uint32_t{1} << r);
        close(fd);
        continue;
      }
      attempts.push_back({fd, p, r});
    }
  }
  const auto until = Clock::now() + kRailCheck;
  // Peers' checks of this rank wait in its liveness socket's backlog: taken as they come, so it
  // never fills while everyone checks.
  const auto drain = [&] {
    while (listen_fd >= 0) {
      const int fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) break;
      close(fd);
    }
  };
  while (!attempts.empty()) {
    drain();
    std::vector<pollfd> fds;
    for (const auto& at : attempts) fds.push_back({at.fd, POLLOUT, 0});
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - Clock::now()).count();
    if (left <= 0) break;
    if (poll(fds.data(), fds.size(), static_cast<int>(std::min<int64_t>(left, 50))) < 0) break;
    for (size_t i = fds.size(); i-- > 0;) {
      if (!fds[i].revents) continue;
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(attempts[i].fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        if (up >> attempts[i].rail & 1)
          *why = fmt::format("rail {}: connecting to rank {} (host {}) failed: {}", attempts[i].rail, attempts[i].peer,
                             all[attempts[i].peer].host, std::strerror(err));
        up &= ~(uint32_t{1} << attempts[i].rail);
      }
      close(attempts[i].fd);
      attempts.erase(attempts.begin() + static_cast<long>(i));
    }
  }
  for (const auto& at : attempts) {  // no answer in time
    if (up >> at.rail & 1)
      *why = fmt::format("rail {}: rank {} (host {}) did not answer a connection on it within {} s", at.rail, at.peer,
                         all[at.peer].host, std::chrono::duration_cast<std::chrono::seconds>(kRailCheck).count());
    up &= ~(uint32_t{1} << at.rail);
    close(at.fd);
  }
  return up;
}

// Leaves out the rails that do not reach every host, by every rank alike: each says through the
// store which of its rails reach (rails_reaching_others), and all keep the rails every rank
// found up. Rewrites every rank's record as if it had only those (so own rails and addresses
// follow) and closes the endpoints of the others; returns the names of the rails kept (empty:
// rail 0 alone is left).
std::vector<std::string> agree_on_rails(Store& store, const Options& opts, int rank, Deadline deadline,
                                        int liveness_fd, const std::vector<std::string>& names,
                                        std::vector<AddressRecord>& all, std::vector<std::unique_ptr<Endpoint>>& rails) {
  const int size = static_cast<int>(all.size());
  std::string why;
  const uint32_t up_here = rails_reaching_others(rank, all, rails.size() + 1, liveness_fd, &why);
  if (!why.empty()) log::warn(log::Subsys::kFabric, "rank {}: {}", rank, why);
  store.set(opts.prefix + "/rails-up/" + std::to_string(rank), std::to_string(up_here));
  uint32_t up = up_here;
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    std::string v;
    try {
      v = store.get(opts.prefix + "/rails-up/" + std::to_string(p), deadline);
    } catch (const Error& e) {
      throw e.with_context(fmt::format("fabric connect (rank {} of {}) waiting for rank {}'s rails", rank, size, p));
    }
    uint32_t theirs = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), theirs);
    if (ec != std::errc() || end != v.data() + v.size())
      throw remote_error("fabric connect (rank {} of {}): rank {} published its rails as \"{}\"", rank, size, p, v);
    up &= theirs;
  }
  up |= 1;  // rail 0 carries the handshake: if it is down, connect fails there
  if (up == all_rails(rails.size() + 1)) return names;
  std::vector<std::unique_ptr<Endpoint>> kept;
  std::vector<std::string> kept_names{names[0]}, down;
  for (size_t r = 1; r <= rails.size(); ++r) {
    if (up >> r & 1) {
      kept.push_back(std::move(rails[r - 1]));
      kept_names.push_back(names[r]);
    } else {
      down.push_back(names[r]);
    }
  }
  for (auto& rec : all) {
    std::vector<std::string> addrs;
    std::vector<int> numa{rec.rail_numa.empty() ? -1 : rec.rail_numa[0]};
    for (size_t r = 1; r <= rec.rails.size(); ++r)
      if (up >> r & 1) {
        addrs.push_back(rec.rails[r - 1]);
        numa.push_back(r < rec.rail_numa.size() ? rec.rail_numa[r] : -1);
      }
    rec.rails = std::move(addrs);
    rec.rail_numa = std::move(numa);
    if (rec.rails.empty()) rec.rail_numa.clear();
  }
  if (rank == 0)
    log::warn(log::Subsys::kFabric, "rail(s) {} do not reach every host: this job runs on {} rail(s): {}", join(down),
              kept_names.size(), join(kept_names));
  rails = std::move(kept);
  return kept_names.size() > 1 ? kept_names : std::vector<std::string>{};
}

void handshake(Transport& t, Deadline deadline) {
  const int n = t.size(), r = t.rank();
  if (n == 1) return;
  int32_t out = r, in = -1;
  auto recv = t.post_control(false, (r + n - 1) % n, wire::control(wire::kHandshake), &in, sizeof(in));
  auto send = t.post_control(true, (r + 1) % n, wire::control(wire::kHandshake), &out, sizeof(out));
  send->wait(deadline);
  recv->wait(deadline);
  check_handshake(&in, recv->bytes(), (r + n - 1) % n);
}

// A value at a fixed address of this process that peers read (process_vm_readv) to learn whether
// they may read its memory: the pull path for long messages (ring_channel.h).
const uint64_t& pull_probe() {
  static const uint64_t probe = [] {
    std::random_device rd;
    return (uint64_t{rd()} << 32 | rd()) | 1;
  }();
  return probe;
}

// Whether this process may read process pid's memory, and why not. Reading the probe the peer
// published also proves that pid names the peer here (not a process of another pid namespace).
bool can_pull(int pid, uint64_t addr, uint64_t expect, std::string* why) {
  uint64_t got = 0;
  iovec local{&got, sizeof(got)};
  iovec remote{reinterpret_cast<void*>(addr), sizeof(got)};
  const ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
  if (n != static_cast<ssize_t>(sizeof(got))) {
    *why = n < 0 ? fmt::format("process_vm_readv: {}", std::strerror(errno)) : "process_vm_readv: short read";
    return false;
  }
  if (got != expect) {
    *why = fmt::format("pid {} is another process here (another pid namespace?)", pid);
    return false;
  }
  return true;
}

// trn's rings between the ranks of this host that reach each other through shm. Each such rank
// creates one segment with a ring per rank of the host and publishes its name (empty when rings
// are off or the segment could not be made: then its pairs keep to libfabric alone), maps its
// peers' segments, and unlinks its own once every peer using it has mapped it. With the segment
// go its pid and its pull probe: each rank checks which peers' memory it may read and says so
// when it reports its mappings, so a sender knows whether its receiver pulls.
std::vector<RingSegment> setup_rings(Store& store, const Options& opts, int rank,
                                     const std::vector<AddressRecord>& all, std::vector<Peer>& peers,
                                     Deadline deadline) {
  std::vector<int> local;  // the ranks on this host, this one included, in rank order
  size_t me = 0;
  bool any = false;
  for (int p = 0; p < static_cast<int>(all.size()); ++p) {
    if (all[p].host_id != all[rank].host_id) continue;
    if (p == rank) me = local.size();
    local.push_back(p);
    any |= p != rank && peers[p].ep->provider() == "shm";
  }
  if (!any) return {};
  RingSegment own;
  const size_t capacity = ring_capacity_for(opts.ring_eager);
  if (opts.ring) {
    try {
      own = RingSegment::create(local.size(), capacity);
    } catch (const Error& e) {
      log::warn(log::Subsys::kFabric, "{}; same-host peers use libfabric's shm alone", e.what());
    }
  }
  const std::string key = opts.prefix + "/ring/", mapped = opts.prefix + "/ring-mapped/";
  const RingOffer offer_mine{own.name(), capacity, getpid(), reinterpret_cast<uintptr_t>(&pull_probe()),
                             pull_probe()};
  store.set(key + std::to_string(rank), own.name().empty() ? "" : offer_mine.encode());
  std::vector<RingSegment> segments;
  std::vector<std::string> users;
  std::vector<int> mapped_peers;
  std::vector<int> pulls;  // the peers this rank reads long messages from
  struct ClosePidfds {  // until the Transport owns them
    std::vector<Peer>& peers;
    bool armed = true;
    ~ClosePidfds() {
      for (auto& p : peers)
        if (armed && p.ring.pidfd >= 0) close(std::exchange(p.ring.pidfd, -1));
    }
  } close_pidfds{peers};
  for (size_t i = 0; i < local.size(); ++i) {
    const int p = local[i];
    if (p == rank || peers[p].ep->provider() != "shm") continue;
    std::string value;
    try {
      value = store.get(key + std::to_string(p), deadline);
    } catch (const Error& e) {
      throw e.with_context(fmt::format("fabric connect (rank {}) waiting for rank {}'s ring segment", rank, p));
    }
    if (value.empty() || own.name().empty()) continue;
    RingOffer offer;
    try {
      offer = RingOffer::decode(value);
    } catch (const Error& e) {
      throw e.with_context(fmt::format("rank {} published its ring segment", p));
    }
    const size_t their_capacity = offer.capacity;
    const int pid = offer.pid;
    RingSegment theirs = RingSegment::open(offer.name, local.size(), their_capacity);
    peers[p].ring.on = true;
    peers[p].ring.out = RingWriter(theirs.ring(me), their_capacity);
    peers[p].ring.in = RingReader(own.ring(i), capacity);
    peers[p].ring.eager = std::min(opts.ring_eager, their_capacity / 4);
    peers[p].ring.pid = pid;
    if (opts.pull) {
      // The pidfd first: once the probe read succeeds, it refers to the peer's process.
      const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
      const int pidfd_errno = pidfd < 0 ? errno : 0;
      std::string why;
      if (can_pull(pid, offer.probe_addr, offer.probe, &why)) {
        peers[p].ring.pull_in = true;
        peers[p].ring.pidfd = pidfd;
        pulls.push_back(p);
        if (pidfd < 0)
          log::warn(log::Subsys::kFabric, "rank {} cannot watch rank {}'s process (pidfd_open: {}): if it dies, "
                    "operations with it fail only at their deadline", rank, p, std::strerror(pidfd_errno));
      } else {
        if (pidfd >= 0) close(pidfd);
        log::warn(log::Subsys::kFabric, "rank {} cannot read rank {}'s memory ({}): long messages from it take "
                  "libfabric's shm", rank, p, why);
      }
    }
    segments.push_back(std::move(theirs));
    users.push_back(mapped + std::to_string(p));
    mapped_peers.push_back(p);
  }
  if (own.name().empty()) return segments;
  store.set(mapped + std::to_string(rank), encode_pull_report(pulls));
  try {
    store.wait(users, deadline);
    for (int p : mapped_peers) {
      const std::string report = store.get(mapped + std::to_string(p), deadline);
      std::vector<int> readers;
      try {
        readers = decode_pull_report(report, static_cast<int>(all.size()));
      } catch (const Error& e) {
        throw e.with_context(fmt::format("rank {}'s report", p));
      }
      peers[p].ring.pull_out = std::find(readers.begin(), readers.end(), rank) != readers.end();
    }
  } catch (const Error& e) {
    throw e.with_context(fmt::format("fabric connect (rank {}) waiting for same-host ranks to map its rings", rank));
  }
  own.unlink();  // a rank killed from here on leaves nothing behind in /dev/shm
  close_pidfds.armed = false;
  segments.push_back(std::move(own));
  return segments;
}

}  // namespace

std::vector<std::string> available_providers() {
  set_provider_defaults();
  InfoPtr hints(fi_allocinfo());
  hints->caps = FI_TAGGED | FI_MSG;
  hints->ep_attr->type = FI_EP_RDM;
  fi_info* list = nullptr;
  std::set<std::string> names;
  if (fi_getinfo(FI_VERSION(1, 14), nullptr, nullptr, 0, hints.get(), &list) == 0) {
    for (fi_info* i = list; i; i = i->next) names.insert(i->fabric_attr->prov_name);
    fi_freeinfo(list);
  }
  return {names.begin(), names.end()};
}

Options Options::from_environment() {
  Options o;
  o.provider = settings::get("TRN_FABRIC_PROVIDER");
  if (!settings::get("TRN_FABRIC_SHM").empty()) o.shm = settings::get_bool("TRN_FABRIC_SHM") ? 1 : 0;
  o.iface = settings::get("TRN_FABRIC_IFACE");
  o.rails = settings::get("TRN_FABRIC_RAILS");
  o.stripe_min = static_cast<size_t>(settings::get_int("TRN_FABRIC_STRIPE_MIN"));
  o.connect_timeout = default_timeout();
  o.prefix = "fabric/g" + std::to_string(settings::get_int("TRN_GENERATION"));
  // Ranges are checked where the settings are registered (core/settings.cc).
  const double spin_us = settings::get_double("TRN_FABRIC_SPIN_US");
  o.spin = std::chrono::nanoseconds(static_cast<int64_t>(spin_us * 1000));
  o.spin_auto = !settings::is_set("TRN_FABRIC_SPIN_US");
  const double yield_us = settings::get_double("TRN_FABRIC_YIELD_US");
  o.yield = std::chrono::nanoseconds(static_cast<int64_t>(yield_us * 1000));
  o.ring = settings::get_bool("TRN_FABRIC_RING");
  static_assert(kRingMaxEager == 1 << 20, "TRN_FABRIC_RING_EAGER's range in core/settings.cc");
  o.ring_eager = static_cast<size_t>(settings::get_int("TRN_FABRIC_RING_EAGER"));
  o.pull = settings::get_bool("TRN_FABRIC_PULL");
  o.force_mr_local = settings::get_bool("TRN_FABRIC_MR_LOCAL");
  return o;
}

std::shared_ptr<PointToPoint> connect(Store& store, int rank, int size, const Options& options) {
  Options opts = options;
  if (size < 1) throw usage_error("fabric: world size {} must be at least 1", size);
  if (rank < 0 || rank >= size) throw usage_error("fabric: rank {} is outside the world of size {}", rank, size);
  const Deadline deadline = Deadline::after(opts.connect_timeout);

  InfoPtr main_info = select_main(opts, rank);
  const std::string prov = main_info->fabric_attr->prov_name;
  const std::vector<std::string> rail_list = rail_names(opts, prov);
  std::vector<InfoPtr> rail_infos;
  for (const std::string& name : rail_list) {
    std::string why;
    InfoPtr info = query(prov, "", &why, name);
    if (!info)
      throw usage_error("TRN_FABRIC_RAILS={}: {} has no rail {} here ({})", opts.rails, prov, name, why);
    rail_infos.push_back(std::move(info));
  }
  if (!rail_infos.empty()) main_info = std::move(rail_infos.front());
  auto main = std::make_unique<Endpoint>(std::move(main_info), opts.force_mr_local, size);
  std::vector<std::unique_ptr<Endpoint>> rails;  // rails 1..
  for (size_t r = 1; r < rail_infos.size(); ++r)
    rails.push_back(std::make_unique<Endpoint>(std::move(rail_infos[r]), opts.force_mr_local, size));
  std::unique_ptr<Endpoint> shm;
  std::string shm_missing;  // why there is no shm endpoint though one was wanted
  if (opts.shm != 0 && main->provider() != "shm" && size > 1) {
    std::string why;
    InfoPtr info = query("shm", "", &why);
    if (!info) shm_missing = why;
    if (info) {
      try {
        shm = std::make_unique<Endpoint>(std::move(info), opts.force_mr_local, size);
      } catch (const Error& e) {
        if (opts.shm == 1) throw e.with_context("TRN_FABRIC_SHM=1 but the shm endpoint did not open");
        log::warn(log::Subsys::kFabric, "shm endpoint did not open ({}); same-host peers use {}", e.what(),
                  main->provider());
      }
    } else if (opts.shm == 1) {
      throw usage_error("TRN_FABRIC_SHM=1 but libfabric has no shm provider here ({}); available: {}; "
                        "set TRN_FABRIC_SHM=0", why, join(available_providers()));
    }
  }

  Liveness liveness = open_liveness(main->address(), !rails.empty());
  struct CloseLiveness {  // until the Transport owns it
    int& fd;
    ~CloseLiveness() {
      if (fd >= 0) close(fd);
    }
  } close_liveness{liveness.fd};
  AddressRecord mine;
  mine.host = hostname();
  mine.host_id = host_id();
  mine.provider = main->provider();
  mine.main = main->address();
  mine.shm = shm ? shm->address() : "";
  mine.framing = main->framing();
  mine.live = liveness.port;
  if (!rails.empty()) {
    bool stripes = main->cq_data();
    mine.rail_numa.push_back(numa_of_rail(rail_list[0]));
    for (size_t r = 0; r < rails.size(); ++r) {
      mine.rails.push_back(rails[r]->address());
      mine.rail_numa.push_back(numa_of_rail(rail_list[r + 1]));
      stripes = stripes && rails[r]->cq_data();
    }
    mine.numa = numa_of_this_process();
    mine.stripes = stripes;
  }
  const std::string key = opts.prefix + "/addr/";
  store.set(key + std::to_string(rank), mine.encode());
  std::vector<AddressRecord> all(size);
  for (int p = 0; p < size; ++p) {
    std::string record;
    try {
      if (p != rank) record = store.get(key + std::to_string(p), deadline);
    } catch (const Error& e) {
      throw e.with_context(fmt::format("fabric connect (rank {} of {}) waiting for rank {}'s address", rank, size, p));
    }
    try {
      all[p] = p == rank ? mine : AddressRecord::decode(record);
    } catch (const Error& e) {
      throw e.with_context(fmt::format("fabric connect (rank {} of {}): rank {}'s address", rank, size, p));
    }
    if (all[p].provider != mine.provider)
      throw usage_error("rank {} uses fabric provider {} but rank {} uses {}: set TRN_FABRIC_PROVIDER to the "
                        "same value on every rank", p, all[p].provider, rank, mine.provider);
    if (all[p].framing != mine.framing)  // differing libfabric builds or registration settings
      throw usage_error("rank {} frames {} messages as \"{}\" but rank {} as \"{}\": run the same libfabric and "
                        "trn settings on every rank", p, mine.provider, all[p].framing, rank, mine.framing);
    if (all[p].rails.size() != mine.rails.size())
      throw usage_error("rank {} has {} fabric rail(s) but rank {} has {}: set TRN_FABRIC_RAILS to as many rails "
                        "on every rank", p, all[p].rails.size() + 1, rank, mine.rails.size() + 1);
  }

  const std::vector<std::string> rail_used =
      rails.empty() ? rail_list : agree_on_rails(store, opts, rank, deadline, liveness.fd, rail_list, all, rails);
  mine = all[rank];

  std::vector<Peer> peers(size);
  const auto insert = [&](Endpoint& ep, int p, const std::string& raw) {
    try {
      return ep.insert(raw);
    } catch (const Error& e) {
      throw e.with_context(fmt::format("fabric connect (rank {} of {}): rank {}'s address", rank, size, p));
    }
  };
  int local = 0;
  for (int p = 0; p < size; ++p) {
    const bool same_host = all[p].host_id == mine.host_id;
    if (mine.provider == "shm" && !same_host)
      throw usage_error("the shm provider reaches only this host, but rank {} is on {}: use "
                        "TRN_FABRIC_PROVIDER=auto, tcp or udp across hosts", p, all[p].host);
    peers[p].host = all[p].host;
    while (all[peers[p].host_index].host_id != all[p].host_id) ++peers[p].host_index;  // its host's lowest rank
    if (p != rank) peers[p].watch.live_len = liveness_address(all[p].main, all[p].live, &peers[p].watch.live_addr);
    local += same_host && p != rank;
    const bool via_shm = shm && !all[p].shm.empty() && same_host;
    peers[p].ep = via_shm ? shm.get() : main.get();
    peers[p].addr = insert(*peers[p].ep, p, via_shm ? all[p].shm : all[p].main);
    // Every rank's own rail, from what all published (rails.h): its position among the ranks
    // of its host on its NUMA node.
    int position = 0;
    for (int q = 0; q < p; ++q) position += all[q].host_id == all[p].host_id && all[q].numa == all[p].numa;
    peers[p].rail.own_rail = all[p].rails.empty() ? 0 : choose_own_rail(position, all[p].rail_numa, all[p].numa);
    if (!all[p].rails.empty()) peers[p].rail.near_rails = near_rails(all[p].rail_numa, all[p].numa);
    peers[p].rail.stripes = all[p].stripes;
  }
  // The rails' addresses of the ranks on other hosts (same-host peers keep to shm and the rings,
  // or to rail 0).
  for (int p = 0; p < size && !rails.empty(); ++p) {
    if (p == rank || peers[p].ep != main.get()) continue;
    peers[p].rail.addr.push_back(peers[p].addr);
    for (size_t r = 0; r < rails.size(); ++r) {
      peers[p].rail.addr.push_back(insert(*rails[r], p, all[p].rails[r]));
      WatchPeer::RailProbe probe;
      probe.len = liveness_address(all[p].rails[r], all[p].live, &probe.addr);
      peers[p].watch.rail_probes.push_back(probe);
    }
  }
  if (shm && local == 0) {  // no peer shares this host: shm would sit idle
    for (auto& p : peers)
      if (p.ep == shm.get()) p.ep = nullptr;
    shm.reset();
    for (int p = 0; p < size; ++p)
      if (!peers[p].ep) {
        peers[p].ep = main.get();
        peers[p].addr = insert(*main, p, all[p].main);
      }
  }

  if (local > 0 && !shm_missing.empty()) {
    bool first_here = true;  // one warning per host: from its lowest rank
    for (int p = 0; p < rank; ++p) first_here &= all[p].host_id != mine.host_id;
    if (first_here) warn_no_shm(shm_missing, local + 1, opts, main->provider());
  }
  if (opts.spin_auto && local + 1 > get_nprocs()) {
    opts.spin = Duration::zero();
    log::debug(log::Subsys::kFabric, "{} ranks share this host's {} processors: waits yield without spinning",
               local + 1, get_nprocs());
  }
  std::vector<RingSegment> segments = setup_rings(store, opts, rank, all, peers, deadline);
  auto t = std::make_shared<Transport>(rank, size, opts, std::move(main), std::move(shm), std::move(peers),
                                       std::move(segments), std::exchange(liveness, Liveness{}), std::move(rails));
  try {
    handshake(*t, deadline);
  } catch (const Error& e) {
    throw e.with_context(fmt::format("fabric connect (rank {} of {}, {})", rank, size, t->describe()));
  }
  log::info(log::Subsys::kFabric, "fabric up: {}", t->describe());
  return t;
}

}  // namespace trn::fabric
