#include "collectives/check.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <vector>

#include "collectives/algorithms/algorithm.h"
#include "collectives/core/error.h"
#include "collectives/tag.h"

namespace trn {
namespace {

struct Wire {
  uint8_t op, dtype, redop, pad;
  int32_t root;
  uint64_t count;
};

bool has_redop(OpKind k) {
  return k == OpKind::kAllReduce || k == OpKind::kReduceScatter || k == OpKind::kReduce ||
         k == OpKind::kAllReduceE4M3 || k == OpKind::kReduceScatterE4M3;
}
bool has_root(OpKind k) { return k == OpKind::kBroadcast || k == OpKind::kReduce; }

}  // namespace

const char* to_string(OpKind k) {
  static const char* names[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                "reduce",     "barrier",        "all_to_all", "split", "agree_cost_model",
                                "all_reduce_e4m3", "reduce_scatter_e4m3", "all_to_all_v"};
  return names[static_cast<int>(k)];
}

std::string CallDesc::describe() const {
  if (op == OpKind::kBarrier || op == OpKind::kSplit || op == OpKind::kAgreeCostModel) return fmt::format("{}()", to_string(op));
  if (op == OpKind::kAllToAllV) return fmt::format("{}({})", to_string(op), to_string(dtype));
  std::string s = fmt::format("{}(count={}, {}", to_string(op), count, to_string(dtype));
  if (has_redop(op)) s += fmt::format(", {}", to_string(redop));
  if (has_root(op)) s += fmt::format(", root={}", root);
  return s + ")";
}

void check_same_call(algo::Context& c, uint32_t comm_id, uint64_t seq, const CallDesc& mine) {
  const int n = c.size(), r = c.rank();
  std::vector<Wire> all(n);
  all[r] = Wire{static_cast<uint8_t>(mine.op), static_cast<uint8_t>(mine.dtype),
                static_cast<uint8_t>(mine.redop), 0, mine.root, mine.count};
  std::vector<RequestPtr> reqs;
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    reqs.push_back(c.irecv(p, tag::kCheckStep, &all[p], sizeof(Wire)));
    reqs.push_back(c.isend(p, tag::kCheckStep, &all[r], sizeof(Wire)));
  }
  c.wait_all(reqs);
  std::vector<CallDesc> descs(n);
  for (int p = 0; p < n; ++p) {
    descs[p] = CallDesc{static_cast<OpKind>(all[p].op), static_cast<DataType>(all[p].dtype),
                        static_cast<ReduceOp>(all[p].redop), all[p].root, all[p].count};
    if (!has_redop(descs[p].op)) descs[p].redop = ReduceOp::kSum;
  }
  bool same = true;
  for (int p = 0; p < n; ++p) same = same && descs[p] == descs[0];
  if (same) return;
  // Group the ranks by what they called: "rank 0 called X; ranks 1,2 called Y".
  std::vector<std::pair<std::string, std::string>> groups;  // (call, ranks)
  for (int p = 0; p < n; ++p) {
    std::string call = descs[p].describe();
    auto it = std::find_if(groups.begin(), groups.end(), [&](auto& g) { return g.first == call; });
    if (it == groups.end()) {
      groups.emplace_back(call, std::to_string(p));
    } else {
      it->second.append(",").append(std::to_string(p));
    }
  }
  std::string detail;
  for (auto& [call, ranks] : groups) {
    if (!detail.empty()) detail += "; ";
    detail += fmt::format("{} {} called {}", ranks.find(',') == std::string::npos ? "rank" : "ranks", ranks, call);
  }
  throw usage_error(
      "mismatched collectives on communicator {} (operation #{}): {} — every rank must issue the same "
      "collectives in the same order",
      comm_id, seq, detail);
}

void check_all_to_all_v_counts(algo::Context& c, const std::vector<size_t>& send_bytes,
                               const std::vector<size_t>& recv_bytes, size_t es) {
  const int n = c.size(), r = c.rank();
  const std::vector<uint64_t> mine(send_bytes.begin(), send_bytes.end());
  std::vector<uint64_t> told(n);
  std::vector<RequestPtr> reqs;
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    reqs.push_back(c.irecv(p, tag::kCheckStep - 1, &told[p], sizeof(uint64_t)));
    reqs.push_back(c.isend(p, tag::kCheckStep - 1, &mine[p], sizeof(uint64_t)));
  }
  c.wait_all(reqs);
  struct Finding {
    int64_t from = -1;  // -1: this rank saw no disagreement
    uint64_t sent = 0, expected = 0;
  };
  std::vector<Finding> all(n);
  for (int p = 0; p < n && all[r].from < 0; ++p)
    if (p != r && told[p] != recv_bytes[p]) all[r] = Finding{p, told[p], recv_bytes[p]};
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    reqs.push_back(c.irecv(p, tag::kCheckStep - 2, &all[p], sizeof(Finding)));
    reqs.push_back(c.isend(p, tag::kCheckStep - 2, &all[r], sizeof(Finding)));
  }
  c.wait_all(reqs);
  for (int q = 0; q < n; ++q)
    if (all[q].from >= 0)
      throw usage_error("all_to_all_v: rank {} sends rank {} {} elements but rank {} expects {} (send_counts[{}] on "
                        "rank {} and recv_counts[{}] on rank {} must agree)",
                        all[q].from, q, all[q].sent / es, q, all[q].expected / es, q, all[q].from, all[q].from, q);
}

}  // namespace trn
