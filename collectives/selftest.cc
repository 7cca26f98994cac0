#include "collectives/selftest.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "collectives/core/error.h"

namespace trn::selftest {
namespace {

void store(DataType t, void* base, size_t i, double v) {
  switch (t) {
    case DataType::kF32: static_cast<float*>(base)[i] = static_cast<float>(v); break;
    case DataType::kF64: static_cast<double*>(base)[i] = v; break;
    case DataType::kF16: static_cast<uint16_t*>(base)[i] = f32_to_f16(static_cast<float>(v)); break;
    case DataType::kBF16: static_cast<uint16_t*>(base)[i] = f32_to_bf16(static_cast<float>(v)); break;
    case DataType::kI32: static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v); break;
    case DataType::kI64: static_cast<int64_t*>(base)[i] = static_cast<int64_t>(v); break;
    case DataType::kU8: static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(static_cast<int64_t>(v) & 0xff); break;
  }
}

bool is_int(DataType t) { return t == DataType::kI32 || t == DataType::kI64 || t == DataType::kU8; }

// Reference reduction over ranks of the values f(rank), exact in double for our inputs.
template <class F>
double reference(const Case& c, int n, F f) {
  double acc = f(0);
  for (int r = 1; r < n; ++r) {
    double v = f(r);
    switch (c.op) {
      case ReduceOp::kSum: case ReduceOp::kAvg: acc += v; break;
      case ReduceOp::kProd: acc *= v; break;
      case ReduceOp::kMin: acc = std::min(acc, v); break;
      case ReduceOp::kMax: acc = std::max(acc, v); break;
    }
  }
  if (c.type == DataType::kU8 && c.op != ReduceOp::kMin && c.op != ReduceOp::kMax)
    acc = static_cast<double>(static_cast<int64_t>(acc) & 0xff);  // u8 arithmetic wraps
  if (c.op == ReduceOp::kAvg) acc = is_int(c.type) ? std::trunc(acc / n) : acc / n;
  return acc;
}

}  // namespace

const char* to_string(Coll c) {
  static const char* names[] = {"allreduce", "reducescatter", "allgather", "broadcast", "reduce", "alltoall",
                                "alltoallv"};
  return names[static_cast<int>(c)];
}

Coll parse_coll(const std::string& name) {
  for (Coll c : kAllColls)
    if (name == to_string(c)) return c;
  throw usage_error(
      "unknown operation '{}' (use allreduce, reducescatter, allgather, broadcast, reduce, alltoall or alltoallv)", name);
}

bool reduces(Coll c) { return c == Coll::kAllReduce || c == Coll::kReduceScatter || c == Coll::kReduce; }

std::string describe(const Case& c) {
  return fmt::format("{} {} {} count={} {} root={}", to_string(c.coll), trn::to_string(c.type),
                     reduces(c.coll) ? trn::to_string(c.op) : "-", c.count, c.in_place ? "in-place" : "out-of-place",
                     c.root);
}

double input_value(const Case& c, int rank, size_t index) {
  if (reduces(c.coll) && c.op == ReduceOp::kProd) {
    static const double signed_pat[] = {1, 2, -1, 1, 1}, unsigned_pat[] = {1, 2, 3, 1, 1};
    return (c.type == DataType::kU8 ? unsigned_pat : signed_pat)[(rank + index) % 5];
  }
  double v = static_cast<double>((rank * 7 + index * 3 + 1) % 7);
  return c.type == DataType::kU8 ? v : v - 3;
}

CountMatrix uneven_counts(size_t total, int n) {
  CountMatrix m(static_cast<size_t>(n) * n, 0);
  static const int kWeights[] = {2, 0, 1};
  int weight_sum = 0, last = 0;
  for (int d = 1; d < n; ++d)
    if (kWeights[(d - 1) % 3]) weight_sum += kWeights[(d - 1) % 3], last = d;
  const size_t own = total / n, rest = total - own;
  for (int i = 0; i < n; ++i) {
    m[static_cast<size_t>(i) * n + i] = own;
    size_t given = 0;
    for (int d = 1; d < n; ++d) {
      const int w = kWeights[(d - 1) % 3];
      const size_t c = d == last ? rest - given : rest / weight_sum * w;
      m[static_cast<size_t>(i) * n + (i + d) % n] = c;
      given += c;
    }
  }
  return m;
}

