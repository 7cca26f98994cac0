#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "collectives/core/aligned.h"
#include "collectives/core/error.h"
#include "collectives/engine.h"
#include "tests/unit/collectives/local_world.h"

using namespace trn;
using namespace trn::test;
using namespace std::chrono_literals;

namespace {

CommOptions opts(Algo algo = Algo::kAuto, Duration timeout = 20s, bool check = false) {
  CommOptions o;
  o.algo = algo;
  o.timeout = timeout;
  o.check = check;
  o.chunk_bytes = 64;
  return o;
}

}  // namespace

TEST_CASE("split makes sub-communicators ordered by key that run beside their parent") {
  LocalWorld world(6, opts());
  auto res = world.run([](Communicator& comm, int r) -> std::string {
    auto sub = comm.split(r % 2, -r);  // evens and odds, each in reverse order
    if (!sub) return "no communicator";
    if (sub->size() != 3) return "size " + std::to_string(sub->size());
    if (sub->rank() != 2 - r / 2) return "rank " + std::to_string(sub->rank());
    if (sub->id() == comm.id()) return "same id as the parent";
    // Interleave operations on the parent and the child.
    int32_t mine = r, sum_sub = 0, sum_all = 0;
    auto a = sub->all_reduce(&mine, &sum_sub, 1, DataType::kI32, ReduceOp::kSum);
    auto b = comm.all_reduce(&mine, &sum_all, 1, DataType::kI32, ReduceOp::kSum);
    a->wait(Deadline::after(20s));
    b->wait(Deadline::after(20s));
    if (sum_sub != (r % 2 ? 1 + 3 + 5 : 0 + 2 + 4)) return "sub sum " + std::to_string(sum_sub);
    if (sum_all != 15) return "world sum " + std::to_string(sum_all);
    // A rank that passes a negative color joins nothing.
    auto none = comm.split(r == 0 ? -1 : 7, 0);
    if ((r == 0) != (none == nullptr)) return "negative color";
    if (none && none->size() != 5) return "size of color 7";
    // Grand-children get ids of their own too.
    auto g = sub->split(0, r);
    int32_t one = 1, n = 0;
    g->all_reduce(&one, &n, 1, DataType::kI32, ReduceOp::kSum)->wait(Deadline::after(20s));
    if (n != 3) return "grandchild sum";
    if (g->id() == sub->id() || (none && g->id() == none->id())) return "reused id";
    return "";
  });
  CHECK(first_failure(res) == "");
}

TEST_CASE("operations are asynchronous and complete in issue order") {
  LocalWorld world(4, opts());
  auto res = world.run([](Communicator& comm, int r) -> std::string {
    constexpr int kOps = 12;
    std::vector<std::vector<float>> bufs(kOps, std::vector<float>(1000));
    std::vector<WorkPtr> works;
    for (int i = 0; i < kOps; ++i) {
      std::fill(bufs[i].begin(), bufs[i].end(), float(r + i));
      works.push_back(comm.all_reduce(bufs[i].data(), bufs[i].data(), 1000, DataType::kF32, ReduceOp::kSum));
    }
    works.back()->wait(Deadline::after(20s));
    for (int i = 0; i < kOps; ++i) {
      if (!works[i]->test()) return "operation " + std::to_string(i) + " finished after the last";
      if (bufs[i][999] != float(6 + 4 * i)) return "wrong sum in operation " + std::to_string(i);
    }
    return "";
  });
  CHECK(first_failure(res) == "");
}

