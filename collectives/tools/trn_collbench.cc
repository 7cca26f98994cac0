// trn-collbench: collective bandwidth, shaped like nccl-tests.
//
//   mpirun -np 4 trn-collbench -b 8 -e 64M -f 2 -o allreduce -d f32 -r sum -a auto -c 1
//   trn-collbench --store-dir /tmp/s --rank 0 --size 2 ...   (or TRN_STORE_DIR/TRN_RANK/TRN_WORLD_SIZE)
//   mpirun -np 4 trn-collbench --mpi-anchor ...              (the same table for Open MPI's own calls)
//
// Columns: size (bytes), count (elements), type, redop, algorithm, time (us, mean per operation,
// slowest rank), algbw = size / time, busbw = algbw * nccl-tests' factor (all-reduce 2(n-1)/n,
// reduce-scatter, all-gather and all-to-all (n-1)/n, broadcast and reduce 1), #wrong (-c 1:
// output elements that differ from the reference, summed over ranks), p50 and p99 (us: the
// median and 99th percentile of the timed operations' times, each the slowest rank's; an
// operation's time is from the end of the one before, or the start, to its end, so the times of
// operations issued back to back add up to the mean's total). Scripts read the columns by
// position; new ones go at the end.
//
// -o alltoallv times Communicator::all_to_all_v (MPI_Alltoallv under --mpi-anchor) with
// selftest::uneven_counts: each rank sends size bytes in all, 1/n of them to itself and the rest
// to the others in weights 2, 0, 1, 2, 0, 1, ... by distance (j - i) mod n, so some pairs exchange
// nothing, others twice the mean, and as many bytes cross as in alltoall (whose busbw factor
// it keeps). -a picks its algorithm (pairwise|direct|auto), for alltoall too.
//
// --wire e4m3 runs the f32 all-reduce or reduce-scatter with fp8 on the wire
// (Communicator::all_reduce_e4m3); size and bandwidths still count the f32 data, so its rows
// compare with plain f32 rows as the time to reduce the same gradients.
#define OMPI_SKIP_MPICXX 1  // the C API only
#include <mpi.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "collectives/bootstrap/file_store.h"
#include "collectives/communicator.h"
#include "collectives/core/error.h"
#include "collectives/core/flags.h"
#include "collectives/core/log.h"
#include "collectives/core/main.h"
#include "collectives/core/settings.h"
#include "collectives/fabric/fabric.h"
#include "collectives/selftest.h"

using namespace trn;
using selftest::Coll;