CountMatrix random_counts(uint64_t seed, size_t max, int n) {
  CountMatrix m(static_cast<size_t>(n) * n);
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (auto& c : m) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;  // xorshift64
    c = (x >> 8) % 4 == 0 ? 0 : (x >> 16) % (max + 1);
  }
  return m;
}

std::string describe(const VCase& c) {
  size_t total = 0;
  for (size_t v : c.counts) total += v;
  return fmt::format("alltoallv {} {} elements in all{}{}", trn::to_string(c.type), total, c.gaps ? " gaps" : "",
                     c.in_place ? " in-place" : "");
}

Outcome run_all_to_all_v(Communicator& comm, const VCase& c, Deadline deadline) {
  const int n = comm.size(), r = comm.rank();
  const size_t es = size_of(c.type), gap = c.gaps ? 3 : 0;
  if (c.counts.size() != static_cast<size_t>(n) * n)
    throw usage_error("run_all_to_all_v: {} counts for {} ranks", c.counts.size(), n);
  auto count = [&](int from, int to) { return c.counts[static_cast<size_t>(from) * n + to]; };
  // The element k that rank i sends rank j: exact in every type.
  auto value = [&](int i, int j, size_t k) {
    double v = static_cast<double>((i * 7 + j * 5 + k * 3 + 1) % 11);
    return c.type == DataType::kU8 ? v : v - 5;
  };
  // Layout of one side: regions in rank order, or in reverse with gaps.
  auto layout = [&](auto cnt, std::vector<size_t>& displs) {
    displs.assign(n, 0);
    size_t at = gap;
    for (int k = 0; k < n; ++k) {
      const int i = c.gaps ? n - 1 - k : k;
      displs[i] = at;
      at += cnt(i) + gap;
    }
    return at;
  };
  std::vector<size_t> sc(n), rc(n), sd, rd;
  for (int i = 0; i < n; ++i) sc[i] = count(r, i), rc[i] = count(i, r);
  const size_t recv_len = layout([&](int i) { return rc[i]; }, rd);
  size_t send_len = layout([&](int i) { return sc[i]; }, sd);
  // In place: the sends start a third of the way into the receive regions.
  const size_t send_at = c.in_place ? recv_len / 3 : 0;
  std::vector<char> out((c.in_place ? std::max(recv_len, send_at + send_len) : recv_len) * es + 1, 0x5a);
  std::vector<char> in_store(c.in_place ? 0 : send_len * es + 1, 0x5a);
  char* in = c.in_place ? out.data() + send_at * es : in_store.data();
  for (int j = 0; j < n; ++j)
    for (size_t k = 0; k < sc[j]; ++k) store(c.type, in, sd[j] + k, value(r, j, k));
  WorkPtr w;
  if (c.gaps)
    w = comm.all_to_all_v(in, sc, sd, out.data(), rc, rd, c.type);
  else
    w = comm.all_to_all_v(in, sc, {}, out.data(), rc, {}, c.type);
  w->wait(deadline);
  Outcome o;
  std::vector<char> want(es), fill(es, 0x5a);
  std::vector<bool> covered(recv_len, false);
  for (int i = 0; i < n; ++i)
    for (size_t k = 0; k < rc[i]; ++k) {
      covered[rd[i] + k] = true;
      store(c.type, want.data(), 0, value(i, r, k));
      if (std::memcmp(want.data(), out.data() + (rd[i] + k) * es, es) != 0 && o.wrong++ == 0)
        o.first = fmt::format("{}: rank {} of {}, element {} from rank {}: expected {}", describe(c), r, n, k, i,
                              value(i, r, k));
    }
  if (!c.in_place)  // the gaps between the receive regions stay as they were
    for (size_t e = 0; e < recv_len; ++e)
      if (!covered[e] && std::memcmp(out.data() + e * es, fill.data(), es) != 0 && o.wrong++ == 0)
        o.first = fmt::format("{}: rank {} of {}: element {} of out, outside every receive region, was written",
                              describe(c), r, n, e);
  return o;
}

