// Under mpirun: trn's collectives on the same inputs as Open MPI's own MPI_Allreduce,
// MPI_Reduce_scatter_block, MPI_Allgather, MPI_Bcast and MPI_Alltoallv, compared element by element (exactly
// for integers, min/max and data movement; within rounding for float sums, whose order differs).
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>
#include <stdlib.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <sstream>

#include "collectives/bootstrap/file_store.h"
#include "collectives/communicator.h"
#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "collectives/core/main.h"
#include "collectives/fabric/fabric.h"
#include "collectives/selftest.h"
#include "tests/support/process.h"

using namespace trn;
using namespace trn::test;
using namespace std::chrono_literals;

namespace {

// MPI tells every rank the name of a store directory rank 0 made; the fabric bootstraps there.
std::shared_ptr<Communicator> join_with_mpi(int rank, int size) {
  char path[256] = {0};
  if (rank == 0) {
    std::snprintf(path, sizeof(path), "/tmp/trn-mpi-test-XXXXXX");
    if (!mkdtemp(path)) throw usage_error("cannot create a directory in /tmp");
  }
  MPI_Bcast(path, sizeof(path), MPI_CHAR, 0, MPI_COMM_WORLD);
  FileStore store(path);
  auto comm = std::make_shared<Communicator>(fabric::connect(store, rank, size));
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) std::filesystem::remove_all(path);
  return comm;
}

template <class T>
size_t count_differences(const std::vector<T>& a, const std::vector<T>& b, const std::vector<double>& tol) {
  size_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    double t = tol.empty() ? 0 : tol[i];
    if (std::abs(double(a[i]) - double(b[i])) > t) ++bad;
  }
  return bad;
}

}  // namespace

