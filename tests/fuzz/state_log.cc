// Fuzz target: the coordinator's state log (launcher/server/state_dir.h, DIR/state.log), what
// trn-coordinator --state-dir reads at start. The first byte picks what the rest is (mod 3):
//   0: the log's bytes, as they lie on disk (header, framed records, checksums);
//   1: records' payloads (parts, fuzz.h), framed and checksummed here as trn frames them, so
//      that mutations reach the records' contents and not only their checksums;
//   2: DIR/state.pb, the whole snapshot an older trn kept (read once, then rewritten as a log).
// A log that loads is restored into a registry (which refuses jobs it cannot hold), whose status
// must answer; then its snapshot is
// written as a new log (StateDir::append) and must load back the same jobs.
#include <xxhash.h>

#include <algorithm>

#include "launcher/server/registry.h"
#include "launcher/server/state_dir.h"
#include "tests/fuzz/fuzz.h"
#include "tests/fuzz/saved_job.h"

namespace {

using namespace trn;
using namespace trn::control;
namespace v1 = ::trn::coordinator::v1;

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// The framing documented at LogRecord in coordinator.proto.
std::string framed_log(const std::vector<std::string_view>& payloads) {
  std::string out("TRNCLOG\x01", 8);
  for (const auto& p : payloads) {
    std::string len;
    put_le(len, p.size(), 4);
    out += len;
    put_le(out, XXH32(len.data(), len.size(), 0), 4);
    put_le(out, XXH64(p.data(), p.size(), 0), 8);
    out += p;
  }
  return out;
}


}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fs = std::filesystem;
  if (size == 0) return 0;
  const fs::path dir = fuzz::scratch() / "state";
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::create_directories(dir);
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 3) {
    case 0: fuzz::put(dir / "state.log", rest); break;
    case 1: fuzz::put(dir / "state.log", framed_log(fuzz::split(data + 1, size - 1, 64))); break;
    default: fuzz::put(dir / "state.pb", rest); break;
  }

  v1::Snapshot snap;
  if (!fuzz::accepts([&] {
        StateDir log(dir.string());
        snap = log.load();
      }))
    return 0;
  RegistryOptions o;
  const Clock::time_point now = Clock::time_point() + std::chrono::hours(1);
  o.now = [now] { return now; };
  o.unix_ms = [] { return int64_t{1'800'000'000'000}; };
  Registry reg(o);
  if (!fuzz::accepts([&] { reg.restore(snap); })) return 0;
  v1::GetStatusRequest q;
  v1::GetStatusResponse r;
  const Status s = reg.status(q, &r);
  fuzz::require(s.ok(), "status of a restored registry fails: " + s.message);
  reg.tick();
  const v1::Snapshot mine = reg.snapshot();
  reg.close();

  const fs::path again = fuzz::scratch() / "again";
  fs::remove_all(again, ec);
  std::map<std::string, std::string> want, got;
  {
    StateDir log(again.string());
    log.load();
    for (const auto& j : mine.jobs()) {
      v1::LogRecord rec;
      *rec.mutable_job() = j;
      log.append(rec);
      want[j.job_id()] = fuzz::canonical_job(j);
    }
  }
  StateDir log(again.string());
  const v1::Snapshot loaded = log.load();
  for (const auto& j : loaded.jobs()) got[j.job_id()] = fuzz::canonical_job(j);
  fuzz::require(got == want, "a registry's jobs written as a state log load back different");
  return 0;
}
