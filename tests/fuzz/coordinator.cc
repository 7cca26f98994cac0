// Fuzz target: the coordinator's requests (launcher/server/registry.h), what any client holding a
// token can send. An input is a sequence of calls: each part (fuzz.h) is one byte naming the
// method (Join, Set, Get, Add, Delete, Barrier, Heartbeat, ReportFailure, Finish, ReportShard,
// GetStatus, or a clock tick) followed by its request in protobuf wire format, as gRPC would
// hand it over. Time is the registry's injected clock, advanced between calls, so waits and
// heartbeat timeouts fire without sleeping.
//
// Every call must answer with a status (a refusal in one line), never throw or crash, and a
// join's answer carries a token that names its job (job_of_token). At the end
// the state round-trips twice: the records the registry asked to persist, written to a state
// log and loaded back, give the registry's own snapshot (but for jobs still forming their first
// generation, which are not saved); and that snapshot, restored into a new
// registry, snapshots the same.
#include <google/protobuf/util/message_differencer.h>

#include <algorithm>
#include <memory>

#include "launcher/server/registry.h"
#include "launcher/server/state_dir.h"
#include "tests/fuzz/fuzz.h"
#include "tests/fuzz/saved_job.h"

namespace {

using namespace trn;
using namespace trn::control;
namespace v1 = ::trn::coordinator::v1;

void check(const Status& s) {
  if (!s.ok() && (s.message.empty() || s.message.find('\n') != std::string::npos))
    fuzz::fail(std::string("a refusal that is not one line: ") + to_string(s.code) + ": " + s.message);
}

template <typename M>
bool parse(std::string_view bytes, M* m) {
  return m->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()));
}