namespace {

struct Args {
  size_t min_bytes = 8, max_bytes = 64 << 20, factor = 2;
  Coll coll = Coll::kAllReduce;
  DataType type = DataType::kF32;
  ReduceOp op = ReduceOp::kSum;
  Algo algo = Algo::kAuto;
  A2aAlgo a2a_algo = A2aAlgo::kAuto;
  std::string algo_name = "auto";  // -a, parsed once -o is known
  int iters = 20, warmup = 5, root = 0;
  bool check = false, mpi_anchor = false, measure = false;
  bool blocking = false;  // -z 1: wait for each operation before issuing the next
  int compute_us = 0;     // --compute-us: work on the thread before each operation
  bool e4m3 = false;      // --wire e4m3
  size_t chunk = 0;
  size_t offset = 64;  // buffers start this many bytes past a page boundary
  int spin_us = -1;  // fabric wait spin before sleeping; -1: the fabric's default
  std::string store_dir;
  int rank = -1, size = -1;
};

flags::Table table(Args* a) {
  auto on = [](bool* b) { return [b](auto&, auto& v) { *b = v == "1"; }; };
  return {
      .program = "trn-collbench",
      .summary = "\nCollective bandwidth, shaped like nccl-tests: one row per size from -b to -e, times -f.\n"
                 "Under mpirun the ranks bootstrap through MPI; otherwise through a FileStore (--store-dir or\n"
                 "TRN_STORE_DIR, --rank or TRN_RANK, --size or TRN_WORLD_SIZE).\n",
      .flags =
          {
              {.name = "-b", .target = flags::Bytes{&a->min_bytes}, .help = "smallest size", .value_name = "MIN"},
              {.name = "-e", .target = flags::Bytes{&a->max_bytes}, .help = "largest size", .value_name = "MAX",
               .default_text = "64M"},
              {.name = "-f", .target = flags::Bytes{&a->factor}, .help = "each size is the last times FACTOR (at least 2)",
               .value_name = "FACTOR"},
              {"-o", [a](auto&, auto& v) { a->coll = selftest::parse_coll(v); }, "the collective", "",
               "allreduce|reducescatter|allgather|broadcast|reduce|alltoall|alltoallv", "allreduce"},
              {"-d", [a](auto&, auto& v) { a->type = parse_data_type(v); }, "element type", "",
               "f32|f64|f16|bf16|i32|i64|u8", "f32"},
              {"-r", [a](auto&, auto& v) { a->op = parse_reduce_op(v); }, "reduction", "", "sum|prod|min|max|avg",
               "sum"},
              {"-a", [a](auto&, auto& v) { a->algo_name = v; }, "all-reduce algorithm (alltoall, alltoallv: pairwise|direct|auto)",
               "", "ring|tree|rhd|hier|auto", "auto"},
              {"-n", &a->iters, "timed operations per size (at least 1)", "", "ITERS"},
              {"-w", &a->warmup, "untimed operations first", "", "WARMUP"},
              {.name = "-c", .target = on(&a->check),
               .help = "1: compare every output with the reference and count the wrong elements",
               .default_text = "0", .choices = "0|1"},
              {.name = "-z", .target = on(&a->blocking), .help = "1: wait for each operation before issuing the next",
               .default_text = "0", .choices = "0|1"},
              {"--root", &a->root, "root rank of broadcast and reduce", "", "R"},
              {.name = "--chunk", .target = flags::Bytes{&a->chunk}, .help = "pipeline chunk of the algorithms",
               .default_text = "the communicator's"},
              {.name = "--offset", .target = flags::Bytes{&a->offset},
               .help = "the buffers start this many bytes past a page boundary (below 4096; 64 is where a "
                       "64-byte-aligned allocator such as PyTorch's puts a large tensor; malloc's is 16)"},
              {"--compute-us", &a->compute_us,
               "each operation after this many microseconds of work on the calling thread, as a training step's "
               "kernels run between its collectives; only the operations are timed",
               "", "US", "0", flags::Range::kNonNegative},
              {"--store-dir", &a->store_dir, "FileStore bootstrap directory", "", "DIR", "TRN_STORE_DIR"},
              {"--rank", &a->rank, "this rank (FileStore bootstrap)", "", "R", "TRN_RANK"},
              {"--size", &a->size, "ranks (FileStore bootstrap)", "", "N", "TRN_WORLD_SIZE"},
              {"--mpi-anchor", &a->mpi_anchor, "the same table for Open MPI's own calls"},
              {"--measure", &a->measure, "measure the transport first (alpha, beta) instead of taking its stated figures"},
              {"--spin-us", &a->spin_us, "fabric wait spin before sleeping", "", "US", "the fabric's"},
              {.name = "--wire",
               .target = [a](auto&, auto& v) { a->e4m3 = v == "e4m3"; },
               .help = "e4m3: the f32 all-reduce or reduce-scatter with fp8 on the wire (sizes and bandwidths "
                       "count the f32 data)",
               .default_text = "f32",
               .choices = "e4m3|f32"},
          },
      .style = flags::Style::kColon,
  };
}

// The command line; std::nullopt after printing --help.
std::optional<Args> parse(int argc, char** argv) {
  Args a;
  if (!flags::parse(table(&a), std::vector<std::string>(argv + 1, argv + argc))) return std::nullopt;
  if (a.factor < 2) throw usage_error("-f {}: the size factor must be at least 2", a.factor);
  if (a.min_bytes > a.max_bytes) throw usage_error("-b {} is larger than -e {}", a.min_bytes, a.max_bytes);
  if (a.iters < 1 || a.warmup < 0) throw usage_error("-n must be at least 1 and -w at least 0");
  if (a.coll == Coll::kAllToAll || a.coll == Coll::kAllToAllV) a.a2a_algo = parse_a2a_algo(a.algo_name);
  else a.algo = parse_algo(a.algo_name);
  if (a.offset >= 4096) throw usage_error("--offset {}: must be below the page size, 4096", a.offset);
  if (a.e4m3) {
    if (a.coll != Coll::kAllReduce && a.coll != Coll::kReduceScatter)
      throw usage_error("--wire e4m3 is for -o allreduce or reducescatter");
    if (a.type != DataType::kF32 || (a.op != ReduceOp::kSum && a.op != ReduceOp::kAvg))
      throw usage_error("--wire e4m3 reduces f32 data by sum or avg (-d f32 -r sum|avg)");
    if (a.check || a.mpi_anchor)
      throw usage_error("--wire e4m3 rounds, so -c 1 cannot compare it exactly, and MPI has no such wire");
  }
  return a;
}

bool under_mpirun() { return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK"); }

double bus_factor(Coll c, int n) {
  switch (c) {
    case Coll::kAllReduce: return 2.0 * (n - 1) / n;
    case Coll::kReduceScatter: case Coll::kAllGather: case Coll::kAllToAll: case Coll::kAllToAllV:
      return double(n - 1) / n;
    default: return 1.0;
  }
}

// Elements per rank block for the collectives whose size is the whole buffer.
size_t total_count(const Args& a, size_t bytes, int n) {
  size_t count = bytes / size_of(a.type);
  bool blocks = a.coll == Coll::kReduceScatter || a.coll == Coll::kAllGather || a.coll == Coll::kAllToAll ||
                a.coll == Coll::kAllToAllV;
  return blocks ? count / n * n : count;
}

MPI_Datatype mpi_type(DataType t) {
  switch (t) {
    case DataType::kF32: return MPI_FLOAT;
    case DataType::kF64: return MPI_DOUBLE;
    case DataType::kI32: return MPI_INT32_T;
    case DataType::kI64: return MPI_INT64_T;
    case DataType::kU8: return MPI_UINT8_T;
    default: throw usage_error("--mpi-anchor: MPI has no {} type; use f32, f64, i32, i64 or u8", to_string(t));
  }
}
MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return MPI_SUM;
    case ReduceOp::kProd: return MPI_PROD;
    case ReduceOp::kMin: return MPI_MIN;
    case ReduceOp::kMax: return MPI_MAX;
    default: throw usage_error("--mpi-anchor: MPI has no avg; use sum, prod, min or max");
  }
}

