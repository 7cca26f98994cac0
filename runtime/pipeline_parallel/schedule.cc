#include "runtime/pipeline_parallel/schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "collectives/core/error.h"

namespace trn::pipeline {

Kind parse_kind(const std::string& name) {
  if (name == "gpipe") return Kind::kGpipe;
  if (name == "1f1b") return Kind::k1F1B;
  if (name == "interleaved") return Kind::kInterleaved;
  if (name == "zb") return Kind::kZeroBubble;
  throw usage_error("unknown --schedule '{}': use gpipe, 1f1b, interleaved or zb", name);
}

const char* to_string(Kind k) {
  switch (k) {
    case Kind::kGpipe: return "gpipe";
    case Kind::k1F1B: return "1f1b";
    case Kind::kInterleaved: return "interleaved";
    case Kind::kZeroBubble: return "zb";
  }
  return "?";
}

const char* to_string(Op op) {
  switch (op) {
    case Op::kForward: return "F";
    case Op::kBackward: return "B";
    case Op::kWeight: return "W";
    case Op::kSendF: return "SEND_F";
    case Op::kRecvF: return "RECV_F";
    case Op::kSendB: return "SEND_B";
    case Op::kRecvB: return "RECV_B";
    case Op::kUnshard: return "UNSHARD";
    case Op::kReshard: return "RESHARD";
    case Op::kReduceGrad: return "REDUCE_GRAD";
  }
  return "?";
}

void check(Kind kind, const Shape& s) {
  if (s.P < 1 || s.M < 1 || s.V < 1)
    throw usage_error("--pp {} --micro-batches {} --virtual-stages {}: each must be at least 1", s.P, s.M, s.V);
  if (kind != Kind::kInterleaved && s.V != 1)
    throw usage_error("--virtual-stages {} needs --schedule interleaved (the {} schedule runs one chunk per rank)",
                      s.V, to_string(kind));
  if (kind == Kind::kInterleaved) {
    if (s.V < 2 || s.P < 2)
      throw usage_error("--schedule interleaved needs --pp 2 or more and --virtual-stages 2 or more (got --pp {} "
                        "--virtual-stages {}); use --schedule 1f1b for one chunk per rank",
                        s.P, s.V);
    if (s.M % s.P != 0)
      throw usage_error("--schedule interleaved needs --micro-batches a multiple of --pp {} (got {}); use --micro-batches "
                        "{}",
                        s.P, s.M, (s.M / s.P + 1) * s.P);
  }
}

std::vector<Action> compute_order(Kind kind, int stage, const Shape& s) {
  std::vector<Action> out;
  const int M = s.M;
  auto F = [&](int mb, int c) { out.push_back({Op::kForward, mb, c}); };
  auto B = [&](int mb, int c) { out.push_back({Op::kBackward, mb, c}); };
  switch (kind) {
    case Kind::kGpipe:
      for (int m = 0; m < M; ++m) F(m, 0);
      for (int m = 0; m < M; ++m) B(m, 0);
      break;
    case Kind::k1F1B:
    case Kind::kZeroBubble: {
      // zb: each B is followed by its W (actions() puts B's send between them).
      auto BW = [&](int mb) {
        B(mb, 0);
        if (kind == Kind::kZeroBubble) out.push_back({Op::kWeight, mb, 0});
      };
      const int warm = std::min(s.P - stage - 1, M);
      for (int m = 0; m < warm; ++m) F(m, 0);
      for (int i = 0; i < M - warm; ++i) {
        F(warm + i, 0);
        BW(i);
      }
      for (int m = M - warm; m < M; ++m) BW(m);
      break;
    }
    case Kind::kInterleaved: {
      // The k-th forward runs chunk (k / P) % V of micro-batch (k / (P V)) P + k % P; the k-th
      // backward the same micro-batch of chunk V - 1 - (k / P) % V.
      const int P = s.P, V = s.V, total = M * V;
      auto mb = [&](int k) { return (k / (P * V)) * P + k % P; };
      auto fchunk = [&](int k) { return (k / P) % V; };
      auto bchunk = [&](int k) { return V - 1 - (k / P) % V; };
      const int warm = std::min((P - stage - 1) * 2 + (V - 1) * P, total);
      for (int k = 0; k < warm; ++k) F(mb(k), fchunk(k));
      for (int i = 0; i < total - warm; ++i) {
        F(mb(warm + i), fchunk(warm + i));
        B(mb(i), bchunk(i));
      }
      for (int k = total - warm; k < total; ++k) B(mb(k), bchunk(k));
      break;
    }
  }
  return out;
}

std::vector<Action> actions(Kind kind, int stage, const Shape& s) {
  std::vector<Action> out;
  const int last = s.virtual_stages() - 1;
  for (const Action& a : compute_order(kind, stage, s)) {
    const int v = s.virtual_stage(stage, a.chunk);
    if (a.op == Op::kForward) {
      if (v > 0) out.push_back({Op::kRecvF, a.mb, a.chunk});
      out.push_back(a);
      if (v < last) out.push_back({Op::kSendF, a.mb, a.chunk});
    } else if (a.op == Op::kWeight) {
      out.push_back(a);
    } else {
      if (v < last) out.push_back({Op::kRecvB, a.mb, a.chunk});
      out.push_back(a);
      if (v > 0) out.push_back({Op::kSendB, a.mb, a.chunk});
    }
  }
  return out;
}

int promised_peak(Kind kind, int stage, const Shape& s) {
  switch (kind) {
    case Kind::kGpipe: return s.M;
    case Kind::k1F1B:
    case Kind::kZeroBubble: return std::min(s.P - stage, s.M);
    case Kind::kInterleaved: return std::min((s.P - stage - 1) * 2 + (s.V - 1) * s.P + 1, s.M * s.V);
  }
  return s.M;
}

double theoretical_bubble(Kind kind, const Shape& s) {
  const double b = double(s.P - 1) / double(s.M + s.P - 1);
  if (kind == Kind::kInterleaved) return b / s.V;
  if (kind == Kind::kZeroBubble) {
    // W runs right after its B: only F and B (a third each of F + B + W) fill the ramps.
    return 2.0 * (s.P - 1) / (3.0 * s.M + 2.0 * (s.P - 1));
  }
  return b;
}

Simulation simulate(Kind kind, const Shape& s, int lookahead) {
  Simulation sim;
  try {
    check(kind, s);
  } catch (const Error& e) {
    sim.error = e.what();
    return sim;
  }
  const int P = s.P;
  std::vector<std::vector<Action>> lists(P);
  for (int r = 0; r < P; ++r) lists[r] = actions(kind, r, s);
  if (lookahead >= 0) {
    for (int r = 0; r < P; ++r) {
      lists[r] = with_reduce_grad(with_sharding(lists[r], kind, r, s, lookahead), kind, s);
      const ShardingCheck c = check_sharding(lists[r], s.V, promised_unsharded(kind, r, s, lookahead));
      if (!c.ok) {
        sim.error = fmt::format("stage {}: {}", r, c.error);
        return sim;
      }
      if (const std::string e = check_reduce_grad(lists[r], s.V); !e.empty()) {
        sim.error = fmt::format("stage {}: {}", r, e);
        return sim;
      }
      sim.unsharded.push_back(c.peak);
    }
  }
  // Messages in flight, keyed by (destination virtual stage, forward?, micro-batch).
  std::set<std::tuple<int, bool, int>> mailbox;
  std::vector<size_t> pos(P, 0);
  std::vector<int> live(P, 0);
  sim.peak.assign(P, 0);
  std::vector<std::set<std::pair<int, int>>> fwd_done(P), bwd_done(P), recvd(P);
  for (;;) {
    bool progressed = false, all_done = true;
    for (int r = 0; r < P; ++r) {
      while (pos[r] < lists[r].size()) {
        const Action& a = lists[r][pos[r]];
        const int v = s.virtual_stage(r, a.chunk);
        bool blocked = false;
        switch (a.op) {
          case Op::kUnshard:
          case Op::kReshard:
          case Op::kReduceGrad: break;  // checked by check_sharding / check_reduce_grad; never blocks
          case Op::kRecvF:
          case Op::kRecvB: {
            auto key = std::make_tuple(v, a.op == Op::kRecvF, a.mb);
            if (!mailbox.count(key)) {
              blocked = true;
              break;
            }
            mailbox.erase(key);
            recvd[r].insert({a.chunk * 2 + (a.op == Op::kRecvB), a.mb});
            break;
          }
          case Op::kSendF:
          case Op::kSendB: {
            auto key = std::make_tuple(a.op == Op::kSendF ? v + 1 : v - 1, a.op == Op::kSendF, a.mb);
            if (!mailbox.insert(key).second) {
              sim.error = fmt::format("stage {} sends {} of micro-batch {} twice", r, to_string(a.op), a.mb);
              return sim;
            }
            break;
          }
          case Op::kForward:
            if (v > 0 && !recvd[r].count({a.chunk * 2, a.mb})) {
              sim.error = fmt::format("stage {} runs F of micro-batch {} chunk {} before receiving its input", r,
                                      a.mb, a.chunk);
              return sim;
            }
            fwd_done[r].insert({a.chunk, a.mb});
            sim.peak[r] = std::max(sim.peak[r], ++live[r]);
            break;
          case Op::kWeight:
            if (!bwd_done[r].count({a.chunk, a.mb})) {
              sim.error = fmt::format("stage {} runs W of micro-batch {} before its B", r, a.mb);
              return sim;
            }
            --live[r];
            break;
          case Op::kBackward:
            if (!fwd_done[r].count({a.chunk, a.mb})) {
              sim.error = fmt::format("stage {} runs B of micro-batch {} chunk {} before its forward", r, a.mb, a.chunk);
              return sim;
            }
            if (v < s.virtual_stages() - 1 && !recvd[r].count({a.chunk * 2 + 1, a.mb})) {
              sim.error = fmt::format("stage {} runs B of micro-batch {} chunk {} before receiving its gradient", r,
                                      a.mb, a.chunk);
              return sim;
            }
            bwd_done[r].insert({a.chunk, a.mb});
            if (kind != Kind::kZeroBubble) --live[r];  // zb: the activations live until W
            break;
        }
        if (blocked) break;
        ++pos[r];
        progressed = true;
      }
      all_done = all_done && pos[r] == lists[r].size();
    }
    if (all_done) break;
    if (!progressed) {
      std::string where;
      for (int r = 0; r < P; ++r)
        if (pos[r] < lists[r].size())
          where += fmt::format(" stage {} waits at {} mb {} chunk {};", r, to_string(lists[r][pos[r]].op),
                               lists[r][pos[r]].mb, lists[r][pos[r]].chunk);
      sim.error = "deadlock:" + where;
      return sim;
    }
  }
  if (!mailbox.empty()) {
    sim.error = fmt::format("{} messages were sent but never received", mailbox.size());
    return sim;
  }
  for (int r = 0; r < P; ++r) {
    if (live[r] != 0 || int(fwd_done[r].size()) != s.M * s.V) {
      sim.error = fmt::format("stage {} did not run every forward and backward once", r);
      return sim;
    }
    int total = 0;
    for (int n : plan_slots(kind, r, s).slots_needed) total += n;
    sim.slots.push_back(total);
  }
  sim.ok = true;
  return sim;
}

SlotPlan plan_slots(Kind kind, int stage, const Shape& s) {
  SlotPlan plan;
  plan.slot_of.assign(s.V, std::vector<int>(s.M, -1));
  plan.slots_needed.assign(s.V, 0);
  std::vector<std::vector<int>> free_slots(s.V);
  for (const Action& a : compute_order(kind, stage, s)) {
    auto& fl = free_slots[a.chunk];
    if (a.op == Op::kBackward && kind == Kind::kZeroBubble) continue;  // freed by its W
    if (a.op == Op::kForward) {
      int slot;
      if (fl.empty()) {
        slot = plan.slots_needed[a.chunk]++;
      } else {
        slot = *std::min_element(fl.begin(), fl.end());
        fl.erase(std::find(fl.begin(), fl.end(), slot));
      }
      plan.slot_of[a.chunk][a.mb] = slot;
    } else {
      fl.push_back(plan.slot_of[a.chunk][a.mb]);
    }
  }
  return plan;
}

std::vector<Action> with_sharding(const std::vector<Action>& list, Kind kind, int stage, const Shape& s,
                                  int lookahead) {
  (void)kind;
  (void)stage;
  if (lookahead < 0) throw internal_error("with_sharding: lookahead {} is negative", lookahead);
  auto is_compute = [](Op op) { return op == Op::kForward || op == Op::kBackward || op == Op::kWeight; };
  // Compute actions in order, with the chunk each needs unsharded (-1: W).
  std::vector<int> needs;
  for (const Action& a : list) {
    if (a.op == Op::kUnshard || a.op == Op::kReshard || a.op == Op::kReduceGrad)
      throw internal_error("with_sharding of a list that already has {}", to_string(a.op));
    if (is_compute(a.op)) needs.push_back(a.op == Op::kWeight ? -1 : a.chunk);
    if (a.chunk < 0 || a.chunk >= s.V) throw internal_error("an action on chunk {} of {}", a.chunk, s.V);
  }
  const int n = int(needs.size());
  // With V <= lookahead + 1 the promise lets every chunk be held at once: each is then held from
  // its first use to its last, gathered once a step (rotating would gather more bytes for the
  // same peak).
  const bool hold = s.V <= lookahead + 1;
  // unshard_at[k]: chunks to unshard just before compute action k (in order of first use);
  // reshard_after[k]: chunks to free right after it.
  std::vector<std::vector<std::pair<int, int>>> unshard_at(size_t(n) + 1);
  std::vector<std::vector<int>> reshard_after(static_cast<size_t>(n));
  for (int c = 0; c < s.V; ++c) {
    std::vector<int> uses;
    for (int k = 0; k < n; ++k)
      if (needs[size_t(k)] == c) uses.push_back(k);
    for (size_t i = 0; i < uses.size();) {
      const int first = uses[i];
      size_t j = i;
      // Held across a gap only when gathering again could not start any later than now.
      while (j + 1 < uses.size() && (hold || uses[j + 1] - uses[j] <= lookahead + 1)) ++j;
      unshard_at[size_t(std::max(0, first - lookahead))].push_back({first, c});
      reshard_after[size_t(uses[j])].push_back(c);
      i = j + 1;
    }
  }
  for (auto& u : unshard_at) std::sort(u.begin(), u.end());
  std::vector<Action> out;
  out.reserve(list.size() + 2 * size_t(n));
  auto unshard = [&](size_t k) {
    for (const auto& [first, c] : unshard_at[k]) out.push_back({Op::kUnshard, -1, c});
  };
  unshard(0);
  int k = 0;
  for (const Action& a : list) {
    out.push_back(a);
    if (!is_compute(a.op)) continue;
    for (int c : reshard_after[size_t(k)]) out.push_back({Op::kReshard, -1, c});
    ++k;
    if (k < n) unshard(size_t(k));
  }
  return out;
}

int promised_unsharded(Kind kind, int stage, const Shape& s, int lookahead) {
  (void)kind;
  (void)stage;
  return std::min(s.V, std::max(lookahead, 0) + 1);
}

ShardingCheck check_sharding(const std::vector<Action>& list, int V, int limit) {
  ShardingCheck r;
  std::vector<bool> held(size_t(std::max(V, 0)), false);
  int now = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    const Action& a = list[i];
    if (a.chunk < 0 || a.chunk >= V) {
      r.error = fmt::format("action {} ({}) is on chunk {} of {}", i, to_string(a.op), a.chunk, V);
      return r;
    }
    const size_t c = size_t(a.chunk);
    switch (a.op) {
      case Op::kUnshard:
        if (held[c]) {
          r.error = fmt::format("action {}: UNSHARD of chunk {}, which is already unsharded", i, a.chunk);
          return r;
        }
        held[c] = true;
        r.peak = std::max(r.peak, ++now);
        if (now > limit) {
          r.error = fmt::format("action {}: {} chunks unsharded at once, more than the {} promised", i, now, limit);
          return r;
        }
        break;
      case Op::kReshard:
        if (!held[c]) {
          r.error = fmt::format("action {}: RESHARD of chunk {}, which is not unsharded", i, a.chunk);
          return r;
        }
        held[c] = false;
        --now;
        break;
      case Op::kForward:
      case Op::kBackward:
        if (!held[c]) {
          r.error = fmt::format("action {}: {} of micro-batch {} on chunk {} while the chunk is sharded", i,
                                to_string(a.op), a.mb, a.chunk);
          return r;
        }
        break;
      default: break;  // W reads no weight; messages none
    }
  }
  for (int c = 0; c < V; ++c)
    if (held[size_t(c)]) {
      r.error = fmt::format("chunk {} is still unsharded at the end of the list", c);
      return r;
    }
  r.ok = true;
  return r;
}

