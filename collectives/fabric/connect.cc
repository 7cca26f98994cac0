// connect(): owned setup phases in libfabric's order (getinfo, the endpoints, the address
// exchange through the store, av_insert, the rings; Setup below), then a ring handshake that
// proves messages flow before anyone relies on them. The rails' and the rings' agreement with
// the other ranks are in setup_rails.cc and setup_rings.cc.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/statvfs.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <set>
#include <utility>

#include "collectives/core/log.h"
#include "collectives/core/settings.h"
#include "collectives/fabric/endpoint.h"
#include "collectives/fabric/fabric.h"
#include "collectives/fabric/messages.h"
#include "collectives/fabric/rails.h"
#include "collectives/fabric/setup.h"
#include "collectives/fabric/tag.h"
#include "collectives/fabric/transport.h"

namespace trn::fabric {

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s.empty() ? "none" : s;
}

namespace {

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

namespace {

// What connect() builds, phase by phase in libfabric's order (getinfo; each endpoint's fabric,
// domain, cq, av, endpoint, bind, enable and name: endpoint.h; the address exchange; av_insert;
// the rings). Each phase's product is owned here, so that when a later phase throws, what the
// earlier ones opened closes in reverse.
struct Setup {
  Setup(const Options& o, int r, int s) : opts(o), rank(r), size(s), deadline(Deadline::after(o.connect_timeout)) {}
  ~Setup() {
    if (liveness.fd >= 0) close(liveness.fd);
  }
  Setup(const Setup&) = delete;
  Setup& operator=(const Setup&) = delete;