// One operation of the benchmark over buffers sized for the largest case.
struct Runner {
  const Args& a;
  int n, rank;
  Communicator* comm = nullptr;  // null: MPI anchor
  // Both sides use the same buffers, which start --offset bytes past a page boundary: the
  // alignment of a buffer changes how fast the kernel and memcpy copy it (core/aligned.h).
  std::vector<char> in_store, out_store;
  char *in = nullptr, *out = nullptr;
  // alltoallv: this rank's counts and displacements for the current count, packed in rank order.
  size_t v_count = SIZE_MAX;
  std::vector<size_t> sc{}, sd{}, rc{}, rd{};
  std::vector<int> isc{}, isd{}, irc{}, ird{};  // the same for MPI

  void plan_v(size_t count) {
    if (count == v_count) return;
    v_count = count;
    const selftest::CountMatrix m = selftest::uneven_counts(count, n);
    sc.assign(n, 0), sd.assign(n, 0), rc.assign(n, 0), rd.assign(n, 0);
    size_t s_at = 0, r_at = 0;
    for (int i = 0; i < n; ++i) {
      sc[i] = m[size_t(rank) * n + i], sd[i] = s_at, s_at += sc[i];
      rc[i] = m[size_t(i) * n + rank], rd[i] = r_at, r_at += rc[i];
    }
    if (!comm) {
      if (std::max(s_at, r_at) > size_t(INT_MAX))
        throw usage_error("--mpi-anchor: MPI_Alltoallv counts are ints; {} elements is too many", std::max(s_at, r_at));
      auto ints = [](const std::vector<size_t>& v) { return std::vector<int>(v.begin(), v.end()); };
      isc = ints(sc), isd = ints(sd), irc = ints(rc), ird = ints(rd);
    }
  }

