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
  static const char* names[] = {"allreduce", "reducescatter", "allgather", "broadcast", "reduce", "alltoall"};
  return names[static_cast<int>(c)];
}

Coll parse_coll(const std::string& name) {
  for (Coll c : kAllColls)
    if (name == to_string(c)) return c;
  throw usage_error("unknown operation '{}' (use allreduce, reducescatter, allgather, broadcast, reduce or alltoall)",
                    name);
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

Outcome run_case(Communicator& comm, const Case& c, Deadline deadline) {
  const int n = comm.size(), r = comm.rank();
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