// The jobs of a snapshot, keyed by id (a log replays jobs in the order they were last written),
// as far as a comparison holds them to be equal:
//  - kSaved: what the registry saves. A forming job's rendezvous in progress (its node counts,
//    run id, members seen last, end time) is not saved: its agents join again after a restart.
//  - kRestored: what Registry::restore gives back, where a forming job gets an end time (so that
//    it expires if nobody joins it again).
enum class Compare { kAll, kSaved, kRestored };
std::map<std::string, std::string> jobs_of(const v1::Snapshot& s, Compare how = Compare::kAll) {
  std::map<std::string, std::string> out;
  for (v1::Snapshot::Job j : s.jobs()) {
    const bool forming = j.state() != "running" && j.state() != "completed" && j.state() != "failed" &&
                         j.state() != "stopped";
    if (forming && how != Compare::kAll) j.clear_ended_unix_ms();
    if (forming && how == Compare::kSaved) {
      j.clear_min_nodes();
      j.clear_max_nodes();
      j.clear_run_id();
      j.clear_last_member_ids();
    }
    // Rank 0's recovery figures are saved when its count of recoveries changes, not on every
    // heartbeat that refreshes them (Registry::record_rank): the log holds the count.
    if (how == Compare::kSaved) {
      const int64_t recoveries = j.has_recovery() ? j.recovery().recoveries() : 0;
      j.clear_recovery();
      if (recoveries != 0) j.mutable_recovery()->set_recoveries(recoveries);
    }
    const std::string id = j.job_id();
    out[id] = fuzz::canonical_job(std::move(j));
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fs = std::filesystem;
  const auto parts = fuzz::split(data, size, 64);
  Clock::time_point now = Clock::time_point() + std::chrono::hours(1);
  int64_t wall_ms = 1'800'000'000'000;
  std::vector<v1::LogRecord> persisted;
  RegistryOptions o;
  o.heartbeat_timeout = std::chrono::seconds(2);
  o.now = [&] { return now; };
  o.unix_ms = [&] { return wall_ms; };
  o.persist = [&](const v1::LogRecord& r) { persisted.push_back(r); };
  o.job_retention = std::chrono::seconds(30);
  o.job_token_key = "the coordinator's admin token";
  auto reg = std::make_unique<Registry>(o);
  std::vector<std::pair<std::string, std::string>> tokens;  // (job, token) of the joins answered

  for (const std::string_view part : parts) {
    if (part.empty()) continue;
    const std::string_view body = part.substr(1);
    switch (static_cast<unsigned char>(part[0]) % 12) {
      case 0: {
        v1::JoinRequest q;
        if (parse(body, &q))
          reg->join(q, [&tokens, id = q.job_id()](const Status& s, v1::JoinResponse r) {
            check(s);
            if (s.ok()) tokens.emplace_back(id, r.job_token());
          });
        break;
      }
      case 1: {
        v1::SetRequest q;
        if (parse(body, &q)) check(reg->set(q));
        break;
      }
      case 2: {
        v1::GetRequest q;
        if (parse(body, &q)) reg->get(q, [](const Status& s, std::string) { check(s); });
        break;
      }
      case 3: {
        v1::AddRequest q;
        int64_t v = 0;
        if (parse(body, &q)) check(reg->add(q, &v));
        break;
      }
      case 4: {
        v1::DeleteRequest q;
        bool deleted = false;
        if (parse(body, &q)) check(reg->del(q, &deleted));
        break;
      }
      case 5: {
        v1::BarrierRequest q;
        if (parse(body, &q)) reg->barrier(q, [](const Status& s, bool) { check(s); });
        break;
      }
      case 6: {
        v1::HeartbeatRequest q;
        v1::HeartbeatResponse r;
        if (parse(body, &q)) check(reg->heartbeat(q, &r));
        break;
      }
      case 7: {
        v1::ReportFailureRequest q;
        v1::ReportFailureResponse r;
        if (parse(body, &q)) check(reg->report_failure(q, &r));
        break;
      }
      case 8: {
        v1::FinishRequest q;
        v1::FinishResponse r;
        if (parse(body, &q)) check(reg->finish(q, &r));
        break;
      }
      case 9: {
        v1::ReportShardRequest q;
        v1::ReportShardResponse r;
        if (parse(body, &q)) check(reg->report_shard(q, &r));
        break;
      }
      case 10: {
        v1::GetStatusRequest q;
        v1::GetStatusResponse r;
        if (parse(body, &q)) check(reg->status(q, &r));
        break;
      }
      case 11: {  // time passes: the body's first byte in 100 ms steps
        const int steps = body.empty() ? 1 : static_cast<unsigned char>(body[0]);
        now += std::chrono::milliseconds(100) * steps;
        wall_ms += 100 * steps;
        break;
      }
    }
    now += std::chrono::milliseconds(10);
    wall_ms += 10;
    reg->tick();
    // A job's token names its job, and only it (a call may answer a join, so checked after it).
    for (const auto& [id, token] : tokens) {
      fuzz::require(!token.empty(), "a join was answered without the job's token");
      const auto whose = reg->job_of_token(token);  // none once the job was removed
      fuzz::require(!whose || *whose == id, "a job's token names another job");
    }
    tokens.clear();
  }
  reg->flush();
  const v1::Snapshot snap = reg->snapshot();
  reg->close();

  // The persisted records, through a real state log.
  const fs::path dir = fuzz::scratch() / "state";
  std::error_code ec;
  fs::remove_all(dir, ec);
  {
    StateDir log(dir.string());
    log.load();
    for (const auto& r : persisted) log.append(r);
  }
  StateDir log(dir.string());
  const v1::Snapshot loaded = log.load();
  // A job still forming its first generation is not saved (its agents join again after a restart).
  auto want = jobs_of(snap, Compare::kSaved), got = jobs_of(loaded, Compare::kSaved);
  for (const auto& j : snap.jobs())
    if (j.state() == "forming" && j.generation() == 0 && j.kv_size() == 0 && j.checkpoints_size() == 0) {
      want.erase(j.job_id());
      got.erase(j.job_id());
    }
  if (got != want)
    fuzz::fail("the state log of a registry's changes loads other jobs than it holds:\n" + loaded.DebugString() +
               "\nwhere the registry holds:\n" + snap.DebugString());

  Registry again(o);
  again.restore(snap);
  if (const v1::Snapshot back = again.snapshot(); jobs_of(back, Compare::kRestored) != jobs_of(snap, Compare::kRestored))
    fuzz::fail("a snapshot restored snapshots\n" + back.DebugString() + "\ninstead of\n" + snap.DebugString());
  again.close();
  return 0;
}
