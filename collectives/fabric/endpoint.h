// One libfabric reliable-datagram endpoint and what it is built from, opened in the order the
// API asks (getinfo, fabric, domain, cq, av, endpoint, bind, enable), one phase each, and closed
// in reverse: every object is owned (FidPtr) and declared in that order.
// Internal to collectives/fabric: nothing outside it includes this header.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "collectives/fabric/mr_cache.h"

namespace trn::fabric {

struct InfoDeleter {
  void operator()(fi_info* i) const { fi_freeinfo(i); }
};
using InfoPtr = std::unique_ptr<fi_info, InfoDeleter>;

// An opened libfabric object (fabric, domain, cq, av, endpoint), closed with fi_close when its
// owner lets go. An Endpoint holds one per setup phase, declared in the order they open, so
// they close in reverse, also when a later phase throws.
struct FidCloser {
  template <typename T>
  void operator()(T* f) const { fi_close(&f->fid); }
};
template <typename T>
using FidPtr = std::unique_ptr<T, FidCloser>;

// libfabric's name for a TRN_FABRIC_PROVIDER choice: tcp -> "tcp;ofi_rxm", udp -> "udp;ofi_rxd"
// (reliable datagrams, as EFA's RDM is over SRD), others unchanged.
std::string libfabric_name(const std::string& choice);

// Sets libfabric provider defaults trn relies on, only where the user has not set them: the rxm
// eager limit (FI_OFI_RXM_EAGER_LIMIT, 512 KiB and padding) so tcp messages up to 512 KiB go
// in one trip instead of rxm's rendezvous (request, RMA read, ack), which needs both sides to
// progress in turn (bench/results/2026-11-29-rxm-eager-limit.md), and the receive buffers rxm
// posts per connection (FI_OFI_RXM_MSG_RX_SIZE). Takes effect only before libfabric's first
// fi_getinfo in the process; query() and available_providers() call it.
void set_provider_defaults();

// fi_getinfo for a reliable tagged endpoint of provider prov (libfabric's name), on the
// interface iface (ip providers; empty: any) or the domain named domain (an interface or a
// device, any provider). nullptr when there is none; *why then says what fi_getinfo answered.
InfoPtr query(const std::string& prov, const std::string& iface, std::string* why, const std::string& domain = "");

// The provider's domains in the order it lists them (devices without efa's "-rdm" suffix,
// interfaces but lo): what TRN_FABRIC_RAILS=auto or N picks from.
std::vector<std::string> provider_domains(const std::string& prov);

class Endpoint {
 public:
  // Opens everything; av_count sizes the address vector. Throws Error on failure, having closed
  // what it opened.
  Endpoint(InfoPtr info, bool force_mr_local, size_t av_count);
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  const std::string& provider() const { return provider_; }
  std::string domain_name() const;
  const std::string& address() const { return address_; }  // raw bytes from fi_getname
  size_t max_msg_size() const { return max_msg_size_; }
  bool ordered() const { return ordered_; }
  // How this endpoint frames messages on the wire (padding, below); every rank must agree.
  const char* framing() const {
    return pad_ == Pad::kPayload ? "tcp-pad64" : pad_ == Pad::kHeader ? "tcp-hdr32" : "plain";
  }
  bool needs_mr() const { return mr_.has_value(); }
  MrCache& mr() { return *mr_; }

  // Inserts one peer address; returns its fi_addr. A peer published it, and libfabric reads as
  // many bytes as its address format says: one that is not of that format (a sockaddr of the
  // endpoint's family, a NUL-terminated string, else as long as this endpoint's own) is refused
  // with a remote_error.
  fi_addr_t insert(const std::string& raw);

  // Whether sends may carry remote CQ data (data below) of 32 bits; the receiver reads it from
  // the completion (FI_REMOTE_CQ_DATA in its flags).
  bool cq_data() const { return cq_data_; }