  void allocate(size_t bytes, size_t offset) {
    auto place = [&](std::vector<char>& store, char fill) {
      store.assign(bytes + 2 * 4096, fill);
      auto p = reinterpret_cast<uintptr_t>(store.data());
      return reinterpret_cast<char*>(((p + 4095) & ~uintptr_t{4095}) + offset);
    };
    in = place(in_store, 1);
    out = place(out_store, 0);
  }

  WorkPtr issue(size_t count) {
    const size_t block = count / n;
    switch (a.coll) {
      case Coll::kAllReduce:
        if (a.e4m3)
          return comm->all_reduce_e4m3(reinterpret_cast<const float*>(in), reinterpret_cast<float*>(out), count, a.op);
        return comm->all_reduce(in, out, count, a.type, a.op);
      case Coll::kReduceScatter:
        if (a.e4m3)
          return comm->reduce_scatter_e4m3(reinterpret_cast<const float*>(in), reinterpret_cast<float*>(out), block,
                                           a.op);
        return comm->reduce_scatter(in, out, block, a.type, a.op);
      case Coll::kAllGather: return comm->all_gather(in, out, block, a.type);
      case Coll::kBroadcast: return comm->broadcast(out, count, a.type, a.root);
      case Coll::kReduce: return comm->reduce(in, out, count, a.type, a.op, a.root);
      case Coll::kAllToAll: return comm->all_to_all(in, out, block, a.type);
      case Coll::kAllToAllV: plan_v(count); return comm->all_to_all_v(in, sc, sd, out, rc, rd, a.type);
    }
    return nullptr;
  }

  void mpi(size_t count) {
    const int block = static_cast<int>(count / n), c = static_cast<int>(count);
    MPI_Datatype t = mpi_type(a.type);
    switch (a.coll) {
      case Coll::kAllReduce: MPI_Allreduce(in, out, c, t, mpi_op(a.op), MPI_COMM_WORLD); break;
      case Coll::kReduceScatter:
        MPI_Reduce_scatter_block(in, out, block, t, mpi_op(a.op), MPI_COMM_WORLD);
        break;
      case Coll::kAllGather: MPI_Allgather(in, block, t, out, block, t, MPI_COMM_WORLD); break;
      case Coll::kBroadcast: MPI_Bcast(out, c, t, a.root, MPI_COMM_WORLD); break;
      case Coll::kReduce: MPI_Reduce(in, out, c, t, mpi_op(a.op), a.root, MPI_COMM_WORLD); break;
      case Coll::kAllToAll: MPI_Alltoall(in, block, t, out, block, t, MPI_COMM_WORLD); break;
      case Coll::kAllToAllV:
        plan_v(count);
        MPI_Alltoallv(in, isc.data(), isd.data(), t, out, irc.data(), ird.data(), t, MPI_COMM_WORLD);
        break;
    }
  }

  // Microseconds of each timed operation on this rank (see the p50 and p99 columns).
  std::vector<double> times{};

  // Mean microseconds per operation on this rank: iters operations issued back to back. Leaves
  // each operation's time in times.
  double time(size_t count, int iters) {
    times.assign(iters, 0);
    if (comm && a.compute_us > 0) {
      // Each operation after compute_us of work on this thread, as a training step's kernels
      // run between its collectives: only the operations count, each waited for, and, as in a
      // step, what a rank waits in one includes its peers arriving late (no barrier aligns them)
      // and waking its threads after the work. Only with the fabric bootstrap (not under MPI's
      // own calls).
      double us = 0;
      volatile double sink = 1;
      for (int i = 0; i < iters; ++i) {
        const auto busy_until = std::chrono::steady_clock::now() + std::chrono::microseconds(a.compute_us);
        while (std::chrono::steady_clock::now() < busy_until)
          for (int k = 0; k < 256; ++k) sink = sink * 1.0000001 + 1e-9;
        const auto t0 = std::chrono::steady_clock::now();
        issue(count)->wait();
        times[i] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        us += times[i];
      }
      return us / iters;
    }
    using std::chrono::steady_clock;
    auto us_between = [](steady_clock::time_point from, steady_clock::time_point to) {
      return std::chrono::duration<double, std::micro>(to - from).count();
    };
    auto t0 = steady_clock::now();
    if (comm) {
      std::vector<WorkPtr> works(iters);
      for (int i = 0; i < iters; ++i) {
        works[i] = issue(count);
        if (a.blocking) works[i]->wait();
      }
      works.back()->wait();
      // Operations on one communicator end in issue order: each one's time runs from the end of
      // the one before (or t0).
      auto prev = t0;
      for (int i = 0; i < iters; ++i) {
        auto end = std::max(works[i]->ran().second, prev);
        times[i] = us_between(prev, end);
        prev = end;
      }
    } else {
      auto prev = t0;
      for (int i = 0; i < iters; ++i) {
        mpi(count);
        auto end = steady_clock::now();
        times[i] = us_between(prev, end);
        prev = end;
      }
    }
    return us_between(t0, steady_clock::now()) / iters;
  }

