#include "launcher/server/state_dir.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "collectives/core/error.h"
#include "collectives/core/log.h"

namespace trn::control {

namespace fs = std::filesystem;
namespace v1 = ::trn::coordinator::v1;

namespace {

constexpr char kMagic[8] = {'T', 'R', 'N', 'C', 'L', 'O', 'G', '\x01'};
constexpr size_t kFrame = 16;  // u32 length, u32 XXH32 of the length, u64 XXH64 of the payload
constexpr uint64_t kCompactFloor = 1 << 20;

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t get_le(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

std::string frame(const v1::LogRecord& rec) {
  std::string payload;
  if (!rec.SerializeToString(&payload)) throw internal_error("cannot serialize a coordinator log record");
  std::string len;
  put_le(len, payload.size(), 4);
  std::string out = len;
  put_le(out, XXH32(len.data(), len.size(), 0), 4);
  put_le(out, XXH64(payload.data(), payload.size(), 0), 8);
  return out + payload;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw usage_error("cannot read {}: {}", path, std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_all(int fd, const std::string& data, const std::string& path) {
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::write(fd, data.data() + off, data.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw remote_error("writing {} failed: {}", path, std::strerror(errno));
    off += static_cast<size_t>(n);
  }
}

}  // namespace

void write_file_atomic(const std::string& path, const std::string& data) {
  fs::path p(path);
  std::string tmp = path + ".tmp." + std::to_string(getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) throw usage_error("cannot write {}: {}", tmp, std::strerror(errno));
  try {
    write_all(fd, data, tmp);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw remote_error("fsync of {} failed: {}", tmp, std::strerror(errno));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    throw remote_error("rename {} -> {} failed: {}", tmp, path, std::strerror(errno));
  }
  std::string dir = p.has_parent_path() ? p.parent_path().string() : ".";
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void check_output_file(const std::string& path, const char* flag) {
  if (path.empty()) throw usage_error("{} needs a file path", flag);
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw usage_error("{} {} is a directory; give a file path", flag, path);
  fs::path p(path);
  std::string dir = p.has_parent_path() ? p.parent_path().string() : ".";
  if (!fs::exists(dir, ec)) throw usage_error("{} {}: the directory {} does not exist; create it first", flag, path, dir);
  if (!fs::is_directory(dir, ec)) throw usage_error("{} {}: {} is not a directory", flag, path, dir);
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    throw usage_error("{} {}: the directory {} is not writable by this user", flag, path, dir);
}

StateDir::StateDir(std::string dir) : dir_(std::move(dir)) {
  std::error_code ec;
  if (fs::exists(dir_, ec) && !fs::is_directory(dir_, ec))
    throw usage_error("--state-dir {} is not a directory; give a directory (it holds state.log)", dir_);
  fs::create_directories(dir_, ec);
  if (ec) throw usage_error("--state-dir {}: cannot create it: {}", dir_, ec.message());
  if (::access(dir_.c_str(), W_OK | X_OK) != 0)
    throw usage_error("--state-dir {} is not writable; pick a directory this user can write", dir_);
  file_ = (fs::path(dir_) / "state.log").string();
  for (const auto& f : {file_, (fs::path(dir_) / "state.pb").string()}) {
    struct stat st {};
    if (::stat(f.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
      throw usage_error("{} is not a regular file; move it away (it is where --state-dir keeps its state)", f);
  }
}

StateDir::~StateDir() {
  if (fd_ >= 0) ::close(fd_);
}

v1::Snapshot StateDir::load() {
  std::lock_guard lock(mu_);
  v1::Snapshot snap;
  std::map<std::string, v1::Snapshot::Job> jobs;
  std::string legacy = (fs::path(dir_) / "state.pb").string();
  std::error_code ec;
  bool have_log = fs::exists(file_, ec);
  if (!have_log && fs::exists(legacy, ec)) {
    // An older trn's whole snapshot: no checksum to check, but never an empty file.
    std::string data = read_all(legacy);
    if (data.empty() || !snap.ParseFromString(data))
      throw usage_error("{} is {}; move it away to start empty", legacy,
                        data.empty() ? "empty (0 bytes)" : "not a trn coordinator snapshot (corrupt?)");
    next_event_seq_ = snap.next_event_seq();
    for (const auto& j : snap.jobs()) jobs[j.job_id()] = j;
    log::info(log::Subsys::kCoord, "read {} of an older trn; keeping the state in {} from now on", legacy, file_);
  } else if (have_log) {
    std::string data = read_all(file_);
    if (data.empty())
      throw usage_error("{} is empty (0 bytes), which trn never writes; move it away to start empty", file_);
    if (data.size() < sizeof kMagic || std::memcmp(data.data(), kMagic, sizeof kMagic) != 0)
      throw usage_error("{} is not a trn coordinator log (its header is wrong); move it away to start empty", file_);
    size_t off = sizeof kMagic;
    while (off < data.size()) {
      size_t left = data.size() - off;
      auto torn = [&] {
        log::warn(log::Subsys::kCoord,
                  "{}: dropped its last record, cut short at byte {} of {} (a crash during a write leaves "
                  "this); the change it held is lost",
                  file_, off, data.size());
      };
      if (left < 8) {
        torn();
        break;
      }
      uint32_t len = static_cast<uint32_t>(get_le(data.data() + off, 4));
      if (get_le(data.data() + off + 4, 4) != XXH32(data.data() + off, 4, 0))
        throw usage_error("{}: the record at byte {} fails its checksum (the file is corrupt); move it away to "
                          "start empty, or restore it from a backup", file_, off);
      if (left < kFrame || left - kFrame < len) {
        torn();
        break;
      }
      const char* payload = data.data() + off + kFrame;
      v1::LogRecord rec;
      if (get_le(data.data() + off + 8, 8) != XXH64(payload, len, 0) || !rec.ParseFromArray(payload, static_cast<int>(len)))
        throw usage_error("{}: the record at byte {} fails its checksum (the file is corrupt); move it away to "
                          "start empty, or restore it from a backup", file_, off);
      next_event_seq_ = std::max(next_event_seq_, rec.next_event_seq());
      if (rec.has_job()) jobs[rec.job().job_id()] = rec.job();
      else if (rec.change_case() == v1::LogRecord::kRemovedJob) jobs.erase(rec.removed_job());
      off += kFrame + len;
    }
    snap.Clear();
  }
  snap.set_next_event_seq(next_event_seq_);
  for (auto& [id, j] : jobs) {
    v1::LogRecord rec;
    *rec.mutable_job() = j;
    live_[id] = frame(rec);
    *snap.add_jobs() = std::move(j);
  }
  // Start from a clean log: a dropped torn record or an old snapshot is gone from disk too.
  compact_locked();
  if (!have_log && fs::exists(legacy, ec)) fs::remove(legacy, ec);
  return snap;
}

void StateDir::open_for_append() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = ::open(file_.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd_ < 0) throw usage_error("cannot open {} for appending: {}", file_, std::strerror(errno));
}

void StateDir::append(const v1::LogRecord& record) {
  std::lock_guard lock(mu_);
  if (fd_ < 0) throw internal_error("StateDir::append before load");
  next_event_seq_ = std::max(next_event_seq_, record.next_event_seq());
  std::string rec = frame(record);
  write_all(fd_, rec, file_);
  if (::fdatasync(fd_) != 0) throw remote_error("fdatasync of {} failed: {}", file_, std::strerror(errno));
  log_bytes_ += rec.size();
  if (record.has_job()) {
    auto& slot = live_[record.job().job_id()];
    live_bytes_ += rec.size();
    live_bytes_ -= slot.size();
    slot = std::move(rec);
  } else if (record.change_case() == v1::LogRecord::kRemovedJob) {
    auto it = live_.find(record.removed_job());
    if (it != live_.end()) {
      live_bytes_ -= it->second.size();
      live_.erase(it);
    }
  }
  if (log_bytes_ > 2 * live_bytes_ + kCompactFloor) compact_locked();
}

void StateDir::compact() {
  std::lock_guard lock(mu_);
  compact_locked();
}

void StateDir::compact_locked() {
  std::string out(kMagic, sizeof kMagic);
  for (const auto& [_, rec] : live_) out += rec;
  v1::LogRecord seq;
  seq.set_next_event_seq(next_event_seq_);
  out += frame(seq);
  write_file_atomic(file_, out);
  log_bytes_ = live_bytes_ = out.size();
  open_for_append();
}

}  // namespace trn::control
