// The coordinator's UDP socket for node heartbeat datagrams (launcher/client/heartbeat_datagram.h).
//
// A socket on each address of the gRPC listener's host (a name may have an IPv4 and an IPv6
// one) at its port number (UDP ports are their own space), read by a few threads in batches
// (recvmmsg), each batch's answers sent in one sendmmsg. Each thread waits in its own epoll with
// EPOLLEXCLUSIVE, so a datagram wakes one thread, not all. What a datagram means is the
// handler's business (CoordinatorService::heartbeat_datagram); this class moves bytes. A datagram
// the handler drops gets no answer: the sender falls back to gRPC. Every datagram is either
// handed to the handler or reported lost (Lost), so the coordinator counts every drop.
//
// The receive buffer is made large (8 MiB, SO_RCVBUFFORCE when the process may, else up to the
// kernel's net.core.rmem_max), since 6,000 nodes a second fill Linux's default 208 KiB within a
// 20 ms stall of the coordinator. What it got is in the start-up line.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace trn::control {

class DatagramServer {
 public:
  // The answer to one datagram, or nullopt to drop it (the handler counts why). Every datagram
  // read goes to it: one longer than kMaxDatagram as its first kMaxDatagram + 1 bytes. Called
  // from several threads at once.
  using Handler = std::function<std::optional<std::string>(std::string_view datagram)>;

  // Datagrams lost outside the handler, n at a time, by why: kReceiveBufferFull (the kernel
  // dropped them for want of room in the receive buffer; learned through SO_RXQ_OVFL from the
  // next datagram read, so counted when one arrives) or kAnswerNotSent (the handler's answer
  // could not be sent: the send buffer full, the sender unreachable; its request was handled).
  // Called from the readers.
  using Lost = std::function<void(const char* why, uint64_t n)>;
  static constexpr const char* kReceiveBufferFull = "RECEIVE_BUFFER_FULL";
  static constexpr const char* kAnswerNotSent = "ANSWER_NOT_SENT";

  // Binds UDP host:port (every address host resolves to) and starts `threads` readers. Throws a
  // remote_error naming the address when it can bind none.
  DatagramServer(const std::string& host, int port, int threads, Handler handler, Lost lost = {});
  ~DatagramServer();  // stops the readers and closes the socket
  DatagramServer(const DatagramServer&) = delete;
  DatagramServer& operator=(const DatagramServer&) = delete;

  int port() const { return port_; }
  int receive_buffer_bytes() const { return rcvbuf_; }

 private:
  void loop();
  void stop();
  // The kernel's drop count of socket fds_[socket] is now total (SO_RXQ_OVFL: it only grows,
  // modulo 2^32): reports what no reader reported yet.
  void kernel_dropped(size_t socket, uint32_t total);

  Handler handler_;
  Lost lost_;
  std::unique_ptr<std::atomic<uint32_t>[]> kernel_drops_;  // per socket: the drop count reported
  std::vector<int> fds_;
  int wake_fd_ = -1;
  int port_ = 0, rcvbuf_ = 0;
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

}  // namespace trn::control
