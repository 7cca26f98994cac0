// trn-netdelay: the delay half of a netem link for test-bed hosts whose kernel has no qdiscs.
//
//   trn-netdelay --queue N --delay-ms D
//
// Runs inside a host's network namespace, where testbed.sh sends the packets of its eth0 (in and
// out) to NFQUEUE N. Every packet is held D milliseconds from its arrival here and then accepted,
// in arrival order: a constant delay keeps a TCP stream in order, as netem's does. Only packet
// metadata is copied to user space; the verdict releases the kernel's own copy. The process ends
// on SIGTERM/SIGINT; the rules use --queue-bypass, so packets flow undelayed once it is gone.
#include <arpa/inet.h>
#include <errno.h>
#include <libnetfilter_queue/libnetfilter_queue.h>
#include <linux/netfilter.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cstdint>
#include <deque>
#include <string>

namespace {

volatile sig_atomic_t g_stop = 0;

struct Held {
  uint32_t id;
  int64_t due_ns;
};

struct Delayer {
  nfq_q_handle* queue = nullptr;
  int64_t delay_ns = 0;
  std::deque<Held> held;
};

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

int on_packet(nfq_q_handle*, nfgenmsg*, nfq_data* data, void* arg) {
  auto* d = static_cast<Delayer*>(arg);
  const nfqnl_msg_packet_hdr* h = nfq_get_msg_packet_hdr(data);
  if (h) d->held.push_back({ntohl(h->packet_id), now_ns() + d->delay_ns});
  return 0;
}

void release_due(Delayer& d) {
  const int64_t now = now_ns();
  while (!d.held.empty() && d.held.front().due_ns <= now) {
    nfq_set_verdict(d.queue, d.held.front().id, NF_ACCEPT, 0, nullptr);
    d.held.pop_front();
  }
}

[[noreturn]] void usage(const char* why) {
  fprintf(stderr, "trn-netdelay: %s\nusage: trn-netdelay --queue N --delay-ms D\n", why);
  exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  long queue_num = -1;
  double delay_ms = -1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) usage(("missing value for " + a).c_str());
    char* end = nullptr;
    if (a == "--queue") {
      queue_num = strtol(argv[++i], &end, 10);
      if (*end || queue_num < 0 || queue_num > 65535) usage("--queue takes 0..65535");
    } else if (a == "--delay-ms") {
      delay_ms = strtod(argv[++i], &end);
      if (*end || !(delay_ms >= 0 && delay_ms <= 10000)) usage("--delay-ms takes 0..10000");
    } else {
      usage(("unknown option " + a).c_str());
    }
  }
  if (queue_num < 0 || delay_ms < 0) usage("--queue and --delay-ms are required");

  struct sigaction sa {};
  sa.sa_handler = [](int) { g_stop = 1; };
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);

  Delayer d;
  d.delay_ns = int64_t(delay_ms * 1e6);
  nfq_handle* h = nfq_open();
  if (!h) usage(("cannot open a netfilter queue socket: " + std::string(strerror(errno))).c_str());
  d.queue = nfq_create_queue(h, uint16_t(queue_num), on_packet, &d);
  if (!d.queue) usage(("cannot bind queue " + std::to_string(queue_num) + ": " + strerror(errno)).c_str());
  nfq_set_mode(d.queue, NFQNL_COPY_META, 0);
  // Enough room for a delay's worth of packets at full speed; GSO packets arrive whole.
  nfq_set_queue_maxlen(d.queue, 1 << 16);
  nfq_set_queue_flags(d.queue, NFQA_CFG_F_GSO, NFQA_CFG_F_GSO);
  nfnl_rcvbufsiz(nfq_nfnlh(h), 64 << 20);
  const int fd = nfq_fd(h);
  char buf[1 << 16];
  while (!g_stop) {
    int timeout_ms = -1;
    if (!d.held.empty()) {
      const int64_t wait = d.held.front().due_ns - now_ns();
      timeout_ms = wait <= 0 ? 0 : int((wait + 999999) / 1000000);
    }
    pollfd p{fd, POLLIN, 0};
    const int r = poll(&p, 1, timeout_ms);
    if (r > 0) {
      // Drain what is readable now, then release what is due.
      for (;;) {
        const ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (n > 0) {
          nfq_handle_packet(h, buf, int(n));
          continue;
        }
        // ENOBUFS: the kernel dropped messages (their packets are lost, as on a full link).
        if (n < 0 && errno == ENOBUFS) continue;
        break;
      }
    }
    release_due(d);
  }
  // Release what is still held rather than drop it.
  for (const Held& x : d.held) nfq_set_verdict(d.queue, x.id, NF_ACCEPT, 0, nullptr);
  nfq_destroy_queue(d.queue);
  nfq_close(h);
  return 0;
}