TEST_CASE("blocking calls mixed with queued collectives and point-to-point keep issue order") {
  // A wait may run its collective on the waiting thread (engine idle, the collective next in
  // line) or leave it to the engine (something queued before it, a receive pending): the
  // results and their order must not tell the difference.
  LocalWorld world(3, opts());
  auto res = world.run([](Communicator& comm, int r) -> std::string {
    const int right = (r + 1) % 3, left = (r + 2) % 3;
    for (int round = 0; round < 50; ++round) {
      std::vector<float> big(3000, float(r + round)), small(7, float(r * round));
      auto w_big = comm.all_reduce(big.data(), big.data(), big.size(), DataType::kF32, ReduceOp::kSum);
      // Queued behind w_big: this wait cannot run it inline until w_big is done.
      comm.all_reduce(small.data(), small.data(), small.size(), DataType::kF32, ReduceOp::kMax)->wait();
      if (!w_big->test()) return "a later collective completed before an earlier one";
      if (big[2999] != float(3 + 3 * round)) return "wrong sum in round " + std::to_string(round);
      if (small[6] != float(2 * round)) return "wrong max in round " + std::to_string(round);
      // A receive pending on the engine: the blocking collective behind it waits its turn.
      int64_t out = r * 100 + round, in = -1;
      auto recv = comm.recv(&in, 1, DataType::kI64, left);
      auto send = comm.send(&out, 1, DataType::kI64, right);
      int32_t v = 1, sum = 0;
      comm.all_reduce(&v, &sum, 1, DataType::kI32, ReduceOp::kSum)->wait();
      if (!recv->test() || !send->test()) return "a collective completed before the point-to-point issued first";
      if (in != left * 100 + round || sum != 3) return "wrong values in round " + std::to_string(round);
    }
    return "";
  });
  CHECK(first_failure(res) == "");
}

TEST_CASE("point-to-point messages match in issue order and a count mismatch is an error") {
  LocalWorld world(3, opts());
  auto res = world.run([](Communicator& comm, int r) -> std::string {
    int right = (r + 1) % 3, left = (r + 2) % 3;
    int64_t out[2] = {r * 10, r * 10 + 1}, in[2] = {-1, -1};
    auto s0 = comm.send(&out[0], 1, DataType::kI64, right);
    auto s1 = comm.send(&out[1], 1, DataType::kI64, right);
    auto r0 = comm.recv(&in[0], 1, DataType::kI64, left);
    auto r1 = comm.recv(&in[1], 1, DataType::kI64, left);
    r1->wait(Deadline::after(20s));  // r0 completed first: same peer, same direction
    std::string result;
    if (!r0->test()) result = "the second receive completed before the first";
    else if (in[0] != left * 10 || in[1] != left * 10 + 1) result = "out of order";
    s0->wait(Deadline::after(20s));  // out must outlive the sends
    s1->wait(Deadline::after(20s));
    return result;
  });
  CHECK(first_failure(res) == "");

  LocalWorld w2(2, opts());
  auto res2 = w2.run([](Communicator& comm, int r) -> std::string {
    int32_t v[2] = {1, 2};
    auto w = r == 0 ? comm.send(v, 1, DataType::kI32, 1) : comm.recv(v, 2, DataType::kI32, 0);
    w->wait(Deadline::after(20s));
    return "";
  });
  CHECK_THAT(res2[1], Catch::Contains("received 4 bytes but expected 8"));
}

