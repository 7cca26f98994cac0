// connect()'s rail phases (setup.h): which rails exist, where they sit, and which of them reach
// every host.
#include <dirent.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "collectives/core/log.h"
#include "collectives/fabric/rails.h"
#include "collectives/fabric/setup.h"

namespace trn::fabric {
namespace {

int read_int_file(const std::string& path) {
  std::ifstream f(path);
  int v = -1;
  if (!(f >> v)) return -1;
  return v;
}

}  // namespace

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

std::string cpus_of_this_process() {
  cpu_set_t set;
  CPU_ZERO(&set);
  // A machine of more than CPU_SETSIZE processors refuses this size (EINVAL): "", not known.
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return "";
  std::string mask(CPU_SETSIZE / 8, '\0');
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &set)) mask[cpu / 8] = static_cast<char>(mask[cpu / 8] | 1 << (cpu % 8));
  while (!mask.empty() && mask.back() == '\0') mask.pop_back();
  return mask;
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

namespace {

// Which rails reach other hosts: a connect to a peer's liveness port (peer_watch.h) on each
// rail's address, for the first rank of the next and the previous host, all at once, for at most
// kRailCheck. The kernel of a live host answers at once, so a connect left unanswered or refused
// means the rail is down between them. Bit r of the result is rail r; rail 0 is taken as up (the
// handshake runs on it). Ranks without rails, or without liveness sockets (efa), report all up.
constexpr auto kRailCheck = std::chrono::seconds(3);

struct RailAttempt {
  int fd, peer;
  size_t rail;
};

// The first rank of the next and of the previous host.
std::vector<int> rail_check_targets(int rank, const std::vector<AddressRecord>& all) {
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
  return targets;
}

// Starts a connect on each rail 1.. to each target; one that fails at once clears its rail in *up.
std::vector<RailAttempt> start_rail_checks(int rank, const std::vector<AddressRecord>& all, size_t rails,
                                           uint32_t* up, std::string* why) {
  std::vector<RailAttempt> attempts;
  for (int p : rail_check_targets(rank, all)) {
    for (size_t r = 1; r < rails && r <= all[p].rails.size(); ++r) {
      sockaddr_storage a{};
      const socklen_t len = liveness_address(all[p].rails[r - 1], all[p].live, &a);
      if (len == 0) continue;  // no liveness socket: nothing to check with
      // From this rank's own address on the rail, so the connect takes that rail's interface.
      const int fd = rail_socket(all[rank].rails[r - 1]);
      if (fd < 0) continue;
      if (::connect(fd, reinterpret_cast<sockaddr*>(&a), len) != 0 && errno != EINPROGRESS) {
        if (*up >> r & 1) *why = fmt::format("rail {}: connecting to rank {} (host {}) failed: {}", r, p, all[p].host,
                                             std::strerror(errno));
        *up &= ~(uint32_t{1} << r);
        close(fd);
        continue;
      }
      attempts.push_back({fd, p, r});
    }
  }
  return attempts;
}

// Waits up to kRailCheck for the attempts' answers; a refused or unanswered one clears its rail.
void await_rail_checks(std::vector<RailAttempt> attempts, const std::vector<AddressRecord>& all, int listen_fd,
                       uint32_t* up, std::string* why) {
  const auto until = Clock::now() + kRailCheck;
  while (!attempts.empty()) {
    // Peers' checks of this rank wait in its liveness socket's backlog: taken as they come, so
    // it never fills while everyone checks.
    while (listen_fd >= 0) {
      const int fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) break;
      close(fd);
    }
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
      const RailAttempt& at = attempts[i];
      if (err != 0) {
        if (*up >> at.rail & 1)
          *why = fmt::format("rail {}: connecting to rank {} (host {}) failed: {}", at.rail, at.peer,
                             all[at.peer].host, std::strerror(err));
        *up &= ~(uint32_t{1} << at.rail);
      }
      close(at.fd);
      attempts.erase(attempts.begin() + static_cast<long>(i));
    }
  }
  for (const auto& at : attempts) {  // no answer in time
    if (*up >> at.rail & 1)
      *why = fmt::format("rail {}: rank {} (host {}) did not answer a connection on it within {} s", at.rail, at.peer,
                         all[at.peer].host, std::chrono::duration_cast<std::chrono::seconds>(kRailCheck).count());
    *up &= ~(uint32_t{1} << at.rail);
    close(at.fd);
  }
}

uint32_t rails_reaching_others(int rank, const std::vector<AddressRecord>& all, size_t rails, int listen_fd,
                               std::string* why) {
  uint32_t up = all_rails(rails);
  if (rails <= 1) return up;
  await_rail_checks(start_rail_checks(rank, all, rails, &up, why), all, listen_fd, &up, why);
  return up;
}

}  // namespace

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


}  // namespace trn::fabric
