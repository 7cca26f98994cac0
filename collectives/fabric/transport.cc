#include "collectives/fabric/transport.h"

#include "collectives/core/log.h"
#include "collectives/fabric/tag.h"

namespace trn::fabric {
namespace {

class FabricRequest : public Request {
 public:
  FabricRequest(std::shared_ptr<Transport> t, std::shared_ptr<Op> op)
      : t_(std::move(t)), op_(std::move(op)) {}
  bool test() override { return t_->test(*op_); }
  void wait(Deadline deadline) override { t_->wait(*op_, deadline); }
  size_t bytes() const override { return op_->bytes; }

 private:
  std::shared_ptr<Transport> t_;
  std::shared_ptr<Op> op_;
};

}  // namespace

Transport::Transport(int rank, int size, const Options& opts, std::unique_ptr<Endpoint> main,
                     std::unique_ptr<Endpoint> shm, std::vector<Peer> peers, std::vector<RingSegment> segments,
                     Liveness liveness, std::vector<std::unique_ptr<Endpoint>> rails)
    : rank_(rank), size_(size), opts_(opts),
      router_(rank, size, opts, aborted_, waiters_, std::move(main), std::move(shm), std::move(peers),
              std::move(segments), liveness, std::move(rails)) {
  for (Endpoint* ep : router_.endpoints())
    if (ep) waiters_.watch_fd(ep->wait_fd());
  const Endpoint* main_ep = router_.endpoints()[0];
  const Endpoint* shm_ep = router_.endpoints()[1];
  log::debug(log::Subsys::kFabric, "{}; waits sleep on {}", router_.describe(),
             !waiters_.can_sleep || main_ep->wait_fd() < 0 ? "short naps"
             : shm_ep && shm_ep->wait_fd() < 0            ? "completion fds (naps while shm is busy)"
                                                          : "completion fds");
  std::lock_guard lock(mu_);
  router_.start();
}

Transport::~Transport() {
  std::lock_guard lock(mu_);
  teardown_locked();
}

RequestPtr Transport::isend(int peer, uint64_t tag, const void* buf, size_t len) {
  if (tag & ~kUserTagMask) throw usage_error("isend: tag {:#x} is wider than 56 bits", tag);
  return post(true, peer, wire::user(tag, 0), static_cast<char*>(const_cast<void*>(buf)), len);
}

RequestPtr Transport::irecv(int peer, uint64_t tag, void* buf, size_t len) {
  if (tag & ~kUserTagMask) throw usage_error("irecv: tag {:#x} is wider than 56 bits", tag);
  return post(false, peer, wire::user(tag, 0), static_cast<char*>(buf), len);
}

RequestPtr Transport::post_control(bool send, int peer, uint64_t wire_tag, void* buf, size_t len) {
  return post(send, peer, wire_tag, static_cast<char*>(buf), len);
}

RequestPtr Transport::post(bool send, int peer, uint64_t wire_tag, char* buf, size_t len) {
  if (peer < 0 || peer >= size_)
    throw usage_error("{}: peer {} is not a rank of this world (size {})", send ? "isend" : "irecv",
                      peer, size_);
  if (len > 0 && !buf) throw usage_error("{}: null buffer of {} bytes", send ? "isend" : "irecv", len);
  std::lock_guard lock(mu_);
  if (aborted()) throw aborted_error_now();
  auto op = new_op(send, peer, wire_tag, wire_tag, buf, len);
  router_.post(op);
  return std::make_shared<FabricRequest>(shared_from_this(), op);
}

void Transport::progress() {
  std::lock_guard lock(mu_);
  if (aborted()) throw aborted_error_now();
  router_.progress();
}

void Transport::teardown_locked() {
  router_.flush_notices();
  router_.close(aborted() ? aborted_error_now() : aborted_error("the fabric endpoint was closed"));
}

uint64_t Transport::registrations() const {
  std::lock_guard lock(mu_);
  return router_.registrations();
}

}  // namespace trn::fabric
