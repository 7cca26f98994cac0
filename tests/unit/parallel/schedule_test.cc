// Pipeline schedules without a model: every list of every stage runs to the end under eager sends
// and blocking receives, every message is received once, and live activations stay within the
// schedule's promise (1F1B: P - s on stage s; GPipe: M), for P up to 8, M up to 16, V up to 4.
#include <catch2/catch.hpp>

#include <algorithm>

#include "collectives/core/error.h"
#include "runtime/pipeline_parallel/schedule.h"

using namespace trn::pipeline;

TEST_CASE("every schedule runs without deadlock and keeps its activation promise") {
  int checked = 0;
  for (Kind kind : {Kind::kGpipe, Kind::k1F1B, Kind::kInterleaved, Kind::kZeroBubble})
    for (int P = 1; P <= 8; ++P)
      for (int M = 1; M <= 16; ++M)
        for (int V = 1; V <= 4; ++V) {
          const Shape s{P, M, V};
          bool valid = true;
          try {
            check(kind, s);
          } catch (const trn::Error&) {
            valid = false;
          }
          const Simulation sim = simulate(kind, s);
          INFO(to_string(kind) << " P " << P << " M " << M << " V " << V << ": " << sim.error);
          REQUIRE(sim.ok == valid);
          if (!valid) continue;
          ++checked;
          for (int r = 0; r < P; ++r) {
            CHECK(sim.peak[r] <= promised_peak(kind, r, s));
            if (V == 1) CHECK(sim.slots[r] == sim.peak[r]);  // slot reuse is as tight as the schedule
          }
          if (kind == Kind::k1F1B || kind == Kind::kZeroBubble) CHECK(sim.peak[0] == std::min(P, M));
          if (kind == Kind::kGpipe) CHECK(sim.peak[0] == M);
        }
  CHECK(checked == 462);  // 128 GPipe, 128 1F1B, 78 interleaved and 128 zero-bubble shapes
}

