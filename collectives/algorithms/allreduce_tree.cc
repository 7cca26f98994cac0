// Double binary tree all-reduce. Two binary trees span the ranks; each carries half of the
// data: reduced up to its root chunk by chunk, then broadcast back down chunk by chunk, so the
// up and down phases of different chunks overlap. Tree A is the balanced in-order tree over
// ranks 0..n-1; tree B is the same shape over the ranks mirrored (n even) or shifted by one
// (n odd), so most ranks that are leaves in one tree are inner nodes of the other and the
// per-rank load is balanced. At each node the order of reduction is fixed: own, left, right.
#include <algorithm>
#include <array>

#include "collectives/algorithms/algorithm.h"

namespace trn::algo {
namespace {

constexpr size_t kMaxChunks = 4096;
constexpr size_t kWindow = 4;  // chunks of child data received ahead

struct Node {
  int parent = -1;
  std::array<int, 2> child{-1, -1};
};

// Parent and children of position pos in the balanced in-order tree over [lo, hi).
int build(int lo, int hi, int parent, int pos, Node& out) {
  if (lo >= hi) return -1;
  int mid = lo + (hi - lo) / 2;
  if (mid == pos) {
    out.parent = parent;
    out.child[0] = lo < mid ? lo + (mid - lo) / 2 : -1;
    out.child[1] = mid + 1 < hi ? mid + 1 + (hi - mid - 1) / 2 : -1;
  } else if (pos < mid) {
    build(lo, mid, mid, pos, out);
  } else {
    build(mid + 1, hi, mid, pos, out);
  }
  return mid;
}

struct Tree {
  Node node;           // in communicator ranks
  size_t begin, count; // the elements this tree carries
  char* child_tmp[2];
  std::vector<RequestPtr> up_recv[2], up_send, down_recv;
  size_t down_posted = 0;  // chunks whose result receive from the parent is posted
};

}  // namespace

void allreduce_tree(Context& c, void* buf, size_t count, DataType t, ReduceOp op) {
  const int n = c.size(), r = c.rank();
  if (n == 1) return;
  const size_t es = size_of(t);
  char* data = static_cast<char*>(buf);
  auto to_rank = [&](int tree, int pos) {
    if (pos < 0) return -1;
    return tree == 0 ? pos : (n % 2 == 0 ? n - 1 - pos : (pos + 1) % n);
  };
  auto to_pos = [&](int tree) { return tree == 0 ? r : (n % 2 == 0 ? n - 1 - r : (r - 1 + n) % n); };

  const size_t half = count / 2;
  const size_t max_part = count - half;
  size_t chunks = std::clamp<size_t>((max_part * es + c.chunk_bytes() - 1) / std::max<size_t>(c.chunk_bytes(), 1),
                                     1, kMaxChunks);
  chunks = std::min(chunks, std::max<size_t>(max_part, 1));
  const size_t chunk_elems = (max_part + chunks - 1) / chunks;
  char* tmp = c.scratch(4 * max_part * es);

  Tree trees[2];
  for (int k = 0; k < 2; ++k) {
    Tree& tr = trees[k];
    Node pos_node;
    build(0, n, -1, to_pos(k), pos_node);
    tr.node.parent = to_rank(k, pos_node.parent);
    for (int i = 0; i < 2; ++i) {
      tr.node.child[i] = to_rank(k, pos_node.child[i]);
      tr.child_tmp[i] = tmp + (2 * k + i) * max_part * es;
      tr.up_recv[i].resize(chunks);
    }
    tr.begin = k == 0 ? 0 : half;
    tr.count = k == 0 ? half : count - half;
    tr.up_send.resize(chunks);
    tr.down_recv.resize(chunks);
  }
  auto range = [&](const Tree& tr, size_t j) {
    size_t b = std::min(tr.count, j * chunk_elems), e = std::min(tr.count, (j + 1) * chunk_elems);
    return std::pair<size_t, size_t>{b, e - b};  // relative to tr.begin, in elements
  };
  // Step tags: (chunk, tree, direction).
  auto tag = [](size_t j, int k, int down) { return (j * 2 + k) * 2 + down; };
  auto post_up_recv = [&](int k, size_t j) {
    Tree& tr = trees[k];
    if (j >= chunks) return;
    auto [b, len] = range(tr, j);
    for (int i = 0; i < 2; ++i)
      if (tr.node.child[i] >= 0)
        tr.up_recv[i][j] = c.irecv(tr.node.child[i], tag(j, k, 0), tr.child_tmp[i] + b * es, len * es);
  };
  auto up = [&](int k, size_t j) {
    Tree& tr = trees[k];
    auto [b, len] = range(tr, j);
    char* mine = data + (tr.begin + b) * es;
    for (int i = 0; i < 2; ++i) {
      if (tr.node.child[i] < 0) continue;
      c.wait(tr.up_recv[i][j]);
      tr.up_recv[i][j].reset();
      reduce(mine, tr.child_tmp[i] + b * es, len, t, op);
    }
    post_up_recv(k, j + kWindow);
    if (tr.node.parent >= 0) tr.up_send[j] = c.isend(tr.node.parent, tag(j, k, 0), mine, len * es);
  };
  // The result of chunk j replaces our partial sum, so its receive is posted once the partial
  // sum has reached the parent: opportunistically (test) after each up step, or by waiting.
  auto post_down = [&](int k, size_t upto, bool block) {
    Tree& tr = trees[k];
    if (tr.node.parent < 0) return;
    for (; tr.down_posted < upto; ++tr.down_posted) {
      size_t j = tr.down_posted;
      if (block) c.wait(tr.up_send[j]);
      else if (!tr.up_send[j]->test()) return;
      tr.up_send[j].reset();
      auto [b, len] = range(tr, j);
      tr.down_recv[j] = c.irecv(tr.node.parent, tag(j, k, 1), data + (tr.begin + b) * es, len * es);
    }
  };
  std::vector<RequestPtr> down_sends;
  auto down = [&](int k, size_t j) {
    Tree& tr = trees[k];
    auto [b, len] = range(tr, j);
    char* mine = data + (tr.begin + b) * es;
    if (tr.node.parent >= 0) {
      post_down(k, j + 1, true);
      c.wait(tr.down_recv[j]);
      tr.down_recv[j].reset();
    }
    for (int i = 0; i < 2; ++i)
      if (tr.node.child[i] >= 0) down_sends.push_back(c.isend(tr.node.child[i], tag(j, k, 1), mine, len * es));
  };

  for (int k = 0; k < 2; ++k)
    for (size_t j = 0; j < kWindow; ++j) post_up_recv(k, j);
  for (size_t j = 0; j <= chunks; ++j) {
    if (j < chunks) {
      up(0, j);
      up(1, j);
      post_down(0, j + 1, false);
      post_down(1, j + 1, false);
    }
    if (j >= 1) {
      down(0, j - 1);
      down(1, j - 1);
    }
  }
  c.wait_all(down_sends);
}

}  // namespace trn::algo