Outcome run_case(Communicator& comm, const Case& c, Deadline deadline) {
  const int n = comm.size(), r = comm.rank();
  if (c.coll == Coll::kAllToAllV)
    return run_all_to_all_v(comm, VCase{c.type, uneven_counts(c.count * n, n), false, c.in_place}, deadline);
  const size_t es = size_of(c.type), cnt = c.count;
  const bool big_in = c.coll == Coll::kReduceScatter || c.coll == Coll::kAllToAll;
  const bool big_out = c.coll == Coll::kAllGather || c.coll == Coll::kAllToAll;
  std::vector<char> in((big_in ? n : 1) * cnt * es + 1), out((big_out ? n : 1) * cnt * es + 1, 0x5a);
  for (size_t i = 0; i < (big_in ? n : 1) * cnt; ++i) store(c.type, in.data(), i, input_value(c, r, i));

  void* src = in.data();
  void* dst = out.data();
  if (c.in_place) {
    switch (c.coll) {
      case Coll::kReduceScatter:  // out is block r of in
        dst = in.data() + r * cnt * es;
        break;
      case Coll::kAllGather:  // in is block r of out
        std::memcpy(out.data() + r * cnt * es, in.data(), cnt * es);
        src = out.data() + r * cnt * es;
        break;
      default:
        if (c.coll != Coll::kAllGather) dst = src;
    }
  }
  WorkPtr w;
  switch (c.coll) {
    case Coll::kAllReduce: w = comm.all_reduce(src, dst, cnt, c.type, c.op); break;
    case Coll::kReduceScatter: w = comm.reduce_scatter(src, dst, cnt, c.type, c.op); break;
    case Coll::kAllGather: w = comm.all_gather(src, dst, cnt, c.type); break;
    case Coll::kBroadcast:
      if (r != c.root && !c.in_place) std::memset(src, 0x5a, cnt * es);
      dst = src;
      w = comm.broadcast(src, cnt, c.type, c.root);
      break;
    case Coll::kReduce: w = comm.reduce(src, dst, cnt, c.type, c.op, c.root); break;
    case Coll::kAllToAll: w = comm.all_to_all(src, dst, cnt, c.type); break;
    case Coll::kAllToAllV: break;  // run_all_to_all_v, above
  }
  w->wait(deadline);
  Outcome o;
  if (c.coll == Coll::kReduce && r != c.root) {
    // Non-roots: the input is unchanged.
    for (size_t i = 0; i < cnt; ++i) {
      std::vector<char> want(es);
      store(c.type, want.data(), 0, input_value(c, r, i));
      if (std::memcmp(want.data(), static_cast<char*>(src) + i * es, es) != 0 && o.wrong++ == 0)
        o.first = fmt::format("{}: rank {} input changed at {}", describe(c), r, i);
    }
    return o;
  }
  const size_t out_count = (big_out ? n : 1) * cnt;
  std::vector<char> want(es);
  for (size_t i = 0; i < out_count; ++i) {
    double expected = 0;
    switch (c.coll) {
      case Coll::kAllReduce: case Coll::kReduce:
        expected = reference(c, n, [&](int q) { return input_value(c, q, i); });
        break;
      case Coll::kReduceScatter:
        expected = reference(c, n, [&](int q) { return input_value(c, q, r * cnt + i); });
        break;
      case Coll::kAllGather: expected = input_value(c, static_cast<int>(i / std::max<size_t>(cnt, 1)), i % cnt); break;
      case Coll::kBroadcast: expected = input_value(c, c.root, i); break;
      case Coll::kAllToAll: {
        int from = static_cast<int>(i / cnt);
        expected = input_value(c, from, r * cnt + i % cnt);
        break;
      }
      case Coll::kAllToAllV: break;
    }
    store(c.type, want.data(), 0, expected);
    const char* got = static_cast<const char*>(dst) + i * es;
    if (std::memcmp(want.data(), got, es) != 0 && o.wrong++ == 0)
      o.first = fmt::format("{}: rank {} of {} element {} expected {}", describe(c), r, n, i, expected);
  }
  return o;
}

std::string run_and_verify(Communicator& comm, const Case& c, Deadline deadline) {
  return run_case(comm, c, deadline).first;
}

}  // namespace trn::selftest