TEST_CASE("1F1B on stage 0 of 4 with 6 micro-batches: three warm-up forwards, then alternation") {
  const auto order = compute_order(Kind::k1F1B, 0, {4, 6, 1});
  std::string seq;
  for (const Action& a : order) seq += std::string(to_string(a.op)) + std::to_string(a.mb) + " ";
  CHECK(seq == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5 ");
  const auto last = compute_order(Kind::k1F1B, 3, {4, 6, 1});
  seq.clear();
  for (const Action& a : last) seq += std::string(to_string(a.op)) + std::to_string(a.mb) + " ";
  CHECK(seq == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 ");
}

TEST_CASE("the actions around a computation: receive before, send after") {
  const auto a = actions(Kind::k1F1B, 1, {3, 2, 1});  // a middle stage
  REQUIRE(a.size() >= 3);
  CHECK(a[0] == Action{Op::kRecvF, 0, 0});
  CHECK(a[1] == Action{Op::kForward, 0, 0});
  CHECK(a[2] == Action{Op::kSendF, 0, 0});
  const auto first = actions(Kind::kGpipe, 0, {2, 1, 1});
  CHECK(first == std::vector<Action>{{Op::kForward, 0, 0}, {Op::kSendF, 0, 0}, {Op::kRecvB, 0, 0},
                                     {Op::kBackward, 0, 0}});
}

TEST_CASE("interleaved: chunks of a rank alternate in groups of P micro-batches") {
  const auto order = compute_order(Kind::kInterleaved, 0, {2, 4, 2});
  std::string seq;
  for (const Action& a : order) seq += std::string(to_string(a.op)) + std::to_string(a.mb) + "c" + std::to_string(a.chunk) + " ";
  // warm-up (P - 1) * 2 + (V - 1) * P = 4 forwards: mbs 0, 1 on chunk 0, then on chunk 1.
  CHECK(seq.rfind("F0c0 F1c0 F0c1 F1c1 ", 0) == 0);
  CHECK(theoretical_bubble(Kind::kInterleaved, {2, 4, 2}) == Approx(0.2 / 2));
  CHECK(theoretical_bubble(Kind::k1F1B, {4, 8, 1}) == Approx(3.0 / 11));
  CHECK(theoretical_bubble(Kind::kZeroBubble, {4, 8, 1}) == Approx(6.0 / 30));
}

TEST_CASE("schedules that cannot run a shape are usage errors") {
  CHECK_THROWS_WITH(check(Kind::k1F1B, {2, 4, 2}), Catch::Contains("--virtual-stages 2 needs --schedule interleaved"));
  CHECK_THROWS_WITH(check(Kind::kInterleaved, {2, 3, 2}), Catch::Contains("multiple of --pp 2"));
  CHECK_THROWS_WITH(check(Kind::kInterleaved, {2, 4, 1}), Catch::Contains("--virtual-stages 2 or more"));
  CHECK_THROWS_WITH(parse_kind("zigzag"), Catch::Contains("gpipe, 1f1b, interleaved or zb"));
}

TEST_CASE("zero bubble: the input gradient goes upstream before the weight gradient is computed") {
  const auto a = actions(Kind::kZeroBubble, 1, {2, 2, 1});  // the last of 2 stages
  std::string seq;
  for (const Action& x : a) seq += std::string(to_string(x.op)) + std::to_string(x.mb) + " ";
  CHECK(seq == "RECV_F0 F0 B0 SEND_B0 W0 RECV_F1 F1 B1 SEND_B1 W1 ");
}

namespace {

std::vector<Action> without_sharding(const std::vector<Action>& list) {
  std::vector<Action> out;
  for (const Action& a : list)
    if (a.op != Op::kUnshard && a.op != Op::kReshard) out.push_back(a);
  return out;
}

int count(const std::vector<Action>& list, Op op) {
  return int(std::count_if(list.begin(), list.end(), [&](const Action& a) { return a.op == op; }));
}

}  // namespace

TEST_CASE("ZeRO-3 sharding: every F and B runs on an unsharded chunk, within the promise, in every schedule") {
  int checked = 0;
  for (Kind kind : {Kind::kGpipe, Kind::k1F1B, Kind::kInterleaved, Kind::kZeroBubble})
    for (int P = 1; P <= 4; ++P)
      for (int M = 1; M <= 8; ++M)
        for (int V = 1; V <= 3; ++V)
          for (int lookahead = 0; lookahead <= 2; ++lookahead) {
            const Shape s{P, M, V};
            try {
              check(kind, s);
            } catch (const trn::Error&) {
              continue;
            }
            const Simulation sim = simulate(kind, s, lookahead);
            INFO(to_string(kind) << " P " << P << " M " << M << " V " << V << " lookahead " << lookahead << ": "
                                 << sim.error);
            REQUIRE(sim.ok);
            ++checked;
            for (int r = 0; r < P; ++r) {
              const auto plain = actions(kind, r, s);
              const auto sharded = with_sharding(plain, kind, r, s, lookahead);
              CHECK(without_sharding(sharded) == plain);  // only inserts
              CHECK(sim.unsharded[r] <= promised_unsharded(kind, r, s, lookahead));
              CHECK(count(sharded, Op::kUnshard) == count(sharded, Op::kReshard));
              if (V <= lookahead + 1) {
                // Every chunk may be held at once: each is gathered once a step.
                CHECK(count(sharded, Op::kUnshard) == V);
                if (V == 1) CHECK(sharded.front() == Action{Op::kUnshard, -1, 0});
              } else if (M > 1) {
                CHECK(count(sharded, Op::kUnshard) > V);  // chunks rotate
              }
              const auto fwd = with_sharding(forward_actions(r, s), kind, r, s, lookahead);
              const ShardingCheck fc = check_sharding(fwd, V, promised_unsharded(kind, r, s, lookahead));
              CHECK(fc.ok);
              CHECK(without_sharding(fwd) == forward_actions(r, s));
              // forward_actions runs each chunk's micro-batches back to back: one gather per chunk.
              CHECK(count(fwd, Op::kUnshard) == V);
            }
          }
  CHECK(checked > 300);
}

TEST_CASE("ZeRO-3 sharding with V = 1: UNSHARD at the head, RESHARD after the last B (not held back for W)") {
  for (Kind kind : {Kind::kGpipe, Kind::k1F1B, Kind::kZeroBubble}) {
    const Shape s{4, 6, 1};
    for (int r = 0; r < 4; ++r) {
      const auto list = with_sharding(actions(kind, r, s), kind, r, s, 1);
      INFO(to_string(kind) << " stage " << r);
      REQUIRE(count(list, Op::kUnshard) == 1);
      REQUIRE(count(list, Op::kReshard) == 1);
      CHECK(list.front() == Action{Op::kUnshard, -1, 0});
      const auto reshard = std::find(list.begin(), list.end(), Action{Op::kReshard, -1, 0});
      const auto last_b = std::find(list.rbegin(), list.rend(), Action{Op::kBackward, s.M - 1, 0});
      REQUIRE(last_b != list.rend());
      CHECK(reshard == last_b.base());  // right after the last B
      if (kind == Kind::kZeroBubble) CHECK(list.back() == Action{Op::kWeight, s.M - 1, 0});
    }
  }
}

TEST_CASE("ZeRO-3 sharding interleaved: chunks rotate, at most lookahead + 1 held; once a step when all fit") {
  for (const auto& [V, lookahead] : {std::pair{2, 0}, std::pair{3, 0}, std::pair{3, 1}, std::pair{4, 2}}) {
    const Shape s{2, 4, V};
    const auto list = with_sharding(actions(Kind::kInterleaved, 0, s), Kind::kInterleaved, 0, s, lookahead);
    const ShardingCheck c = check_sharding(list, s.V, lookahead + 1);
    INFO("V " << V << " lookahead " << lookahead << ": " << c.error);
    CHECK(c.ok);
    CHECK(c.peak == lookahead + 1);
    CHECK(count(list, Op::kUnshard) > s.V);  // a chunk is gathered more than once per step
  }
  // V <= lookahead + 1: rotating would gather more for the same peak, so each chunk is held
  // from its first use to its last.
  const Shape s{2, 4, 2};
  const auto list = with_sharding(actions(Kind::kInterleaved, 0, s), Kind::kInterleaved, 0, s, 1);
  CHECK(check_sharding(list, 2, 2).ok);
  CHECK(count(list, Op::kUnshard) == 2);
  CHECK(promised_unsharded(Kind::kInterleaved, 0, {2, 4, 4}, 1) == 2);
  CHECK(promised_unsharded(Kind::k1F1B, 0, {2, 4, 1}, 3) == 1);
}

TEST_CASE("ZeRO-3 sharding checks refuse bad lists") {
  const Action U{Op::kUnshard, -1, 0}, R{Op::kReshard, -1, 0}, F0{Op::kForward, 0, 0}, F1{Op::kForward, 1, 0},
      B0{Op::kBackward, 0, 0};
  CHECK(check_sharding({U, F0, B0, R}, 1, 1).ok);
  // F before UNSHARD
  CHECK_FALSE(check_sharding({F0, U, B0, R}, 1, 1).ok);
  // RESHARD before the last F
  const ShardingCheck early = check_sharding({U, F0, R, F1, B0}, 1, 1);
  CHECK_FALSE(early.ok);
  CHECK(early.error.find("sharded") != std::string::npos);
  // left unsharded; two UNSHARDs; RESHARD without UNSHARD
  CHECK_FALSE(check_sharding({U, F0, B0}, 1, 1).ok);
  CHECK_FALSE(check_sharding({U, U, F0, B0, R}, 1, 1).ok);
  CHECK_FALSE(check_sharding({R, U, F0, B0, R}, 1, 1).ok);
  // more chunks held than promised
  const Action U1{Op::kUnshard, -1, 1}, R1{Op::kReshard, -1, 1};
  CHECK(check_sharding({U, U1, F0, R, R1}, 2, 2).ok);
  CHECK_FALSE(check_sharding({U, U1, F0, R, R1}, 2, 1).ok);
  // W needs no weights
  CHECK(check_sharding({U, F0, B0, R, Action{Op::kWeight, 0, 0}}, 1, 1).ok);
  // a list already sharded is not sharded again
  CHECK_THROWS_AS(with_sharding({U, F0, B0, R}, Kind::kGpipe, 0, {1, 1, 1}, 1), trn::Error);
}

TEST_CASE("REDUCE_GRAD: once per chunk, after its last B (zb: W), chunk V - 1 first, in every schedule") {
  for (Kind kind : {Kind::kGpipe, Kind::k1F1B, Kind::kInterleaved, Kind::kZeroBubble})
    for (int P = 1; P <= 4; ++P)
      for (int M = 1; M <= 8; ++M)
        for (int V = 1; V <= 3; ++V) {
          const Shape s{P, M, V};
          try {
            check(kind, s);
          } catch (const trn::Error&) {
            continue;
          }
          for (int r = 0; r < P; ++r) {
            INFO(to_string(kind) << " P " << P << " M " << M << " V " << V << " stage " << r);
            const auto plain = actions(kind, r, s);
            const auto list = with_reduce_grad(plain, kind, s);
            CHECK(check_reduce_grad(list, V).empty());
            CHECK(count(list, Op::kReduceGrad) == V);
            std::vector<Action> rest;
            for (const Action& a : list)
              if (a.op != Op::kReduceGrad) rest.push_back(a);
            CHECK(rest == plain);
            // Right after the action that finalises the chunk.
            const Op fin = kind == Kind::kZeroBubble ? Op::kWeight : Op::kBackward;
            for (size_t i = 0; i < list.size(); ++i)
              if (list[i].op == Op::kReduceGrad) {
                REQUIRE(i > 0);
                CHECK(list[i - 1] == Action{fin, M - 1, list[i].chunk});
              }
          }
        }
}

TEST_CASE("REDUCE_GRAD checks refuse bad lists") {
  const Action B0{Op::kBackward, 0, 0}, B1{Op::kBackward, 0, 1}, W0{Op::kWeight, 0, 0}, RG0{Op::kReduceGrad, -1, 0},
      RG1{Op::kReduceGrad, -1, 1};
  CHECK(check_reduce_grad({B1, RG1, B0, RG0}, 2).empty());
  CHECK_FALSE(check_reduce_grad({B1, B0, RG0, RG1}, 2).empty());       // out of buffer order
  CHECK_FALSE(check_reduce_grad({B1, RG1, B0}, 2).empty());            // missing
  CHECK_FALSE(check_reduce_grad({B1, RG1, RG0, B0}, 2).empty());       // before the chunk's last B
  CHECK_FALSE(check_reduce_grad({B0, RG0, W0}, 1).empty());            // before zb's W
  CHECK_FALSE(check_reduce_grad({B1, RG1, RG1, B0, RG0}, 2).empty());  // twice
}