  // Posting; return 0, -FI_EAGAIN, or another negative error. data: remote CQ data (0: none;
  // otherwise only where cq_data()).
  ssize_t tsend(const void* buf, size_t len, void* desc, fi_addr_t dest, uint64_t tag, void* ctx,
                uint64_t data = 0) {
    if (pad_ == Pad::kNone && data == 0) return fi_tsend(ep_.get(), buf, len, desc, dest, tag, ctx);
    if (pad_ != Pad::kPayload) return fi_tsenddata(ep_.get(), buf, len, desc, data, dest, tag, ctx);
    iovec iov[2] = {{const_cast<char*>(kPadOut), kPad}, {const_cast<void*>(buf), len}};
    void* descs[2] = {nullptr, desc};
    const fi_msg_tagged msg{iov, descs, len ? 2u : 1u, dest, tag, 0, ctx, data};
    return fi_tsendmsg(ep_.get(), &msg, FI_COMPLETION | FI_REMOTE_CQ_DATA);
  }
  ssize_t trecv(void* buf, size_t len, void* desc, fi_addr_t src, uint64_t tag, void* ctx) {
    if (pad_ != Pad::kPayload) return fi_trecv(ep_.get(), buf, len, desc, src, tag, 0, ctx);
    iovec iov[2] = {{pad_in_, kPad}, {buf, len}};
    void* descs[2] = {nullptr, desc};
    const fi_msg_tagged msg{iov, descs, len ? 2u : 1u, src, tag, 0, ctx, 0};
    return fi_trecvmsg(ep_.get(), &msg, FI_COMPLETION);
  }
  // Reads completions (also drives progress); > 0 entries, -FI_EAGAIN none, -FI_EAVAIL an
  // error entry waits for read_error(). A receive's len counts the caller's bytes only.
  ssize_t read(fi_cq_tagged_entry* entries, size_t n) {
    const ssize_t got = fi_cq_read(cq_.get(), entries, n);
    if (pad_ == Pad::kPayload)
      for (ssize_t i = 0; i < got; ++i)
        if (entries[i].flags & FI_RECV) entries[i].len -= std::min(entries[i].len, kPad);
    return got;
  }
  // Reads one error entry; *text gets fi_cq_strerror's explanation. False when none.
  bool read_error(fi_cq_err_entry* err, std::string* text);

  int wait_fd() const { return wait_fd_; }  // -1 when the cq has no fd to sleep on
  // fi_trywait: 0 when it is safe to sleep on wait_fd(), -FI_EAGAIN when completions are
  // pending, another negative code when the provider cannot tell.
  int try_wait();

 private:
  std::string provider_;
  InfoPtr info_;
  FidPtr<fid_fabric> fabric_;
  FidPtr<fid_domain> domain_;
  FidPtr<fid_cq> cq_;
  FidPtr<fid_av> av_;
  FidPtr<fid_ep> ep_;
  std::optional<MrCache> mr_;  // last: its registrations close before the domain
  std::string address_;
  size_t max_msg_size_ = 0;
  bool ordered_ = false;
  bool cq_data_ = false;
  // tcp: send with 8 bytes of (unused) remote CQ data, which makes the provider's wire header 32
  // bytes instead of 24 (kHeader). The kernel copies a payload between the user's buffer and
  // socket pages that hold the stream from the header on; at distances of a few bytes (the
  // destination past the source, modulo a page) `rep movsb` runs markedly slower on AMD Zen
  // cores, and at full speed at multiples of 32. In a world of two ranks (kPayload) every message
  // also starts with kPad bytes of padding: with one peer, a sender's socket pages are free
  // again by its next send and the kernel writes it from their start, so the payload lands the
  // 64 header bytes in, where a 64-byte-aligned buffer (core/aligned.h) keeps its alignment.
  // With more peers the pages are shared between connections and the padding measured slower,
  // so it is off. Figures: bench/results/2026-11-30-buffer-alignment.md.
  enum class Pad { kNone, kHeader, kPayload };
  static constexpr size_t kPad = 32;
  static constexpr char kPadOut[kPad] = {};
  Pad pad_ = Pad::kNone;
  char pad_in_[kPad];  // where receives put the padding
  int wait_fd_ = -1;
};

}  // namespace trn::fabric