TEST_CASE("TRN_CHECK_COLLECTIVES: mismatched calls fail on every rank naming both sides") {
  LocalWorld world(3, opts(Algo::kAuto, 20s, true));
  auto res = world.run([](Communicator& comm, int r) -> std::string {
    std::vector<float> buf(10, 1.0f);
    WorkPtr w = r == 1 ? comm.broadcast(buf.data(), 10, DataType::kF32, 0)
                       : comm.all_reduce(buf.data(), buf.data(), 10, DataType::kF32, ReduceOp::kSum);
    try {
      w->wait(Deadline::after(20s));
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  });
  for (const auto& e : res) {
    CHECK_THAT(e, Catch::Contains("ranks 0,2 called all_reduce(count=10, f32, sum)"));
    CHECK_THAT(e, Catch::Contains("rank 1 called broadcast(count=10, f32, root=0)"));
  }
  LocalWorld w2(2, opts(Algo::kAuto, 20s, true));
  auto res2 = w2.run([](Communicator& comm, int r) -> std::string {
    std::vector<double> buf(8, 1.0);
    try {
      comm.all_reduce(buf.data(), buf.data(), r ? 8 : 7, DataType::kF64, ReduceOp::kMax)->wait(Deadline::after(20s));
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  });
  CHECK_THAT(res2[0], Catch::Contains("rank 0 called all_reduce(count=7, f64, max); rank 1 called all_reduce(count=8"));
}

TEST_CASE("a missing peer turns into a timeout, and a failed communicator fails what follows") {
  LocalWorld world(3, opts(Algo::kRing, 1s));
  auto res = world.run([](Communicator& comm, int r) -> std::string {
    if (r == 2) return "";  // never joins
    float x = 1;
    auto first = comm.all_reduce(&x, &x, 1, DataType::kF32, ReduceOp::kSum);
    auto second = comm.barrier();
    std::string out;
    try {
      first->wait(Deadline::after(20s));
      out = "no error";
    } catch (const Error& e) {
      out = std::string(to_string(e.kind())) + ": " + e.what();
    }
    try {
      second->wait(Deadline::after(20s));
    } catch (const Error& e) {
      out += std::string(" | ") + e.what();
    }
    return out;
  });
  for (int r = 0; r < 2; ++r) {
    INFO(res[r]);
    CHECK(res[r].find("timed out") != std::string::npos);
    CHECK(res[r].find("all_reduce(count=1, f32, sum) #1") != std::string::npos);
    CHECK(res[r].find("| barrier() #2 on communicator 0: communicator failed earlier") != std::string::npos);
  }
}

TEST_CASE("abort fails the running and the queued operations at once") {
  LocalWorld world(2, opts(Algo::kRing, 60s));
  auto res = world.run([](Communicator& comm, int r) -> std::string {
    if (r == 1) return "";  // the peer never arrives; only abort can end the wait
    std::vector<float> buf(100);
    auto a = comm.all_reduce(buf.data(), buf.data(), 100, DataType::kF32, ReduceOp::kSum);
    auto b = comm.all_reduce(buf.data(), buf.data(), 100, DataType::kF32, ReduceOp::kSum);
    std::thread killer([&] {
      std::this_thread::sleep_for(200ms);
      comm.abort("recovering from a lost rank");
    });
    auto start = std::chrono::steady_clock::now();
    std::string out;
    for (auto& w : {a, b}) {
      try {
        w->wait(Deadline::after(30s));
      } catch (const Error& e) {
        if (e.kind() == ErrorKind::kAborted && std::string(e.what()).find("recovering from a lost rank") != std::string::npos)
          out += "aborted;";
        else
          out += std::string("other: ") + e.what();
      }
    }
    killer.join();
    if (std::chrono::steady_clock::now() - start > 20s) out += " (took until the deadline)";
    if (!comm.aborted()) out += " not marked aborted";
    return out;
  });
  CHECK(res[0] == "aborted;aborted;");
}

TEST_CASE("all-reduce of random floats is bit-identical on every rank and from run to run") {
  for (Algo algo : {Algo::kRing, Algo::kTree, Algo::kRhd}) {
    LocalWorld world(5, opts(algo));
    std::vector<std::vector<float>> results(5);
    for (int run = 0; run < 2; ++run) {
      auto res = world.run([&](Communicator& comm, int r) -> std::string {
        std::mt19937 rng(r);
        std::normal_distribution<float> d;
        std::vector<float> buf(4099);
        for (auto& v : buf) v = d(rng);
        comm.all_reduce(buf.data(), buf.data(), buf.size(), DataType::kF32, ReduceOp::kSum)->wait(Deadline::after(20s));
        if (run == 0) {
          results[r] = buf;
        } else if (std::memcmp(results[r].data(), buf.data(), buf.size() * 4) != 0) {
          return "differs from the first run";
        }
        return "";
      });
      INFO(to_string(algo));
      CHECK(first_failure(res) == "");
    }
    for (int r = 1; r < 5; ++r) CHECK(std::memcmp(results[0].data(), results[r].data(), 4099 * 4) == 0);
    // And close to the exact sum.
    std::vector<double> exact(4099, 0.0), mag(4099, 0.0);
    for (int r = 0; r < 5; ++r) {
      std::mt19937 rng(r);
      std::normal_distribution<float> d;
      for (size_t i = 0; i < 4099; ++i) {
        float v = d(rng);
        exact[i] += v;
        mag[i] += std::abs(v);
      }
    }
    size_t bad = 0;
    for (size_t i = 0; i < 4099; ++i) bad += std::abs(results[0][i] - exact[i]) > 1e-6 * mag[i] + 1e-7;
    CHECK(bad == 0);
  }
}

TEST_CASE("a world of one rank works without peers") {
  LocalWorld world(1, opts());
  std::vector<float> in = {1, 2, 3}, out(3);
  world.comm(0).all_reduce(in.data(), out.data(), 3, DataType::kF32, ReduceOp::kAvg)->wait(Deadline::after(5s));
  CHECK(out == in);
  world.comm(0).barrier()->wait(Deadline::after(5s));
  auto sub = world.comm(0).split(0, 0);
  CHECK(sub->size() == 1);
}

TEST_CASE("every rank ends with the same cost model parameters, measured or not") {
  for (bool measure : {false, true}) {
    CommOptions o = opts();
    o.measure = measure;
    LocalWorld world(3, o);
    std::vector<CostParams> got(3);
    auto res = world.run([&](Communicator& comm, int r) -> std::string {
      got[r] = comm.cost_model().intra;
      return "";
    });
    CHECK(first_failure(res) == "");
    for (int r = 1; r < 3; ++r) {
      CHECK(got[r].alpha_us == got[0].alpha_us);
      CHECK(got[r].beta_us_per_kib == got[0].beta_us_per_kib);
      CHECK(got[r].gamma_us_per_kib == got[0].gamma_us_per_kib);
    }
    CHECK(got[0].alpha_us > 0);
    if (!measure) CHECK(got[0].alpha_us == params_for_transport("local").alpha_us);
  }
}

namespace {

// Forwards to another PointToPoint and counts messages whose buffer is not 64-byte aligned.
class AlignmentProbe : public PointToPoint {
 public:
  explicit AlignmentProbe(std::shared_ptr<PointToPoint> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  RequestPtr isend(int peer, uint64_t tag, const void* buf, size_t len) override {
    note(buf, len);
    return inner_->isend(peer, tag, buf, len);
  }
  RequestPtr irecv(int peer, uint64_t tag, void* buf, size_t len) override {
    note(buf, len);
    return inner_->irecv(peer, tag, buf, len);
  }
  void progress() override { inner_->progress(); }
  void abort(const std::string& reason) override { inner_->abort(reason); }
  bool aborted() const override { return inner_->aborted(); }
  std::string describe() const override { return inner_->describe(); }

  std::atomic<int> large{0}, misaligned{0};

 private:
  void note(const void* buf, size_t len) {
    if (len < 4096) return;  // the agreement and other small messages
    ++large;
    if (reinterpret_cast<uintptr_t>(buf) % kBufferAlign) ++misaligned;
  }
  std::shared_ptr<PointToPoint> inner_;
};

}  // namespace

TEST_CASE("the ring sends and receives an aligned buffer in aligned pieces") {
  // Over tcp a message copies at full speed only when its buffer is 32-byte aligned
  // (core/aligned.h): segments and chunks of an aligned buffer must start on 64-byte boundaries
  // even when the count does not divide evenly.
  const int n = 3;
  const size_t count = 3 * 64 * 1024 + 13;
  std::vector<std::shared_ptr<AlignmentProbe>> probes;
  std::vector<std::shared_ptr<Communicator>> comms;
  CommOptions o = opts(Algo::kRing);
  o.chunk_bytes = 10000;  // not a multiple of 64
  for (auto& p : make_local_group(n)) {
    probes.push_back(std::make_shared<AlignmentProbe>(p));
    comms.push_back(std::make_shared<Communicator>(probes.back(), o));
  }
  std::vector<std::string> out(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      AlignedVector<float> in(count, float(r + 1)), res(count);
      comms[r]->all_reduce(in.data(), res.data(), count, DataType::kF32, ReduceOp::kSum)->wait(Deadline::after(20s));
      for (size_t i = 0; i < count; ++i)
        if (res[i] != 6.0f) {
          out[r] = "element " + std::to_string(i) + " is " + std::to_string(res[i]);
          break;
        }
    });
  for (auto& t : threads) t.join();
  CHECK(first_failure(out).empty());
  for (int r = 0; r < n; ++r) {
    INFO("rank " << r);
    CHECK(probes[r]->large > 0);
    CHECK(probes[r]->misaligned == 0);
  }
}

TEST_CASE("a collective nobody waits for still runs after a streak of blocking calls") {
  // Callers that wait right after each submit run their collectives inline, and the engine
  // stops being woken for each one (Engine::kBlockingStreak). Rank 0 then submits one it does not
  // wait for: its engine must start it on its own, or the other ranks' blocking calls time out.
  // Whether a submit found the engine in that state depends on timing, so this takes 5 rounds.
  const int n = 3;
  LocalWorld world(n, opts(Algo::kRing, 10s));
  std::atomic<int> finished{0};
  auto res = world.run([&](Communicator& comm, int r) -> std::string {
    for (int round = 0; round < 5; ++round) {
      int32_t mine = r + 1, sum = 0;
      for (int i = 0; i < 4 * Engine::kBlockingStreak; ++i) {
        comm.all_reduce(&mine, &sum, 1, DataType::kI32, ReduceOp::kSum)->wait(Deadline::after(10s));
        if (sum != 6) return "blocking call " + std::to_string(i) + " gave " + std::to_string(sum);
      }
      std::vector<int32_t> big(10000, r + 1), total(10000, 0);
      auto work = comm.all_reduce(big.data(), total.data(), big.size(), DataType::kI32, ReduceOp::kSum);
      if (r != 0) {
        work->wait(Deadline::after(10s));
        ++finished;
      } else {
        // Neither wait() nor test(): either would start the collective itself.
        const auto give_up = Clock::now() + 20s;
        while (finished.load() < (n - 1) * (round + 1) && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
        work->wait(Deadline::after(10s));
      }
      for (int32_t v : total)
        if (v != 6) return "round " + std::to_string(round) + ": the unwaited all-reduce gave " + std::to_string(v);
    }
    return "";
  });
  INFO(first_failure(res));
  CHECK(first_failure(res).empty());
}

TEST_CASE("operations on two communicators progress independently, issued in opposite orders") {
  LocalWorld world(2, opts(Algo::kAuto, 10s));
  auto res = world.run([](Communicator& comm, int r) -> std::string {
    auto a = comm.split(0, r);
    auto b = comm.split(0, r);
    if (a->id() == b->id()) return "same id";
    std::vector<float> x(1000, float(r + 1)), z(500, float(10 * r)), y(500, 0.0f);
    int32_t token = 40 + r, got = -1;
    // On A: an all-reduce, then a point-to-point exchange; on B: another all-reduce.
    WorkPtr w1, s1, r1, w2;
    auto issue_a = [&] {
      w1 = a->all_reduce(x.data(), x.data(), x.size(), DataType::kF32, ReduceOp::kSum);
      s1 = a->send(&token, 1, DataType::kI32, 1 - r);
      r1 = a->recv(&got, 1, DataType::kI32, 1 - r);
    };
    auto issue_b = [&] { w2 = b->all_reduce(z.data(), y.data(), 500, DataType::kF32, ReduceOp::kMax); };
    // Issued in opposite orders: one queue for both would run A's all-reduce first on rank 0
    // and B's first on rank 1, each waiting for the other forever.
    if (r == 0) {
      issue_a();
      issue_b();
    } else {
      issue_b();
      issue_a();
    }
    for (const auto& w : {w1, s1, r1, w2}) w->wait(Deadline::after(10s));
    if (got != 40 + (1 - r)) return "point-to-point got " + std::to_string(got);
    for (size_t i = 0; i < 1000; ++i)
      if (x[i] != 3.0f) return "sum at " + std::to_string(i);
    for (size_t i = 0; i < 500; ++i)
      if (y[i] != 10.0f) return "max at " + std::to_string(i);
    return "";
  });
  CHECK(first_failure(res) == "");
}

TEST_CASE("a collective on one communicator does not wait behind a blocked one on another") {
  // Rank 1 never joins communicator A's all-reduce until B's has completed on both ranks, so
  // rank 0's A operation stays blocked meanwhile; B must still complete on rank 0.
  LocalWorld world(2, opts(Algo::kAuto, 10s));
  auto res = world.run([](Communicator& comm, int r) -> std::string {
    auto a = comm.split(0, r);
    auto b = comm.split(0, r);
    int32_t one = 1, sa = 0, sb = 0;
    WorkPtr wa;
    if (r == 0) wa = a->all_reduce(&one, &sa, 1, DataType::kI32, ReduceOp::kSum);
    b->all_reduce(&one, &sb, 1, DataType::kI32, ReduceOp::kSum)->wait(Deadline::after(10s));
    b->barrier()->wait(Deadline::after(10s));
    if (r == 1) wa = a->all_reduce(&one, &sa, 1, DataType::kI32, ReduceOp::kSum);
    wa->wait(Deadline::after(10s));
    if (sa != 2 || sb != 2) return "sums " + std::to_string(sa) + " " + std::to_string(sb);
    return "";
  });
  CHECK(first_failure(res) == "");
}

TEST_CASE("aborting one communicator fails the operations of its siblings") {
  LocalWorld world(2, opts(Algo::kAuto, 10s));
  auto res = world.run([](Communicator& comm, int r) -> std::string {
    auto a = comm.split(0, r);
    auto b = comm.split(0, r);
    comm.barrier()->wait(Deadline::after(10s));
    int32_t v = 0;
    auto pending = r == 0 ? b->recv(&v, 1, DataType::kI32, 1) : nullptr;  // never sent
    if (r == 0) a->abort("test abort");
    if (r == 0) {
      try {
        pending->wait(Deadline::after(5s));
        return "receive completed";
      } catch (const Error& e) {
        if (e.kind() != ErrorKind::kAborted) return std::string("wrong error: ") + e.what();
      }
      if (!b->aborted() || !comm.aborted()) return "siblings not aborted";
    }
    return "";
  });
  CHECK(first_failure(res) == "");
}

TEST_CASE("the engine's idle poll is skipped after polls that found nothing, and comes back when one finds work") {
  trn::PollGovernor g;
  for (int i = 0; i < trn::PollGovernor::kSkipAfter; ++i) {
    REQUIRE(g.should_poll());
    g.record(false);
  }
  // From now on one call in kProbeEvery polls: it finds out whether work comes quickly again.
  int polled = 0;
  for (int i = 0; i < 4 * trn::PollGovernor::kProbeEvery; ++i) polled += g.should_poll();
  CHECK(polled == 4);
  // A probe that finds nothing keeps the skipping; one that catches work ends it.
  while (!g.should_poll()) {
  }
  g.record(false);
  CHECK_FALSE(g.should_poll());
  while (!g.should_poll()) {
  }
  g.record(true);
  for (int i = 0; i < trn::PollGovernor::kSkipAfter; ++i) CHECK(g.should_poll());
}
