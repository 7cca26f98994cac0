// Fuzz target: the datagrams workers send their trnrun agent (launcher/client/agent_channel.h),
// and the relay's handling of them (launcher/agent/heartbeat_relay.h: HeartbeatTable, the relay
// without its socket). Any process of the user may send to the agent's socket. An input's parts
// (fuzz.h): a script, then up to eight datagrams.
//
// Each datagram is decoded on its own (decode_worker_heartbeat): what decodes must encode again
// (encode_worker_heartbeat, the worker's side) to the same heartbeat. Round trip with the
// worker's encoder: a heartbeat made from the datagram's bytes, encoded and decoded, comes back
// the same (a goodput outside 0..1 comes back unknown, as recovery_to_proto says).
//
// The script drives a HeartbeatTable, up to 128 steps of a byte and their arguments: expect a
// generation and ranks, receive a datagram from one of four workers' addresses, take, abort,
// resume some ranks, resend, name a rank's process. A
// datagram counts exactly when it is a heartbeat of the job from one of the expected ranks in
// the expected generation; take() returns each rank heard since the last take once, with the
// newest progress, its age and how many arrived, and nothing the coordinator would refuse in a
// node heartbeat (negative coordinates); once any worker of the job heartbeated, it also returns
// a silent entry for each rank with a named process not heard in the generation, never older
// than that process and counting no beat; every answer the table sends decodes on the worker's
// side (decode_agent_answer) as what it was meant to be.
#include <google/protobuf/stubs/logging.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "launcher/agent/heartbeat_relay.h"
#include "launcher/client/agent_channel.h"
#include "tests/fuzz/fuzz.h"