namespace {

// Whether a finalises chunk a.chunk's gradients for part of the step (B, or zb's W).
bool finalises(Kind kind, const Action& a) {
  return a.op == (kind == Kind::kZeroBubble ? Op::kWeight : Op::kBackward);
}

}  // namespace

std::vector<Action> with_reduce_grad(const std::vector<Action>& list, Kind kind, const Shape& s) {
  std::vector<int> last(size_t(s.V), -1);  // per chunk: the index of its finalising action
  for (size_t i = 0; i < list.size(); ++i) {
    const Action& a = list[i];
    if (a.op == Op::kReduceGrad) throw internal_error("with_reduce_grad of a list that already has REDUCE_GRAD");
    if (a.chunk < 0 || a.chunk >= s.V) throw internal_error("an action on chunk {} of {}", a.chunk, s.V);
    if (finalises(kind, a)) last[size_t(a.chunk)] = int(i);
  }
  std::vector<Action> out;
  out.reserve(list.size() + size_t(s.V));
  for (size_t i = 0; i < list.size(); ++i) {
    out.push_back(list[i]);
    if (last[size_t(list[i].chunk)] == int(i)) out.push_back({Op::kReduceGrad, -1, list[i].chunk});
  }
  return out;
}

std::string check_reduce_grad(const std::vector<Action>& list, int V) {
  std::vector<int> seen(size_t(std::max(V, 0)), 0);
  int next = V - 1;  // the chunk whose REDUCE_GRAD comes next
  for (size_t i = 0; i < list.size(); ++i) {
    const Action& a = list[i];
    if (a.chunk < 0 || a.chunk >= V) return fmt::format("action {} ({}) is on chunk {} of {}", i, to_string(a.op), a.chunk, V);
    const size_t c = size_t(a.chunk);
    if (a.op == Op::kReduceGrad) {
      if (seen[c]++) return fmt::format("action {}: a second REDUCE_GRAD of chunk {}", i, a.chunk);
      if (a.chunk != next)
        return fmt::format("action {}: REDUCE_GRAD of chunk {} before chunk {}'s (out of buffer order)", i, a.chunk, next);
      --next;
    } else if ((a.op == Op::kBackward || a.op == Op::kWeight) && seen[c]) {
      return fmt::format("action {}: {} of micro-batch {} on chunk {} after its REDUCE_GRAD", i, to_string(a.op), a.mb,
                         a.chunk);
    }
  }
  if (next >= 0) return fmt::format("chunk {} has no REDUCE_GRAD", next);
  return {};
}

std::vector<Action> forward_actions(int stage, const Shape& s) {
  std::vector<Action> out;
  const int last = s.virtual_stages() - 1;
  for (int ch = 0; ch < s.V; ++ch) {
    const int v = s.virtual_stage(stage, ch);
    for (int mb = 0; mb < s.M; ++mb) {
      if (v > 0) out.push_back({Op::kRecvF, mb, ch});
      out.push_back({Op::kForward, mb, ch});
      if (v < last) out.push_back({Op::kSendF, mb, ch});
    }
  }
  return out;
}

}  // namespace trn::pipeline
