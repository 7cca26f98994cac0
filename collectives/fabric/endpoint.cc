#include "collectives/fabric/endpoint.h"

#include <dirent.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "collectives/fabric/shm_ring.h"

namespace trn::fabric {
namespace {

// The shm provider names its shared-memory region after the process id unless told otherwise.
// A process killed with SIGKILL leaves that region in /dev/shm, and a later process that gets the
// same pid then fails fi_enable with EBUSY. trn names the region "trn_<pid>_<nonce>_<n>" instead,
// and removes what dead processes left (remove_stale_shm_files, shm_ring.h) before it creates its own.
constexpr const char* kShmPrefix = "trn_";

std::string unique_shm_name() {
  static std::atomic<int> counter{0};
  remove_stale_shm_files();
  const auto nonce = std::chrono::steady_clock::now().time_since_epoch().count() & 0xffffff;
  return fmt::format("{}{}_{:x}_{}", kShmPrefix, getpid(), nonce, counter++);
}

bool looks_like_address(const std::string& s) {
  return !s.empty() && s.find_first_not_of("0123456789.:abcdefABCDEF") == std::string::npos &&
         (s.find('.') != std::string::npos || s.find(':') != std::string::npos);
}

// A domain of the provider by name: a tcp/udp interface (eth1) or a device (efa's "rdmap16s27"
// names its domain "rdmap16s27-rdm").
bool domain_is(const char* d, const std::string& name) {
  if (!d) return false;
  const std::string dom = d;
  return dom == name || dom == name + "-rdm" || dom == name + "-dgrm";
}

InfoPtr getinfo(const std::string& prov, const std::string& iface, bool ordered, int* rc_out, std::string* why,
                const std::string& domain = "") {
  InfoPtr hints(fi_allocinfo());
  hints->caps = FI_TAGGED | FI_MSG | FI_DIRECTED_RECV;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->ep_attr->type = FI_EP_RDM;
  hints->domain_attr->av_type = FI_AV_TABLE;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;  // trn serialises every call (transport.h)
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
  if (ordered) {
    hints->tx_attr->msg_order = FI_ORDER_SAS;
    hints->rx_attr->msg_order = FI_ORDER_SAS;
  }
  hints->fabric_attr->prov_name = strdup(prov.c_str());
  const char* node = nullptr;
  uint64_t flags = 0;
  bool ip_provider = prov.rfind("tcp", 0) == 0 || prov.rfind("udp", 0) == 0 || prov == "sockets";
  if (ip_provider && !iface.empty()) {
    if (looks_like_address(iface)) {
      node = iface.c_str();
      flags = FI_SOURCE;
    }
  }
  fi_info* list = nullptr;
  *rc_out = fi_getinfo(FI_VERSION(1, 14), node, nullptr, flags, hints.get(), &list);
  if (*rc_out != 0) return nullptr;
  InfoPtr all(list);
  const std::string& want = domain.empty() ? iface : domain;
  if (domain.empty() && (!ip_provider || iface.empty() || node)) return all;
  // An interface or device name: pick the entry whose domain it names (layered providers ignore
  // a domain name in the hints).
  std::string domains;
  for (fi_info* i = list; i; i = i->next) {
    const char* d = i->domain_attr->name;
    if (domain_is(d, want)) {
      fi_info* next = i->next;
      i->next = nullptr;
      InfoPtr one(fi_dupinfo(i));
      i->next = next;
      return one;
    }
    if (d && domains.find(d) == std::string::npos) domains += std::string(domains.empty() ? "" : ", ") + d;
  }
  *rc_out = -FI_ENODATA;
  *why = fmt::format("no {} {} ({}: {})", ip_provider ? "interface" : "device", want,
                     ip_provider ? "interfaces" : "devices", domains);
  return nullptr;
}

}  // namespace

std::string libfabric_name(const std::string& choice) {
  if (choice == "tcp") return "tcp;ofi_rxm";
  if (choice == "udp") return "udp;ofi_rxd";
  return choice;
}

void set_provider_defaults() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Unexpected eager messages over tcp land in buffers rxm allocates per message, so a larger
    // limit costs memory only for messages that actually arrive early.
    // 512 KiB, plus room for the padding of a two-rank world (endpoint.h).
    if (!std::getenv("FI_OFI_RXM_EAGER_LIMIT")) setenv("FI_OFI_RXM_EAGER_LIMIT", "524352", 0);
    // But rxm also posts this many receive buffers of that size on each new connection, growing
    // its pool 32 buffers (16 MiB) at a time and touching every page: with its default of 128,
    // four growths stall the first collectives over a connection
    // (bench/results/2026-11-30-rxm-receive-buffers.md). Buffers beyond these come from the pool
    // when messages arrive early.
    if (!std::getenv("FI_OFI_RXM_MSG_RX_SIZE")) setenv("FI_OFI_RXM_MSG_RX_SIZE", "16", 0);
  });
}