namespace {

using namespace trn;
using namespace trn::control;
using trn::launch::HeartbeatTable;

bool same(double a, double b) { return a == b || (std::isnan(a) && std::isnan(b)); }

bool same(const RecoveryReport& a, const RecoveryReport& b) {
  return a.recoveries == b.recoveries && same(a.detect_to_generation_s, b.detect_to_generation_s) &&
         same(a.detect_to_restored_s, b.detect_to_restored_s) &&
         same(a.detect_to_first_step_s, b.detect_to_first_step_s) && a.restored_step == b.restored_step &&
         a.steps_lost == b.steps_lost && a.steps_lost_total == b.steps_lost_total &&
         a.replaced == b.replaced && same(a.goodput, b.goodput);
}

bool same(const MoeReport& a, const MoeReport& b) {
  return same(a.aux_loss, b.aux_loss) && a.max_mean.size() == b.max_mean.size() &&
         std::equal(a.max_mean.begin(), a.max_mean.end(), b.max_mean.begin(),
                    [](double x, double y) { return same(x, y); }) &&
         a.dead == b.dead && same(a.dropped, b.dropped);
}

bool same(const WorkerProgress& a, const WorkerProgress& b) {
  const auto coords = [](const std::optional<GridCoordinates>& c) {
    return c ? std::tuple(1, c->dp_rank, c->tp_rank, c->pp_rank) : std::tuple(0, 0, 0, 0);
  };
  return a.rank == b.rank && a.host == b.host && a.pid == b.pid && a.step == b.step && same(a.loss, b.loss) &&
         same(a.tokens_per_s, b.tokens_per_s) && coords(a.coordinates) == coords(b.coordinates) &&
         a.val_loss.has_value() == b.val_loss.has_value() &&
         (!a.val_loss || same(*a.val_loss, *b.val_loss)) &&
         a.recovery.has_value() == b.recovery.has_value() && (!a.recovery || same(*a.recovery, *b.recovery)) &&
         a.moe.has_value() == b.moe.has_value() && (!a.moe || same(*a.moe, *b.moe));
}

// Reads fixed-size values from the front of some bytes (zero once they run out).
struct Reader {
  std::string_view in;
  template <typename T>
  T get() {
    T v{};
    const size_t n = std::min(in.size(), sizeof(T));
    if (n) std::memcpy(&v, in.data(), n);
    in.remove_prefix(n);
    return v;
  }
};

// A worker's heartbeat made from bytes, as the worker's side would send it.
WorkerHeartbeat made_from(std::string_view bytes) {
  Reader r{bytes};
  WorkerHeartbeat h;
  const auto flags = r.get<uint8_t>();
  h.generation = r.get<int64_t>();
  auto& p = h.progress;
  p.rank = r.get<int32_t>() & 0x7fffffff;
  p.pid = r.get<int64_t>();
  p.step = r.get<int64_t>();
  p.loss = r.get<double>();
  p.tokens_per_s = r.get<double>();
  if (flags & 1) p.coordinates = GridCoordinates{r.get<uint16_t>(), r.get<uint16_t>(), r.get<uint16_t>()};
  if (flags & 2) p.val_loss = r.get<double>();
  if (flags & 4) {
    RecoveryReport rr;
    rr.recoveries = r.get<int64_t>();
    rr.detect_to_generation_s = r.get<double>();
    rr.restored_step = r.get<int64_t>();
    rr.goodput = r.get<double>();
    p.recovery = rr;
  }
  if (flags & 8) {
    MoeReport m;
    m.aux_loss = r.get<double>();
    for (int l = r.get<uint8_t>() % 8; l > 0; --l) {
      m.max_mean.push_back(r.get<double>());
      m.dead.push_back(r.get<int32_t>());
    }
    m.dropped = r.get<double>();
    p.moe = m;
  }
  // A host name and a job id as trn makes them: letters, digits, '-', '_' and '.'
  // (validate_job_id); proto3 strings are UTF-8, so other bytes would not parse.
  const auto name = [](std::string_view b) {
    static constexpr std::string_view kChars =
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.";
    std::string s;
    for (char c : b) s += kChars[static_cast<unsigned char>(c) % kChars.size()];
    return s;
  };
  const size_t want = r.get<uint8_t>();  // read first: it shortens r.in
  const size_t host = std::min(want, r.in.size());
  p.host = name(r.in.substr(0, host));
  h.job_id = name(r.in.substr(host));
  return h;
}

void round_trips(std::string_view datagram) {
  if (const auto h = decode_worker_heartbeat(datagram.data(), datagram.size())) {
    fuzz::require(h->progress.rank >= 0, "a heartbeat of a negative rank decoded");
    const auto& c = h->progress.coordinates;
    fuzz::require(!c || (c->dp_rank >= 0 && c->tp_rank >= 0 && c->pp_rank >= 0),
                  "a heartbeat with negative coordinates decoded");
    const std::string again = encode_worker_heartbeat(h->job_id, h->generation, h->progress);
    const auto back = decode_worker_heartbeat(again.data(), again.size());
    fuzz::require(back && back->job_id == h->job_id && back->generation == h->generation &&
                      same(back->progress, h->progress),
                  "a heartbeat encoded again decodes differently");
  }
  WorkerHeartbeat h = made_from(datagram);
  const std::string bytes = encode_worker_heartbeat(h.job_id, h.generation, h.progress);
  if (bytes.size() > kMaxAgentDatagram) return;  // the worker's job id is not this long
  const auto back = decode_worker_heartbeat(bytes.data(), bytes.size());
  if (h.progress.recovery) {
    double& g = h.progress.recovery->goodput;
    if (!(std::isfinite(g) && g >= 0 && g <= 1)) g = -1;
  }
  fuzz::require(back && back->job_id == h.job_id && back->generation == h.generation &&
                    same(back->progress, h.progress),
                "a worker's heartbeat does not come back as it was encoded");
}

void check_sends(const std::vector<HeartbeatTable::Send>& sends, bool abort, const std::string& reason,
                 int64_t generation, int world_size, int node_rank, bool exact_rank) {
  for (const auto& s : sends) {
    const auto a = decode_agent_answer(s.bytes.data(), s.bytes.size());
    fuzz::require(a.has_value(), "the agent sent an answer its worker does not take");
    fuzz::require(a->abort == abort, "the agent sent another answer than it meant");
    if (abort) {
      fuzz::require(a->reason == reason, "an abort lost its reason");
    } else if (exact_rank) {
      fuzz::require(a->resume.generation == generation && a->resume.rank == s.rank &&
                        a->resume.world_size == world_size && a->resume.node_rank == node_rank,
                    "a resume says another place than the agent's");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool quiet = (google::protobuf::SetLogHandler(nullptr), true);  // a string that is not UTF-8
  (void)quiet;
  const auto parts = fuzz::split(data, size, 9);
  const std::vector<std::string_view> datagrams(parts.begin() + 1, parts.end());
  std::vector<std::optional<WorkerHeartbeat>> decoded;  // each datagram decoded once, for the checks below
  for (auto d : datagrams) {
    round_trips(d);
    decoded.push_back(decode_worker_heartbeat(d.data(), d.size()));
  }
  if (datagrams.empty()) return 0;

  const std::string job = "fuzz-job";
  HeartbeatTable table(job);
  HeartbeatTable::Address from[4];
  for (int i = 0; i < 4; ++i) {
    from[i].addr.sun_family = AF_UNIX;
    from[i].addr.sun_path[1] = static_cast<char>('a' + i);  // abstract, as a worker's autobind
    from[i].len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 2);
  }
  auto now = Clock::time_point{} + std::chrono::hours(1);
  // What take() must return: per rank, the newest progress counted since the last take, when, how many.
  struct Heard {
    WorkerProgress progress;
    Clock::time_point at;
    int beats = 0;
  };
  std::map<int, Heard> heard;
  // For the silent entries: each rank's named process (started()), the ranks heard in the
  // expected generation, and whether any worker of the job has heartbeated.
  struct Named {
    int64_t pid;
    Clock::time_point at;
  };
  std::map<int, Named> named;
  std::set<int> heard_in_generation;
  bool any_beat = false;

  Reader script{parts[0]};
  for (int step = 0; !script.in.empty() && step < 128; ++step) {
    switch (script.get<uint8_t>() % 7) {
      case 0: {  // expect
        const int64_t generation = script.get<uint8_t>() % 4;
        const int first = script.get<uint8_t>() % 8, count = 1 + script.get<uint8_t>() % 4;
        table.expect(generation, first, count);
        heard.clear();
        named.clear();
        heard_in_generation.clear();
        break;
      }
      case 1: {  // a datagram arrives
        const size_t k = script.get<uint8_t>() % datagrams.size();
        const auto d = datagrams[k];
        const auto& who = from[script.get<uint8_t>() % 4];
        now += std::chrono::milliseconds(script.get<uint8_t>());
        const auto& beat = decoded[k];
        const bool counts = beat && beat->job_id == job && beat->generation == table.generation() &&
                            beat->progress.rank >= table.first_rank() &&
                            beat->progress.rank < table.first_rank() + table.count();
        any_beat = any_beat || (beat && beat->job_id == job && beat->progress.rank >= table.first_rank() &&
                                beat->progress.rank < table.first_rank() + table.count());
        fuzz::require(table.receive(d.data(), d.size(), who, now) == counts,
                      counts ? "a heartbeat of an expected rank was ignored"
                             : "a datagram that is no heartbeat counted");
        if (counts) {
          heard_in_generation.insert(beat->progress.rank);
          auto& h = heard[beat->progress.rank];
          h.progress = beat->progress;
          h.at = now;
          ++h.beats;
          fuzz::require(table.silent_for(beat->progress.rank, now) == Duration::zero(),
                        "a rank heard now is silent");
        }
        break;
      }
      case 2: {  // the node heartbeat
        now += std::chrono::milliseconds(script.get<uint8_t>());
        const auto out = table.take(now);
        std::set<int> silent;
        for (const auto& [rank, n] : named)
          if (any_beat && !heard_in_generation.count(rank)) silent.insert(rank);
        fuzz::require(out.size() == heard.size() + silent.size(), "take() returned other ranks than were heard");
        for (const auto& f : out) {
          if (f.silent) {
            const auto n = named.find(f.progress.rank);
            fuzz::require(silent.erase(f.progress.rank) == 1 && n != named.end(),
                          "a silent entry for a rank heard in the generation, or with no process");
            fuzz::require(f.beats == 0 && f.progress.pid == n->second.pid && f.age >= Duration::zero() &&
                              f.age <= now - n->second.at,
                          "a silent entry older than its process, or counting beats");
            continue;
          }
          auto it = heard.find(f.progress.rank);
          fuzz::require(it != heard.end(), "take() returned a rank not heard since the last take");
          fuzz::require(f.beats == it->second.beats && f.age == now - it->second.at &&
                            same(f.progress, it->second.progress),
                        "take() returned another heartbeat than the newest, or a wrong count or age");
          const auto& c = f.progress.coordinates;
          fuzz::require(!c || (c->dp_rank >= 0 && c->tp_rank >= 0 && c->pp_rank >= 0),
                        "take() forwards coordinates the coordinator refuses");
          heard.erase(it);
        }
        break;
      }
      case 3: {  // the generation ended
        const std::string reason = "generation ended";
        const int64_t generation = table.generation() + 1;
        check_sends(table.abort(reason, generation), true, reason, generation, 0, 0, false);
        break;
      }
      case 4: {  // resume some of the ranks (and some that are not this node's)
        const unsigned pick = script.get<uint8_t>();
        const int64_t generation = script.get<uint8_t>() % 4;
        std::vector<int> ranks;
        for (int b = 0; b < 8; ++b)
          if (pick & (1u << b)) ranks.push_back(table.first_rank() + b - 2);
        const int world = table.first_rank() + table.count() + 4, node = script.get<uint8_t>() % 4;
        const auto sends = table.resume(generation, ranks, world, node);
        for (const auto& s : sends)
          fuzz::require(s.rank >= table.first_rank() && s.rank < table.first_rank() + table.count(),
                        "a resume went to a rank of another node");
        check_sends(sends, false, "", generation, world, node, true);
        for (int r : table.resume_pending())
          fuzz::require(r >= table.first_rank() && r < table.first_rank() + table.count(),
                        "a rank of another node waits for a resume");
        break;
      }
      case 5:  // the resumes again
        check_sends(table.resend_resume(), false, "", 0, 0, 0, false);
        break;
      case 6: {  // the agent names a rank's process (some not this node's)
        const int rank = table.first_rank() - 1 + script.get<uint8_t>() % (table.count() + 2);
        const int64_t pid = 1000 + script.get<uint8_t>();
        now += std::chrono::milliseconds(script.get<uint8_t>());
        table.started(rank, pid, now);
        if (rank >= table.first_rank() && rank < table.first_rank() + table.count()) named[rank] = {pid, now};
        break;
      }
    }
  }
  return 0;
}
