// The point-to-point interface the collective algorithms speak (DESIGN.md layers 1 and 3).
// The fabric implements it over libfabric; unit tests may implement it in-process. Nothing that
// uses this header sees libfabric.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "collectives/core/deadline.h"

namespace trn {

// One posted send or receive.
class Request {
 public:
  virtual ~Request() = default;
  // Drives progress; true once complete. Throws Error if the operation failed or was aborted.
  virtual bool test() = 0;
  // Drives progress until complete. Throws Error on failure, abort, or when deadline passes
  // (naming the peer and the tag).
  virtual void wait(Deadline deadline) = 0;
  // Bytes received (receives) or sent (sends); valid once complete.
  virtual size_t bytes() const = 0;
};
using RequestPtr = std::shared_ptr<Request>;

// Tags are 56 bits wide (kUserTagBits); the fabric keeps the top 8 bits of its 64-bit wire tag
// for itself. Their layout above the fabric is set by the communicator (collectives/tag.h).
inline constexpr int kUserTagBits = 56;
inline constexpr uint64_t kUserTagMask = (uint64_t{1} << kUserTagBits) - 1;

class PointToPoint {
 public:
  virtual ~PointToPoint() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Posts a send of len bytes to peer. buf must stay valid and unchanged until completion.
  // Messages of any length (0 B .. beyond the provider's max_msg_size) are one message.
  virtual RequestPtr isend(int peer, uint64_t tag, const void* buf, size_t len) = 0;

  // Posts a receive of up to len bytes from peer with exactly this tag. A message longer than
  // len is an error. Receives may be posted before or after the matching send.
  virtual RequestPtr irecv(int peer, uint64_t tag, void* buf, size_t len) = 0;

  // Drives progress of every outstanding operation once without blocking.
  virtual void progress() = 0;

  // Fails every outstanding and future operation at once with an aborted Error carrying reason.
  // Safe to call from any thread, any number of times.
  virtual void abort(const std::string& reason) = 0;
  virtual bool aborted() const = 0;

  // A short description for logs: provider(s), address.
  virtual std::string describe() const = 0;

  // A number naming the host peer runs on (the fabric: the lowest rank on that host), equal for
  // the ranks of one host: the fabric's same-host ranks (same hostname and kernel boot), which
  // it reaches through shared memory. Every rank answers alike for every peer (the fabric's
  // come from the bootstrap records all ranks read), so choices built on it agree. A transport
  // that cannot tell says every rank shares one host.
  virtual int host_of(int peer) const {
    (void)peer;
    return 0;
  }
};

}  // namespace trn