  // The p-th percentile (nearest rank) of times.
  double percentile(double p) const {
    std::vector<double> v = times;
    std::sort(v.begin(), v.end());
    size_t k = static_cast<size_t>(std::ceil(p / 100.0 * v.size()));
    return v[std::clamp<size_t>(k, 1, v.size()) - 1];
  }

  void barrier() {
    if (comm) comm->barrier()->wait();
    else MPI_Barrier(MPI_COMM_WORLD);
  }
  // Each of v's values, the largest over the ranks.
  std::vector<double> max_over_ranks(std::vector<double> v) {
    std::vector<double> out(v.size());
    const int k = static_cast<int>(v.size());
    if (comm) comm->all_reduce(v.data(), out.data(), v.size(), DataType::kF64, ReduceOp::kMax)->wait();
    else MPI_Allreduce(v.data(), out.data(), k, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return out;
  }
};

const char* algo_name(const Args& a, Communicator* comm, size_t bytes, int n) {
  if (!comm) return "mpi";
  if (a.e4m3) return a.coll == Coll::kAllReduce ? "a2a+ring" : "a2a";
  switch (a.coll) {
    case Coll::kAllReduce: return to_string(comm->algorithm_for(bytes));
    case Coll::kBroadcast: return bytes <= 64 * 1024 || n == 2 ? "binomial" : "chain";
    case Coll::kReduce: return "chain";
    case Coll::kAllToAll: case Coll::kAllToAllV:
      return to_string(comm->a2a_algorithm_for(bytes, bytes));  // sends and receives bytes
    default: return "ring";
  }
}

int run(int argc, char** argv) {
  std::optional<Args> parsed = parse(argc, argv);
  if (!parsed) return 0;
  Args& a = *parsed;
  const bool mpi = under_mpirun() || a.mpi_anchor;
  if (mpi) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &a.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &a.size);
  } else {
    if (a.store_dir.empty()) a.store_dir = settings::get("TRN_STORE_DIR");
    if (a.rank < 0 && !settings::get("TRN_RANK").empty()) a.rank = static_cast<int>(settings::get_int("TRN_RANK"));
    if (a.size < 0 && !settings::get("TRN_WORLD_SIZE").empty()) a.size = static_cast<int>(settings::get_int("TRN_WORLD_SIZE"));
    if (a.store_dir.empty() || a.rank < 0 || a.size < 1)
      throw usage_error("no bootstrap: run under mpirun, or give --store-dir, --rank and --size "
                        "(or TRN_STORE_DIR, TRN_RANK, TRN_WORLD_SIZE)");
    if (a.rank >= a.size) throw usage_error("--rank {} is not below --size {}", a.rank, a.size);
  }
  log::set_rank(a.rank);
  if (a.root < 0 || a.root >= a.size) throw usage_error("--root {} is not a rank of the {} ranks", a.root, a.size);

  std::shared_ptr<Communicator> comm;
  std::string transport = "Open MPI";
  std::string tmp_dir;
  if (!a.mpi_anchor) {
    if (mpi) {  // MPI bootstrap: rank 0 makes a store directory and tells the others its name
      char path[256] = {0};
      if (a.rank == 0) {
        std::snprintf(path, sizeof(path), "/tmp/trn-collbench-XXXXXX");
        if (!mkdtemp(path)) throw usage_error("cannot create a directory in /tmp for the bootstrap store");
      }
      MPI_Bcast(path, sizeof(path), MPI_CHAR, 0, MPI_COMM_WORLD);
      a.store_dir = tmp_dir = path;
    }
    FileStore store(a.store_dir);
    fabric::Options fo = fabric::Options::from_environment();
    if (a.spin_us >= 0) fo.spin = std::chrono::microseconds(a.spin_us);
    auto p2p = fabric::connect(store, a.rank, a.size, fo);
    transport = p2p->describe();
    CommOptions o;
    o.algo = a.algo;
    o.a2a_algo = a.a2a_algo;
    o.measure = a.measure;
    if (a.chunk) o.chunk_bytes = a.chunk;
    comm = std::make_shared<Communicator>(p2p, o);
    if (mpi) MPI_Barrier(MPI_COMM_WORLD);
    if (!tmp_dir.empty() && a.rank == 0) std::filesystem::remove_all(tmp_dir);
  }
  const int n = a.size;
  Runner run{a, n, a.rank, comm.get(), {}, {}};
  size_t max_count = total_count(a, a.max_bytes, n);
  run.allocate(max_count * size_of(a.type) + 64, a.offset);

  if (a.rank == 0) {
    std::printf("# trn-collbench %s: %d ranks, transport %s, %d iterations, %d warm-up\n", selftest::to_string(a.coll),
                n, transport.c_str(), a.iters, a.warmup);
    if (comm) std::printf("# layout: %s\n", comm->host_layout().describe().c_str());
    if (comm && a.coll == Coll::kAllReduce && a.algo == Algo::kAuto)
      std::printf("# cost model: %s\n", describe_crossovers(comm->host_layout(), comm->cost_model()).c_str());
    std::printf("# %12s %12s %6s %6s %9s %12s %12s %12s %8s %10s %10s\n", "size(B)", "count", "type", "redop", "algo",
                "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong", "p50(us)", "p99(us)");
  }
  for (size_t bytes = a.min_bytes; bytes <= a.max_bytes; bytes = bytes ? bytes * a.factor : 1) {
    const size_t count = total_count(a, bytes, n);
    const size_t real_bytes = count * size_of(a.type);
    long long wrong = 0;
    if (a.check && comm) {
      selftest::Case c{a.coll, a.type, a.op, count / ((a.coll == Coll::kAllReduce || a.coll == Coll::kBroadcast ||
                                                       a.coll == Coll::kReduce) ? 1 : n), false, a.root};
      long long mine = static_cast<long long>(selftest::run_case(*comm, c, Deadline::from_default_timeout()).wrong);
      comm->all_reduce(&mine, &wrong, 1, DataType::kI64, ReduceOp::kSum)->wait();
    }
    if (a.warmup) run.time(count, a.warmup);
    run.barrier();
    const double mean = run.time(count, a.iters);
    const std::vector<double> worst = run.max_over_ranks({mean, run.percentile(50), run.percentile(99)});
    const double us = worst[0];
    double algbw = real_bytes / us / 1e3;
    if (a.rank == 0) {
      std::string wrong_s = a.check && comm ? std::to_string(wrong) : "N/A";
      std::printf("  %12zu %12zu %6s %6s %9s %12.2f %12.3f %12.3f %8s %10.2f %10.2f\n", real_bytes, count,
                  a.e4m3 ? "e4m3" : to_string(a.type), selftest::reduces(a.coll) ? to_string(a.op) : "none",
                  algo_name(a, comm.get(), real_bytes, n), us, algbw, algbw * bus_factor(a.coll, n), wrong_s.c_str(),
                  worst[1], worst[2]);
      std::fflush(stdout);
    }
    if (wrong) {
      if (mpi) MPI_Finalize();
      return 1;
    }
  }
  comm.reset();
  if (mpi) MPI_Finalize();
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return run_main("trn-collbench", [&] { return run(argc, argv); }); }
