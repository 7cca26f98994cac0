#include "launcher/agent/output_pump.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "collectives/core/error.h"
#include "collectives/core/log.h"

namespace trn::launch {
namespace {

// Writes all of data; gives up quietly on a closed console (EPIPE) or a full disk.
void write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        pollfd p{fd, POLLOUT, 0};
        ::poll(&p, 1, 100);
        continue;
      }
      return;
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
}

}  // namespace

struct OutputPump::Stream {
  OutputSink sink;
  int fd[2] = {-1, -1};
  LineBuffer buffer[2];
  int log_fd = -1;
  std::string partial_path;
  bool done = false;
};

OutputPump::OutputPump(int console_out, int console_err) : console_{console_out, console_err} {
  if (pipe2(wake_pipe_, O_CLOEXEC | O_NONBLOCK) != 0) throw internal_error("pipe2 failed: errno {}", errno);
  thread_ = std::thread([this] { run(); });
}

OutputPump::~OutputPump() {
  drain(Deadline::after(std::chrono::seconds(0)));
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  wake();
  thread_.join();
  ::close(wake_pipe_[0]);
  ::close(wake_pipe_[1]);
}

void OutputPump::wake() {
  char c = 1;
  (void)!::write(wake_pipe_[1], &c, 1);
}

void OutputPump::add(int out_fd, int err_fd, OutputSink sink) {
  auto s = std::make_unique<Stream>();
  s->fd[0] = out_fd;
  s->fd[1] = err_fd;
  ::fcntl(out_fd, F_SETFL, O_NONBLOCK);
  ::fcntl(err_fd, F_SETFL, O_NONBLOCK);
  if (!sink.log_path.empty()) {
    s->partial_path = sink.log_path + ".partial";
    s->log_fd = ::open(s->partial_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (s->log_fd < 0) {
      ::close(out_fd);
      ::close(err_fd);
      throw usage_error("cannot create log file {}: {}; check --log-dir", s->partial_path, strerror(errno));
    }
  }
  s->sink = std::move(sink);
  {
    std::lock_guard lock(mu_);
    streams_.push_back(std::move(s));
  }
  wake();
}

void OutputPump::write_line(Stream& s, int which, std::string_view line) {
  if (s.log_fd >= 0) write_all(s.log_fd, line);
  if (s.sink.console) {
    std::string out;
    out.reserve(s.sink.prefix.size() + line.size());
    out.append(s.sink.prefix).append(line);
    write_all(console_[which], out);
  }
}

void OutputPump::finish(Stream& s) {
  for (int which = 0; which < 2; ++which) {
    s.buffer[which].flush([&](std::string_view line) { write_line(s, which, line); });
    if (s.fd[which] >= 0) ::close(s.fd[which]);
    s.fd[which] = -1;
  }
  if (s.log_fd >= 0) {
    if (::fsync(s.log_fd) != 0 || ::close(s.log_fd) != 0 ||
        ::rename(s.partial_path.c_str(), s.sink.log_path.c_str()) != 0)
      log::warn(log::Subsys::kLaunch, "could not finish log file {}: {}", s.sink.log_path, strerror(errno));
    s.log_fd = -1;
  }
  s.done = true;
}

void OutputPump::read_ready(Stream& s, int which) {
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(s.fd[which], buf, sizeof(buf));
    if (n > 0) {
      s.buffer[which].feed(std::string_view(buf, static_cast<size_t>(n)),
                           [&](std::string_view line) { write_line(s, which, line); });
      if (static_cast<size_t>(n) < sizeof(buf)) return;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    // End of stream (or a read error, treated the same).
    s.buffer[which].flush([&](std::string_view line) { write_line(s, which, line); });
    ::close(s.fd[which]);
    s.fd[which] = -1;
    return;
  }
}

void OutputPump::run() {
  std::vector<pollfd> fds;
  std::vector<std::pair<Stream*, int>> owners;
  for (;;) {
    fds.clear();
    owners.clear();
    fds.push_back({wake_pipe_[0], POLLIN, 0});
    owners.push_back({nullptr, 0});
    uint64_t epoch = 0;
    {
      std::lock_guard lock(mu_);
      if (stopping_) return;
      epoch = epoch_;
      for (auto& s : streams_)
        for (int which = 0; which < 2; ++which)
          if (s->fd[which] >= 0) {
            fds.push_back({s->fd[which], POLLIN, 0});
            owners.push_back({s.get(), which});
          }
    }
    int r = ::poll(fds.data(), fds.size(), 1000);
    if (r < 0 && errno != EINTR) return;
    if (r <= 0) continue;
    if (fds[0].revents) {
      char drain_buf[64];
      while (::read(wake_pipe_[0], drain_buf, sizeof(drain_buf)) > 0) {
      }
    }
    std::lock_guard lock(mu_);
    if (epoch != epoch_) continue;  // drain() dropped the streams polled
    bool any_done = false;
    for (size_t i = 1; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      Stream& s = *owners[i].first;
      if (s.fd[owners[i].second] != fds[i].fd) continue;  // closed by drain() meanwhile
      read_ready(s, owners[i].second);
      if (s.fd[0] < 0 && s.fd[1] < 0 && !s.done) {
        finish(s);
        any_done = true;
      }
    }
    if (any_done) changed_.notify_all();
  }
}

bool OutputPump::drain(Deadline deadline) {
  std::unique_lock lock(mu_);
  auto all_done = [&] {
    for (auto& s : streams_)
      if (!s->done) return false;
    return true;
  };
  bool clean = changed_.wait_until(lock, deadline.when(), all_done);
  for (auto& s : streams_) {
    if (s->done) continue;
    for (int which = 0; which < 2; ++which)
      if (s->fd[which] >= 0) {
        ::fcntl(s->fd[which], F_SETFL, O_NONBLOCK);
        read_ready(*s, which);  // what is already in the pipe
      }
    finish(*s);
  }
  streams_.clear();
  ++epoch_;
  lock.unlock();
  wake();
  return clean;
}

}  // namespace trn::launch