TRN_TEST_CHILD(mpi_compare) {
  int argc = 0;
  char** argv = nullptr;
  MPI_Init(&argc, &argv);
  int code = run_main("mpi_compare", [&] {
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    log::set_rank(rank);
    auto comm = join_with_mpi(rank, size);
    int failures = 0;
    auto report = [&](const char* what, size_t bad) {
      if (bad) {
        std::fprintf(stderr, "rank %d: %s: %zu elements differ from Open MPI\n", rank, what, bad);
        ++failures;
      }
    };
    std::mt19937 rng(1234 + rank);
    std::normal_distribution<float> normal;
    const size_t n = 100003;
    std::vector<float> xf(n);
    std::vector<double> xd(n);
    std::vector<int32_t> xi(n);
    for (size_t i = 0; i < n; ++i) {
      xf[i] = normal(rng);
      xd[i] = normal(rng);
      xi[i] = static_cast<int32_t>(rng() % 2001) - 1000;
    }
    // Float sums differ only by rounding: bound by size * eps * sum |x| (gathered with MPI).
    std::vector<float> absf(n), sum_abs(n);
    for (size_t i = 0; i < n; ++i) absf[i] = std::abs(xf[i]);
    MPI_Allreduce(absf.data(), sum_abs.data(), n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    std::vector<double> tol(n);
    for (size_t i = 0; i < n; ++i) tol[i] = 2.0 * size * 1.2e-7 * sum_abs[i];

    for (Algo algo : {Algo::kRing, Algo::kTree, Algo::kRhd}) {
      comm->set_algorithm(algo);
      std::vector<float> tf(n), mf(n);
      comm->all_reduce(xf.data(), tf.data(), n, DataType::kF32, ReduceOp::kSum)->wait();
      MPI_Allreduce(xf.data(), mf.data(), n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      report((std::string("all_reduce f32 sum ") + to_string(algo)).c_str(), count_differences(tf, mf, tol));
      comm->all_reduce(xf.data(), tf.data(), n, DataType::kF32, ReduceOp::kMin)->wait();
      MPI_Allreduce(xf.data(), mf.data(), n, MPI_FLOAT, MPI_MIN, MPI_COMM_WORLD);
      report("all_reduce f32 min", count_differences(tf, mf, {}));
      std::vector<int32_t> ti(n), mi(n);
      comm->all_reduce(xi.data(), ti.data(), n, DataType::kI32, ReduceOp::kSum)->wait();
      MPI_Allreduce(xi.data(), mi.data(), n, MPI_INT32_T, MPI_SUM, MPI_COMM_WORLD);
      report("all_reduce i32 sum", count_differences(ti, mi, {}));
      std::vector<double> td(n), md(n);
      comm->all_reduce(xd.data(), td.data(), n, DataType::kF64, ReduceOp::kMax)->wait();
      MPI_Allreduce(xd.data(), md.data(), n, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      report("all_reduce f64 max", count_differences(td, md, {}));
    }
    const size_t block = n / size;
    {
      std::vector<int32_t> t(block), m(block);
      comm->reduce_scatter(xi.data(), t.data(), block, DataType::kI32, ReduceOp::kSum)->wait();
      MPI_Reduce_scatter_block(xi.data(), m.data(), block, MPI_INT32_T, MPI_SUM, MPI_COMM_WORLD);
      report("reduce_scatter i32 sum", count_differences(t, m, {}));
      std::vector<float> tf(block), mf(block);
      comm->reduce_scatter(xf.data(), tf.data(), block, DataType::kF32, ReduceOp::kSum)->wait();
      MPI_Reduce_scatter_block(xf.data(), mf.data(), block, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      std::vector<double> tol_block(tol.begin() + rank * block, tol.begin() + (rank + 1) * block);
      report("reduce_scatter f32 sum", count_differences(tf, mf, tol_block));
    }
    {
      std::vector<double> t(block * size), m(block * size);
      comm->all_gather(xd.data(), t.data(), block, DataType::kF64)->wait();
      MPI_Allgather(xd.data(), block, MPI_DOUBLE, m.data(), block, MPI_DOUBLE, MPI_COMM_WORLD);
      report("all_gather f64", count_differences(t, m, {}));
    }
    for (size_t count : {size_t{1000}, n}) {
      const int root = size - 1;
      std::vector<float> t(xf.begin(), xf.begin() + count), m = t;
      comm->broadcast(t.data(), count, DataType::kF32, root)->wait();
      MPI_Bcast(m.data(), count, MPI_FLOAT, root, MPI_COMM_WORLD);
      report("broadcast f32", count_differences(t, m, {}));
    }
    for (A2aAlgo algo : {A2aAlgo::kDirect, A2aAlgo::kPairwise}) {
      // Random counts with zeros, every rank's regions in its own order (reverse), 2 apart.
      comm->set_a2a_algorithm(algo);
      const selftest::CountMatrix counts = selftest::random_counts(77, 20000, size);
      std::vector<int> sc(size), sd(size), rc(size), rd(size);
      int s_at = 2, r_at = 2;
      for (int k = size - 1; k >= 0; --k) {
        sc[k] = int(counts[size_t(rank) * size + k]), sd[k] = s_at, s_at += sc[k] + 2;
        rc[k] = int(counts[size_t(k) * size + rank]), rd[k] = r_at, r_at += rc[k] + 2;
      }
      std::vector<int32_t> t(r_at, -7), m(r_at, -7);
      std::vector<size_t> zsc(sc.begin(), sc.end()), zsd(sd.begin(), sd.end()), zrc(rc.begin(), rc.end()),
          zrd(rd.begin(), rd.end());
      comm->all_to_all_v(xi.data(), zsc, zsd, t.data(), zrc, zrd, DataType::kI32)->wait();
      MPI_Alltoallv(xi.data(), sc.data(), sd.data(), MPI_INT32_T, m.data(), rc.data(), rd.data(), MPI_INT32_T,
                    MPI_COMM_WORLD);
      report((std::string("all_to_all_v i32 ") + to_string(algo)).c_str(), count_differences(t, m, {}));
    }
    comm->barrier()->wait();
    return failures ? 1 : 0;
  });
  MPI_Finalize();
  return code;
}

namespace {

ProcSpec mpirun(int n, std::vector<std::string> program, const std::string& btl) {
  std::vector<std::string> argv = {"mpirun", "--oversubscribe", "-np", std::to_string(n), "--mca", "btl", btl};
  argv.insert(argv.end(), program.begin(), program.end());
  return ProcSpec{argv,
                  {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}, {"TRN_LOG_LEVEL", "warn"}}};
}

}  // namespace

TEST_CASE("under mpirun trn's collectives agree with Open MPI's", "[mpi]") {
  for (int n : {3, 4}) {
    auto rs = run_all({mpirun(n, {self_exe(), "--trn-child", "mpi_compare"}, "self,vader")}, 180s);
    INFO(n << " ranks: " << rs[0].describe());
    CHECK(rs[0].ok());
  }
}

TEST_CASE("trn-collbench under mpirun bootstraps through MPI and checks its results", "[mpi]") {
  auto rs = run_all({mpirun(4, {bin("trn-collbench"), "-b", "8", "-e", "4M", "-f", "8", "-c", "1", "-n", "2", "-w", "1"},
                            "self,tcp")},
                    180s);
  INFO(rs[0].describe());
  REQUIRE(rs[0].ok());
  CHECK_THAT(rs[0].output, Catch::Contains("4 ranks"));
  int rows = 0;
  std::istringstream lines(rs[0].output);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] != ' ') continue;
    ++rows;
    std::istringstream w(line);
    std::string col[9];
    for (auto& c : col) w >> c;
    CHECK(col[8] == "0");  // #wrong (p50 and p99 follow)
  }
  CHECK(rows == 7);  // 8 B, 64 B, .. 2 MiB (the next, 16 MiB, is above -e 4M)
}

TEST_CASE("trn-collbench times alltoallv for trn and, with --mpi-anchor, for MPI_Alltoallv", "[mpi]") {
  for (bool anchor : {false, true}) {
    std::vector<std::string> args = {bin("trn-collbench"), "-o", "alltoallv", "-b", "1K", "-e", "1M", "-f", "32",
                                     "-n", "3", "-w", "1"};
    args.push_back(anchor ? "--mpi-anchor" : "-c");
    if (!anchor) args.push_back("1");
    auto rs = run_all({mpirun(3, args, "self,vader")}, 180s);
    INFO(rs[0].describe());
    REQUIRE(rs[0].ok());
    int rows = 0;
    std::istringstream lines(rs[0].output);
    for (std::string line; std::getline(lines, line);) {
      if (line.empty() || line[0] != ' ') continue;
      ++rows;
      std::istringstream w(line);
      std::string col[9];
      for (auto& c : col) w >> c;
      CHECK(col[4] == (anchor ? "mpi" : col[0] == "1048572" ? "pairwise" : "direct"));
      CHECK(col[8] == (anchor ? "N/A" : "0"));
    }
    CHECK(rows == 3);  // 1 KiB, 32 KiB, 1 MiB (rounded down to a multiple of 3 elements)
  }
}