InfoPtr query(const std::string& prov, const std::string& iface, std::string* why, const std::string& domain) {
  set_provider_defaults();
  int rc = 0;
  std::string detail;
  InfoPtr info = getinfo(prov, iface, /*ordered=*/true, &rc, &detail, domain);
  if (!info) info = getinfo(prov, iface, /*ordered=*/false, &rc, &detail, domain);
  if (!info && why) *why = detail.empty() ? fi_strerror(-rc) : detail;
  return info;
}

std::vector<std::string> provider_domains(const std::string& prov) {
  set_provider_defaults();
  int rc = 0;
  std::string why;
  InfoPtr all = getinfo(prov, "", /*ordered=*/false, &rc, &why);
  std::vector<std::string> out;
  for (fi_info* i = all.get(); i; i = i->next) {
    const char* d = i->domain_attr->name;
    if (!d || std::string(d) == "lo") continue;
    std::string name = d;
    for (const char* suffix : {"-rdm", "-dgrm"})
      if (name.size() > std::strlen(suffix) && name.compare(name.size() - std::strlen(suffix), std::string::npos, suffix) == 0)
        name.resize(name.size() - std::strlen(suffix));
    if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  }
  return out;
}

namespace {

void check(const std::string& provider, int rc, const char* what) {
  if (rc) throw internal_error("{} {} failed: {} ({})", provider, what, fi_strerror(-rc), rc);
}

// The setup phases, in libfabric's order; each returns what it opened, owned.
FidPtr<fid_fabric> open_fabric(const std::string& prov, fi_info* fi) {
  fid_fabric* fabric = nullptr;
  check(prov, fi_fabric(fi->fabric_attr, &fabric, nullptr), "fi_fabric");
  return FidPtr<fid_fabric>(fabric);
}

FidPtr<fid_domain> open_domain(const std::string& prov, fid_fabric* fabric, fi_info* fi) {
  fid_domain* domain = nullptr;
  check(prov, fi_domain(fabric, fi, &domain, nullptr), "fi_domain");
  return FidPtr<fid_domain>(domain);
}

// *wait_fd: the fd to sleep on, -1 when the provider offers none (waits nap instead:
// transport_wait.cc).
FidPtr<fid_cq> open_cq(const std::string& prov, fid_domain* domain, const fi_info* fi, int* wait_fd) {
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_TAGGED;
  cq_attr.size = fi->rx_attr->size + fi->tx_attr->size;
  cq_attr.wait_obj = FI_WAIT_FD;
  fid_cq* cq = nullptr;
  *wait_fd = -1;
  if (fi_cq_open(domain, &cq_attr, &cq, nullptr) != 0) {
    cq_attr.wait_obj = FI_WAIT_NONE;
    check(prov, fi_cq_open(domain, &cq_attr, &cq, nullptr), "fi_cq_open");
    return FidPtr<fid_cq>(cq);
  }
  FidPtr<fid_cq> owned(cq);
  if (fi_control(&cq->fid, FI_GETWAIT, wait_fd) != 0) *wait_fd = -1;
  return owned;
}

FidPtr<fid_av> open_av(const std::string& prov, fid_domain* domain, size_t av_count) {
  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  av_attr.count = av_count;
  fid_av* av = nullptr;
  check(prov, fi_av_open(domain, &av_attr, &av, nullptr), "fi_av_open");
  return FidPtr<fid_av>(av);
}

// The endpoint, bound to the av and the cq, named (shm) and enabled.
FidPtr<fid_ep> open_endpoint(const std::string& prov, fid_domain* domain, fi_info* fi, fid_av* av, fid_cq* cq) {
  fid_ep* raw = nullptr;
  check(prov, fi_endpoint(domain, fi, &raw, nullptr), "fi_endpoint");
  FidPtr<fid_ep> ep(raw);
  check(prov, fi_ep_bind(ep.get(), &av->fid, 0), "fi_ep_bind(av)");
  check(prov, fi_ep_bind(ep.get(), &cq->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
  if (prov == "shm") {
    std::string name = unique_shm_name();
    check(prov, fi_setname(&ep->fid, name.data(), name.size() + 1), "fi_setname");
  }
  check(prov, fi_enable(ep.get()), "fi_enable");
  return ep;
}

std::string endpoint_name(const std::string& prov, fid_ep* ep) {
  char name[512];
  size_t len = sizeof(name);
  check(prov, fi_getname(&ep->fid, name, &len), "fi_getname");
  return std::string(name, len);
}

}  // namespace

Endpoint::Endpoint(InfoPtr info, bool force_mr_local, size_t av_count)
    : provider_(info->fabric_attr->prov_name), info_(std::move(info)) {
  fi_info* fi = info_.get();
  max_msg_size_ = fi->ep_attr->max_msg_size;
  ordered_ = (fi->tx_attr->msg_order & FI_ORDER_SAS) && (fi->rx_attr->msg_order & FI_ORDER_SAS);
  cq_data_ = fi->domain_attr->cq_data_size >= 4;
  if (provider_.rfind("tcp", 0) == 0 && fi->domain_attr->cq_data_size >= 8) {
    // The payload padding takes two iovecs each way, and the pads are not registered.
    const bool two_iov = fi->tx_attr->iov_limit >= 2 && fi->rx_attr->iov_limit >= 2;
    const bool registers = force_mr_local || (fi->domain_attr->mr_mode & FI_MR_LOCAL);
    pad_ = av_count == 2 && two_iov && !registers ? Pad::kPayload : Pad::kHeader;
  }
  fabric_ = open_fabric(provider_, fi);
  domain_ = open_domain(provider_, fabric_.get(), fi);
  cq_ = open_cq(provider_, domain_.get(), fi, &wait_fd_);
  av_ = open_av(provider_, domain_.get(), av_count);
  ep_ = open_endpoint(provider_, domain_.get(), fi, av_.get(), cq_.get());
  address_ = endpoint_name(provider_, ep_.get());
  if ((fi->domain_attr->mr_mode & FI_MR_LOCAL) || force_mr_local)
    mr_.emplace(domain_.get(), (fi->domain_attr->mr_mode & FI_MR_PROV_KEY) != 0);
  log::debug(log::Subsys::kFabric, "{} endpoint on {}: max_msg_size {}, ordered {}, mr_local {}, wait {}",
             provider_, domain_name(), max_msg_size_, ordered_, needs_mr(),
             wait_fd_ >= 0 ? "fd" : "poll");
}

std::string Endpoint::domain_name() const {
  const char* d = info_->domain_attr->name;
  return d ? d : "?";
}

fi_addr_t Endpoint::insert(const std::string& raw) {
  const auto family = [&] {
    sa_family_t f = AF_UNSPEC;
    if (raw.size() >= sizeof(f)) std::memcpy(&f, raw.data(), sizeof(f));
    return f;
  };
  bool fits;
  switch (info_->addr_format) {
    case FI_SOCKADDR_IN:
      fits = raw.size() == sizeof(sockaddr_in) && family() == AF_INET;
      break;
    case FI_SOCKADDR_IN6:
      fits = raw.size() == sizeof(sockaddr_in6) && family() == AF_INET6;
      break;
    case FI_SOCKADDR:
      fits = (raw.size() == sizeof(sockaddr_in) && family() == AF_INET) ||
             (raw.size() == sizeof(sockaddr_in6) && family() == AF_INET6);
      break;
    case FI_ADDR_STR:
      fits = raw.find('\0') != std::string::npos;
      break;
    default:
      fits = raw.size() == address_.size();
  }
  if (!fits) throw remote_error("a malformed {} address ({} bytes)", provider_, raw.size());
  fi_addr_t addr = FI_ADDR_UNSPEC;
  int n = fi_av_insert(av_.get(), raw.data(), 1, &addr, 0, nullptr);
  if (n != 1) throw internal_error("{} fi_av_insert failed ({})", provider_, n);
  return addr;
}

bool Endpoint::read_error(fi_cq_err_entry* err, std::string* text) {
  *err = fi_cq_err_entry{};
  ssize_t rc = fi_cq_readerr(cq_.get(), err, 0);
  if (rc != 1) return false;
  char buf[256];
  const char* s = fi_cq_strerror(cq_.get(), err->prov_errno, err->err_data, buf, sizeof(buf));
  err->err = std::abs(err->err);  // some providers report it negated
  *text = fmt::format("{} (provider: {})", fi_strerror(err->err), s ? s : "?");
  return true;
}

int Endpoint::try_wait() {
  if (wait_fd_ < 0) return -FI_ENOSYS;
  fid* fids[1] = {&cq_->fid};
  return fi_trywait(fabric_.get(), fids, 1);
}

}  // namespace trn::fabric