  Options opts;
  const int rank, size;
  const Deadline deadline;
  // getinfo
  std::vector<std::string> rail_list;  // TRN_FABRIC_RAILS's names (empty: one rail)
  InfoPtr main_info;
  std::vector<InfoPtr> rail_infos;
  // the endpoints
  std::unique_ptr<Endpoint> main;
  std::vector<std::unique_ptr<Endpoint>> rails;  // rails 1..
  std::unique_ptr<Endpoint> shm;
  std::string shm_missing;  // why there is no shm endpoint though one was wanted
  // the address exchange
  Liveness liveness;  // until the Transport owns it
  std::vector<AddressRecord> all;
  // av_insert: what this rank knows of every rank
  std::vector<Peer> peers;
  int local = 0;  // other ranks on this host
};

// getinfo: the main provider, and one fi_info per rail.
void getinfo_phase(Setup& s) {
  s.main_info = select_main(s.opts, s.rank);
  const std::string prov = s.main_info->fabric_attr->prov_name;
  s.rail_list = rail_names(s.opts, prov);
  for (const std::string& name : s.rail_list) {
    std::string why;
    InfoPtr info = query(prov, "", &why, name);
    if (!info) throw usage_error("TRN_FABRIC_RAILS={}: {} has no rail {} here ({})", s.opts.rails, prov, name, why);
    s.rail_infos.push_back(std::move(info));
  }
  if (!s.rail_infos.empty()) s.main_info = std::move(s.rail_infos.front());
}

// The shm endpoint, where one is wanted: a missing or failing one is an error only under
// TRN_FABRIC_SHM=1.
void open_shm(Setup& s) {
  const Options& opts = s.opts;
  if (opts.shm == 0 || s.main->provider() == "shm" || s.size <= 1) return;
  std::string why;
  InfoPtr info = query("shm", "", &why);
  if (!info) {
    if (opts.shm == 1)
      throw usage_error("TRN_FABRIC_SHM=1 but libfabric has no shm provider here ({}); available: {}; "
                        "set TRN_FABRIC_SHM=0", why, join(available_providers()));
    s.shm_missing = why;
    return;
  }
  try {
    s.shm = std::make_unique<Endpoint>(std::move(info), opts.force_mr_local, s.size);
  } catch (const Error& e) {
    if (opts.shm == 1) throw e.with_context("TRN_FABRIC_SHM=1 but the shm endpoint did not open");
    log::warn(log::Subsys::kFabric, "shm endpoint did not open ({}); same-host peers use {}", e.what(),
              s.main->provider());
  }
}

// Each endpoint opens in libfabric's order (endpoint.h).
void open_endpoints(Setup& s) {
  s.main = std::make_unique<Endpoint>(std::move(s.main_info), s.opts.force_mr_local, s.size);
  for (size_t r = 1; r < s.rail_infos.size(); ++r)
    s.rails.push_back(std::make_unique<Endpoint>(std::move(s.rail_infos[r]), s.opts.force_mr_local, s.size));
  open_shm(s);
}

// What this rank publishes: its host, its endpoints' names (fi_getname), its liveness port and
// its rails.
AddressRecord own_record(Setup& s) {
  s.liveness = open_liveness(s.main->address(), !s.rails.empty());
  AddressRecord mine;
  mine.host = hostname();
  mine.host_id = host_id();
  mine.provider = s.main->provider();
  mine.main = s.main->address();
  mine.shm = s.shm ? s.shm->address() : "";
  mine.framing = s.main->framing();
  mine.live = s.liveness.port;
  mine.cpus = cpus_of_this_process();
  if (!s.rails.empty()) {
    bool stripes = s.main->cq_data();
    mine.rail_numa.push_back(numa_of_rail(s.rail_list[0]));
    for (size_t r = 0; r < s.rails.size(); ++r) {
      mine.rails.push_back(s.rails[r]->address());
      mine.rail_numa.push_back(numa_of_rail(s.rail_list[r + 1]));
      stripes = stripes && s.rails[r]->cq_data();
    }
    mine.numa = numa_of_this_process();
    mine.stripes = stripes;
  }
  return mine;
}

// Rank p's record, which must agree with this rank's on what every rank must share.
AddressRecord read_record(Store& store, const Setup& s, int p, const AddressRecord& mine) {
  std::string record;
  try {
    record = store.get(s.opts.prefix + "/addr/" + std::to_string(p), s.deadline);
  } catch (const Error& e) {
    throw e.with_context(fmt::format("fabric connect (rank {} of {}) waiting for rank {}'s address", s.rank, s.size, p));
  }
  AddressRecord theirs;
  try {
    theirs = AddressRecord::decode(record);
  } catch (const Error& e) {
    throw e.with_context(fmt::format("fabric connect (rank {} of {}): rank {}'s address", s.rank, s.size, p));
  }
  if (theirs.provider != mine.provider)
    throw usage_error("rank {} uses fabric provider {} but rank {} uses {}: set TRN_FABRIC_PROVIDER to the "
                      "same value on every rank", p, theirs.provider, s.rank, mine.provider);
  if (theirs.framing != mine.framing)  // differing libfabric builds or registration settings
    throw usage_error("rank {} frames {} messages as \"{}\" but rank {} as \"{}\": run the same libfabric and "
                      "trn settings on every rank", p, mine.provider, theirs.framing, s.rank, mine.framing);
  if (theirs.rails.size() != mine.rails.size())
    throw usage_error("rank {} has {} fabric rail(s) but rank {} has {}: set TRN_FABRIC_RAILS to as many rails "
                      "on every rank", p, theirs.rails.size() + 1, s.rank, mine.rails.size() + 1);
  return theirs;
}

// The address exchange: publish this rank's record, read every other's, agree on the rails.
void exchange_addresses(Store& store, Setup& s) {
  const AddressRecord mine = own_record(s);
  store.set(s.opts.prefix + "/addr/" + std::to_string(s.rank), mine.encode());
  s.all.resize(s.size);
  for (int p = 0; p < s.size; ++p) s.all[p] = p == s.rank ? mine : read_record(store, s, p, mine);
  if (!s.rails.empty())
    agree_on_rails(store, s.opts, s.rank, s.deadline, s.liveness.fd, s.rail_list, s.all, s.rails);
}

fi_addr_t insert(const Setup& s, Endpoint& ep, int p, const std::string& raw) {
  try {
    return ep.insert(raw);
  } catch (const Error& e) {
    throw e.with_context(fmt::format("fabric connect (rank {} of {}): rank {}'s address", s.rank, s.size, p));
  }
}

// Rank p's host, endpoint and address (av_insert), rails and liveness address.
void insert_peer(Setup& s, int p) {
  const AddressRecord& mine = s.all[s.rank];
  const std::vector<AddressRecord>& all = s.all;
  Peer& peer = s.peers[p];
  const bool same_host = all[p].host_id == mine.host_id;
  if (mine.provider == "shm" && !same_host)
    throw usage_error("the shm provider reaches only this host, but rank {} is on {}: use "
                      "TRN_FABRIC_PROVIDER=auto, tcp or udp across hosts", p, all[p].host);
  peer.host = all[p].host;
  while (all[peer.host_index].host_id != all[p].host_id) ++peer.host_index;  // its host's lowest rank
  if (p != s.rank) peer.watch.live_len = liveness_address(all[p].main, all[p].live, &peer.watch.live_addr);
  s.local += same_host && p != s.rank;
  const bool via_shm = s.shm && !all[p].shm.empty() && same_host;
  peer.ep = via_shm ? s.shm.get() : s.main.get();
  peer.addr = insert(s, *peer.ep, p, via_shm ? all[p].shm : all[p].main);
  // Every rank's own rail, from what all published (rails.h): its position among the ranks of
  // its host on its NUMA node.
  int position = 0;
  for (int q = 0; q < p; ++q) position += all[q].host_id == all[p].host_id && all[q].numa == all[p].numa;
  peer.rail.own_rail = all[p].rails.empty() ? 0 : choose_own_rail(position, all[p].rail_numa, all[p].numa);
  if (!all[p].rails.empty()) peer.rail.near_rails = near_rails(all[p].rail_numa, all[p].numa);
  peer.rail.stripes = all[p].stripes;
}

// av_insert for every rank: its endpoint's address, and on other hosts its rails' (same-host
// peers keep to shm and the rings, or to rail 0).
void insert_peers(Setup& s) {
  s.peers.resize(s.size);
  for (int p = 0; p < s.size; ++p) insert_peer(s, p);
  for (int p = 0; p < s.size && !s.rails.empty(); ++p) {
    Peer& peer = s.peers[p];
    if (p == s.rank || peer.ep != s.main.get()) continue;
    peer.rail.addr.push_back(peer.addr);
    for (size_t r = 0; r < s.rails.size(); ++r) {
      peer.rail.addr.push_back(insert(s, *s.rails[r], p, s.all[p].rails[r]));
      WatchPeer::RailProbe probe;
      probe.len = liveness_address(s.all[p].rails[r], s.all[p].live, &probe.addr);
      peer.watch.rail_probes.push_back(probe);
    }
  }
  if (s.shm && s.local == 0) {  // no peer shares this host: shm would sit idle
    for (auto& peer : s.peers)
      if (peer.ep == s.shm.get()) peer.ep = nullptr;
    s.shm.reset();
    for (int p = 0; p < s.size; ++p)
      if (!s.peers[p].ep) {
        s.peers[p].ep = s.main.get();
        s.peers[p].addr = insert(s, *s.main, p, s.all[p].main);
      }
  }
}

// How many CPUs the ranks of this host may run on together: the union of their affinity masks
// (as trnrun --bind, mpirun, taskset or a cpuset left them). 0 when a rank's record does not say.
int cpus_of_host(const Setup& s) {
  std::string all;
  for (const AddressRecord& r : s.all) {
    if (r.host_id != s.all[s.rank].host_id) continue;
    if (r.cpus.empty()) return 0;
    if (all.size() < r.cpus.size()) all.resize(r.cpus.size(), '\0');
    for (size_t i = 0; i < r.cpus.size(); ++i) all[i] = static_cast<char>(all[i] | r.cpus[i]);
  }
  int n = 0;
  for (char c : all) n += __builtin_popcount(static_cast<unsigned char>(c));
  return n;
}

// What this host's ranks sharing it means: a warning when shm is missing, no spin when there are
// more ranks than the CPUs they may run on. Those are the union of the ranks' affinity masks,
// not the machine's processors: ranks confined to one core (taskset, a cpuset) must not spin,
// while ranks bound each to its own core may, though no single mask holds them all.
void fit_to_host(Setup& s) {
  if (s.local > 0 && !s.shm_missing.empty()) {
    bool first_here = true;  // one warning per host: from its lowest rank
    for (int p = 0; p < s.rank; ++p) first_here &= s.all[p].host_id != s.all[s.rank].host_id;
    if (first_here) warn_no_shm(s.shm_missing, s.local + 1, s.opts, s.main->provider());
  }
  const int known = cpus_of_host(s), cpus = known > 0 ? known : get_nprocs();
  if (s.opts.spin_auto && s.local + 1 > cpus) {
    s.opts.spin = Duration::zero();
    log::debug(log::Subsys::kFabric, "{} ranks share {} CPUs on this host: waits yield without spinning",
               s.local + 1, cpus);
  }
}

}  // namespace

std::shared_ptr<PointToPoint> connect(Store& store, int rank, int size, const Options& options) {
  if (size < 1) throw usage_error("fabric: world size {} must be at least 1", size);
  if (rank < 0 || rank >= size) throw usage_error("fabric: rank {} is outside the world of size {}", rank, size);
  Setup s(options, rank, size);
  getinfo_phase(s);
  open_endpoints(s);
  exchange_addresses(store, s);
  insert_peers(s);
  fit_to_host(s);
  std::vector<RingSegment> segments = setup_rings(store, s.opts, rank, s.all, s.peers, s.deadline);
  auto t = std::make_shared<Transport>(rank, size, s.opts, std::move(s.main), std::move(s.shm), std::move(s.peers),
                                       std::move(segments), std::exchange(s.liveness, Liveness{}), std::move(s.rails));
  try {
    handshake(*t, s.deadline);
  } catch (const Error& e) {
    throw e.with_context(fmt::format("fabric connect (rank {} of {}, {})", rank, size, t->describe()));
  }
  log::info(log::Subsys::kFabric, "fabric up: {}", t->describe());
  return t;
}

}  // namespace trn::fabric
