// The worker-to-agent heartbeat channel over real Unix sockets: the agent's relay keeps the
// newest heartbeat of each local rank and hands it over once; the worker's channel hears aborts
// from its agent only.
#include <catch2/catch.hpp>
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
