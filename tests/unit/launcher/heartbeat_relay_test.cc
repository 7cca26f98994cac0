// The worker-to-agent heartbeat channel over real Unix sockets: the agent's relay keeps the
// newest heartbeat of each local rank and hands it over once; the worker's channel hears aborts
// from its agent only.
#include <catch2/catch.hpp>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <filesystem>
#include <thread>

#include "collectives/core/error.h"
#include "launcher/agent/heartbeat_relay.h"
#include "launcher/client/agent_channel.h"
#include "tests/support/process.h"
#include "trn/coordinator/v1/coordinator.pb.h"

using namespace trn;
using namespace trn::control;
using namespace trn::launch;
using namespace std::chrono_literals;

namespace {

WorkerProgress progress(int rank, int64_t step) {
  return {rank, "h", 100 + rank, step, 1.5, 10.0, GridCoordinates{rank, 0, 0}};
}

// Waits until the relay has ignored n datagrams: everything sent before has been handled too.
void wait_ignored(const HeartbeatRelay& relay, int64_t n) {
  auto until = std::chrono::steady_clock::now() + 10s;
  while (relay.ignored() < n && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(5ms);
  REQUIRE(relay.ignored() == n);
}

// The next datagram the agent sent to channel's socket, read raw (the worker's own parsing is not
// under test here), waiting up to `wait`; nullopt when none came.
std::optional<coordinator::v1::HeartbeatResponse> next_reply(const AgentChannel& channel,
                                                             std::chrono::milliseconds wait = 2000ms) {
  pollfd p{channel.fd(), POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(wait.count())) <= 0) return std::nullopt;
  char buf[4096];
  ssize_t n = ::recv(channel.fd(), buf, sizeof buf, MSG_DONTWAIT);
  if (n < 0) return std::nullopt;
  coordinator::v1::HeartbeatResponse resp;
  REQUIRE(resp.ParseFromArray(buf, static_cast<int>(n)));
  return resp;
}

// Waits until the relay has heard rank (in any generation).
void wait_heard(const HeartbeatRelay& relay, int rank) {
  auto until = std::chrono::steady_clock::now() + 10s;
  while (!relay.silent_for(rank) && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(5ms);
  REQUIRE(relay.silent_for(rank));
}

}  // namespace

TEST_CASE("heartbeat relay: the newest heartbeat of each local rank, once, counted; other jobs, generations and ranks ignored") {
  HeartbeatRelay relay("job");
  relay.expect(3, 4, 2);  // generation 3, ranks 4 and 5
  AgentChannel a(relay.socket_path()), b(relay.socket_path()), c(relay.socket_path());
  CHECK(a.send("job", 3, progress(4, 7)) == AgentChannel::Sent::kOk);
  CHECK(a.send("job", 3, progress(4, 8)) == AgentChannel::Sent::kOk);
  CHECK(b.send("job", 3, progress(5, 2)) == AgentChannel::Sent::kOk);
  c.send("job", 2, progress(5, 99));    // a worker of the last generation, still stopping
  c.send("other", 3, progress(5, 99));  // another job
  c.send("job", 3, progress(6, 99));    // not a rank of this node
  wait_ignored(relay, 3);

  auto got = relay.take();
  REQUIRE(got.size() == 2);
  CHECK(got[0].progress.rank == 4);
  CHECK(got[0].progress.step == 8);
  CHECK(got[0].beats == 2);
  REQUIRE(got[0].progress.coordinates);
  CHECK(got[0].progress.coordinates->dp_rank == 4);
  CHECK(got[0].progress.pid == 104);
  CHECK(got[0].age >= Duration::zero());
  CHECK(got[1].progress.rank == 5);
  CHECK(got[1].progress.step == 2);
  CHECK(got[1].beats == 1);
  CHECK(relay.take().empty());  // nothing new since: a silent rank is absent

  // A new generation forgets the old one's ranks.
  CHECK(a.send("job", 3, progress(4, 9)) == AgentChannel::Sent::kOk);
  c.send("job", 2, progress(4, 1));
  wait_ignored(relay, 4);
  relay.expect(4, 4, 2);
  CHECK(relay.take().empty());
}

TEST_CASE("heartbeat relay: an abort goes back to the workers it heard from, and a worker hears it from its agent only") {
  HeartbeatRelay relay("job");
  relay.expect(0, 0, 2);
  AgentChannel a(relay.socket_path()), silent(relay.socket_path());
  a.send("job", 0, progress(0, 1));
  silent.send("other", 0, progress(1, 1));  // ignored: never told anything
  wait_ignored(relay, 1);

  // Someone else on the host sends the worker an abort: ignored.
  sockaddr_un worker{};
  socklen_t len = sizeof worker;
  REQUIRE(::getsockname(a.fd(), reinterpret_cast<sockaddr*>(&worker), &len) == 0);
  int stranger = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  coordinator::v1::HeartbeatResponse fake;
  fake.set_abort(true);
  fake.set_reason("not from the agent");
  std::string bytes = fake.SerializeAsString();
  REQUIRE(::sendto(stranger, bytes.data(), bytes.size(), 0, reinterpret_cast<sockaddr*>(&worker), len) > 0);
  ::close(stranger);
  CHECK_FALSE(a.receive());

  relay.tell_abort("the generation moved on: rank 1 failed", 1);
  auto reason = a.receive();
  REQUIRE(reason);
  CHECK(*reason == "the generation moved on: rank 1 failed");
  CHECK_FALSE(silent.receive());
}

TEST_CASE("agent channel: a socket nobody listens on is gone, and the relay's socket goes with the relay") {
  test::TempDir dir;
  AgentChannel nobody(dir.path() + "/none.sock");
  CHECK(nobody.send("job", 0, progress(0, 1)) == AgentChannel::Sent::kGone);
  CHECK_FALSE(nobody.error().empty());
  std::string path;
  {
    HeartbeatRelay relay("job", dir.path());
    path = relay.socket_path();
    CHECK(std::filesystem::path(path).parent_path() == std::filesystem::path(dir.path()));
    CHECK(std::filesystem::exists(path));
  }
  CHECK_FALSE(std::filesystem::exists(path));
  CHECK(std::filesystem::exists(dir.path()));  // the folder it was given stays
  CHECK_THROWS_AS(AgentChannel(std::string(200, 'x')), Error);
}

TEST_CASE("heartbeat relay: survivors heartbeating their old generation are told to resume in the new one until "
          "they heartbeat there") {
  HeartbeatRelay relay("job");
  relay.expect(0, 4, 3);
  AgentChannel survivor(relay.socket_path()), dead(relay.socket_path());
  survivor.send("job", 0, progress(4, 10));
  dead.send("job", 0, progress(5, 10));
  wait_heard(relay, 4);
  wait_heard(relay, 5);

  // Generation 1 on the same ranks: the addresses stay, though nothing of generation 1 arrived.
  relay.expect(1, 4, 3);
  survivor.send("job", 0, progress(4, 11));  // still in generation 0: ignored for the coordinator
  // Rank 6 is first heard after the generation ended, still in generation 0: reachable too.
  AgentChannel late(relay.socket_path());
  late.send("job", 0, progress(6, 3));
  wait_ignored(relay, 2);
  CHECK(relay.take().empty());

  CHECK(relay.tell_resume(1, {4, 6}) == 2);
  for (AgentChannel* worker : {&survivor, &late}) {
    auto resume = next_reply(*worker);
    REQUIRE(resume);
    CHECK_FALSE(resume->abort());
    CHECK(resume->generation() == 1);
    CHECK(resume->reason() == "resume");
  }
  CHECK_FALSE(next_reply(dead, 200ms));  // not a survivor: never told
  CHECK(relay.resume_pending() == std::vector<int>{4, 6});

  // Until a rank heartbeats in generation 1 every resend tells it again.
  late.send("job", 1, progress(6, 4));
  auto heard = std::chrono::steady_clock::now() + 10s;
  while (relay.resume_pending().size() != 1 && std::chrono::steady_clock::now() < heard)
    std::this_thread::sleep_for(5ms);
  CHECK(relay.resume_pending() == std::vector<int>{4});
  CHECK(relay.resend_resume() == 1);
  REQUIRE(next_reply(survivor));
  CHECK_FALSE(next_reply(late, 200ms));
  survivor.send("job", 1, progress(4, 12));
  auto until = std::chrono::steady_clock::now() + 10s;
  while (!relay.resume_pending().empty() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(5ms);
  auto got = relay.take();
  REQUIRE(got.size() == 2);
  CHECK(got[0].progress.rank == 4);
  CHECK(got[0].progress.step == 12);
  CHECK(got[1].progress.rank == 6);
  CHECK(relay.resume_pending().empty());
  CHECK(relay.resend_resume() == 0);
  CHECK_FALSE(next_reply(survivor, 200ms));
}

TEST_CASE("heartbeat relay: an abort reaches a survivor told to resume before it heartbeats in the new generation") {
  HeartbeatRelay relay("job");
  relay.expect(0, 0, 2);
  AgentChannel survivor(relay.socket_path()), replacement(relay.socket_path());
  survivor.send("job", 0, progress(0, 1));
  wait_heard(relay, 0);
  relay.expect(1, 0, 2);
  CHECK(relay.tell_resume(1, {0}) == 1);
  REQUIRE(next_reply(survivor));
  replacement.send("job", 1, progress(1, 0));  // the dead rank 1's replacement, started in generation 1
  wait_heard(relay, 1);

  relay.tell_abort("generation 1 ended: rank 1 failed", 2);
  auto a = next_reply(survivor);
  REQUIRE(a);
  CHECK(a->abort());
  CHECK(a->reason() == "generation 1 ended: rank 1 failed");
  auto b = next_reply(replacement);
  REQUIRE(b);
  CHECK(b->abort());
}

TEST_CASE("heartbeat relay: a rank's newest address wins, an older generation never moves it back, and a new rank "
          "range forgets them") {
  HeartbeatRelay relay("job");
  relay.expect(1, 0, 1);
  AgentChannel old_worker(relay.socket_path()), new_worker(relay.socket_path());
  new_worker.send("job", 1, progress(0, 1));
  wait_heard(relay, 0);
  old_worker.send("job", 0, progress(0, 1));  // a worker of generation 0 (still stopping) claiming rank 0
  wait_ignored(relay, 1);
  relay.tell_abort("moved on", 2);
  REQUIRE(next_reply(new_worker));
  CHECK_FALSE(next_reply(old_worker, 200ms));

  // Silence is measured from the newest datagram of any generation.
  std::this_thread::sleep_for(150ms);
  auto silent = relay.silent_for(0);
  REQUIRE(silent);
  CHECK(*silent >= 150ms);
  CHECK_FALSE(relay.silent_for(1));  // never heard

  // Other ranks (the node's place in the job changed): nothing kept to resume.
  relay.expect(2, 4, 1);
  CHECK_FALSE(relay.silent_for(0));
  CHECK(relay.tell_resume(2, {0}) == 0);
  CHECK_FALSE(next_reply(new_worker, 200ms));
}

TEST_CASE("heartbeat relay: a worker's recovery report is forwarded whole, and dropped once it sends none") {
  HeartbeatRelay relay("job");
  relay.expect(2, 0, 1);
  AgentChannel worker(relay.socket_path());
  // What the relay hands over next, waiting for the datagram to arrive.
  auto next = [&] {
    auto until = std::chrono::steady_clock::now() + 10s;
    std::vector<ForwardedHeartbeat> got;
    while ((got = relay.take()).empty() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(5ms);
    REQUIRE(got.size() == 1);
    return got[0].progress;
  };

  auto p = progress(0, 1201);
  p.recovery = RecoveryReport{3, 0.12, 0.30, 0.45, 1200, 2, 5, 1, 0.965};
  REQUIRE(worker.send("job", 2, p) == AgentChannel::Sent::kOk);
  auto got = next();
  REQUIRE(got.recovery);
  const auto& r = *got.recovery;
  CHECK(r.recoveries == 3);
  CHECK(r.detect_to_generation_s == 0.12);
  CHECK(r.detect_to_restored_s == 0.30);
  CHECK(r.detect_to_first_step_s == 0.45);
  CHECK(r.restored_step == 1200);
  CHECK(r.steps_lost == 2);
  CHECK(r.steps_lost_total == 5);
  CHECK(r.replaced == 1);
  CHECK(r.goodput == 0.965);

  // An unknown goodput stays unknown on the way.
  p.recovery->goodput = -1;
  REQUIRE(worker.send("job", 2, p) == AgentChannel::Sent::kOk);
  got = next();
  REQUIRE(got.recovery);
  CHECK(got.recovery->goodput == -1);
  CHECK(got.recovery->recoveries == 3);

  // A heartbeat without one (a worker started anew) forwards none: nothing stale is kept.
  p.recovery.reset();
  REQUIRE(worker.send("job", 2, p) == AgentChannel::Sent::kOk);
  CHECK_FALSE(next().recovery);
}

TEST_CASE(
    "heartbeat table: a heartbeat the coordinator would refuse is dropped, not forwarded with the node's") {
  // A node heartbeat forwarding negative coordinates is refused whole by the coordinator, which
  // would silence every rank of the node: the agent drops such a datagram as malformed.
  HeartbeatTable table("job");
  table.expect(1, 0, 2);
  const auto now = Clock::now();
  HeartbeatTable::Address from;
  WorkerProgress bad = progress(0, 5);
  bad.coordinates = GridCoordinates{0, -1, 0};
  const std::string bad_bytes = encode_worker_heartbeat("job", 1, bad);
  CHECK_FALSE(decode_worker_heartbeat(bad_bytes.data(), bad_bytes.size()));
  CHECK_FALSE(table.receive(bad_bytes.data(), bad_bytes.size(), from, now));
  const std::string good = encode_worker_heartbeat("job", 1, progress(1, 5));
  CHECK(table.receive(good.data(), good.size(), from, now));
  CHECK(table.receive("garbage", 7, from, now) == false);
  CHECK(table.ignored() == 2);
  const auto got = table.take(now + 1s);
  REQUIRE(got.size() == 1);
  CHECK(got[0].progress.rank == 1);
  CHECK(got[0].age == 1s);
}

TEST_CASE(
    "heartbeat table: once the workers heartbeat, a rank not heard in the generation goes as a silent entry, "
    "aged from its last sign of life") {
  HeartbeatTable table("job");
  table.expect(1, 0, 3);
  const auto t0 = Clock::now();
  for (int r : {0, 1, 2}) table.started(r, 100 + r, t0);
  HeartbeatTable::Address from;
  // No worker has heartbeated: perhaps a program that never does, which its node speaks for.
  CHECK(table.take(t0 + 1s).empty());
  const std::string beat0 = encode_worker_heartbeat("job", 1, progress(0, 5));
  REQUIRE(table.receive(beat0.data(), beat0.size(), from, t0 + 1s));
  // Rank 2 still heartbeats the generation before (kept through an in-place recovery).
  const std::string old2 = encode_worker_heartbeat("job", 0, progress(2, 4));
  CHECK_FALSE(table.receive(old2.data(), old2.size(), from, t0 + 1500ms));
  auto of = [](const std::vector<ForwardedHeartbeat>& v, int rank) -> const ForwardedHeartbeat* {
    for (const auto& f : v)
      if (f.progress.rank == rank) return &f;
    return nullptr;
  };
  auto got = table.take(t0 + 2s);
  REQUIRE(got.size() == 3);
  REQUIRE(of(got, 0));
  CHECK_FALSE(of(got, 0)->silent);
  CHECK(of(got, 0)->beats == 1);
  REQUIRE(of(got, 1));  // never heard: aged from its start
  CHECK(of(got, 1)->silent);
  CHECK(of(got, 1)->beats == 0);
  CHECK(of(got, 1)->progress.pid == 101);
  CHECK(of(got, 1)->age == 2s);
  REQUIRE(of(got, 2));  // aged from its heartbeat of the generation before
  CHECK(of(got, 2)->silent);
  CHECK(of(got, 2)->age == 500ms);
  // Heard in the generation, a rank goes as itself from then on.
  const std::string beat1 = encode_worker_heartbeat("job", 1, progress(1, 6));
  REQUIRE(table.receive(beat1.data(), beat1.size(), from, t0 + 2s));
  got = table.take(t0 + 3s);
  REQUIRE(got.size() == 2);
  REQUIRE(of(got, 1));
  CHECK_FALSE(of(got, 1)->silent);
  REQUIRE(of(got, 2));
  CHECK(of(got, 2)->silent);
  // A process that exited is not reported silent.
  table.exited(2);
  CHECK(table.take(t0 + 4s).empty());
  // A new generation forgets the processes until the agent names them again.
  table.started(2, 202, t0 + 4s);
  table.expect(2, 0, 3);
  CHECK(table.take(t0 + 5s).empty());
}

TEST_CASE("heartbeat table: what is owed to a rank moves with it when the node's ranks move") {
  // A resume carries the rank it resumes as: resent after the node's ranks moved, it still goes
  // to the worker it was made for, never another worker's resume to it.
  HeartbeatTable table("job");
  table.expect(1, 0, 2);
  HeartbeatTable::Address a, b;
  a.addr.sun_path[1] = 'a';
  a.len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 2);
  b.addr.sun_path[1] = 'b';
  b.len = a.len;
  const auto now = Clock::now();
  for (int r : {0, 1}) {
    const std::string beat = encode_worker_heartbeat("job", 1, progress(r, 5));
    REQUIRE(table.receive(beat.data(), beat.size(), r == 0 ? a : b, now));
  }
  REQUIRE(table.resume(2, {0, 1}, 4, 0).size() == 2);
  table.expect(2, 1, 2);  // the node's ranks are 1 and 2 now: worker a is rank 1, b is rank 2
  const auto sends = table.resend_resume();
  REQUIRE(sends.size() == 2);
  for (const auto& s : sends) {
    const auto answer = decode_agent_answer(s.bytes.data(), s.bytes.size());
    REQUIRE(answer);
    CHECK(s.to.addr.sun_path[1] == (s.rank == 1 ? 'a' : 'b'));
    CHECK(answer->resume.rank == s.rank - 1);  // what that worker was told before the move
  }
}
