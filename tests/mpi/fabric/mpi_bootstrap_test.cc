// Under `mpirun -np N` the MPI bootstrap (rank, size and the address exchange from MPI) connects
// the same fabric endpoints a FileStore does; the test starts the real mpirun.
#include <catch2/catch.hpp>

#include <cstdio>
#include <vector>

#include "collectives/bootstrap/mpi_bootstrap.h"
#include "collectives/core/error.h"
#include "collectives/core/main.h"
#include "tests/support/process.h"

using namespace trn;
using namespace std::chrono_literals;

namespace {

uint8_t byte_at(int src, size_t i) { return static_cast<uint8_t>(i * 29 + src * 101 + (i >> 11)); }

std::vector<std::string> mpirun(int np, const std::string& child) {
  return {"mpirun", "--allow-run-as-root", "--oversubscribe", "-np", std::to_string(np),
          "-x", "TRN_FABRIC_PROVIDER", "-x", "TRN_FABRIC_SHM", "-x", "TRN_LOG_LEVEL",
          test::self_exe(), "--trn-child", child};
}

}  // namespace

// Each rank sends 1 MiB + rank bytes to every other rank and checks what it receives.
TRN_TEST_CHILD(mpi_exchange) {
  return run_main("fabric-mpi-test", [&] {
    mpi::Bootstrap mpi;
    if (!mpi::launched_by_mpirun()) throw usage_error("not started by mpirun");
    auto p = mpi.connect();
    const int n = mpi.size(), me = mpi.rank();
    if (p->rank() != me || p->size() != n) return 3;
    auto len_from = [](int src) { return (size_t{1} << 20) + src; };
    std::vector<std::vector<uint8_t>> in(n), out(n);
    std::vector<RequestPtr> reqs;
    for (int q = 0; q < n; ++q) {
      if (q == me) continue;
      in[q].resize(len_from(q));
      reqs.push_back(p->irecv(q, 42, in[q].data(), in[q].size()));
      out[q].resize(len_from(me));
      for (size_t i = 0; i < out[q].size(); ++i) out[q][i] = byte_at(me, i);
      reqs.push_back(p->isend(q, 42, out[q].data(), out[q].size()));
    }
    for (auto& r : reqs) r->wait(Deadline::after(30s));
    for (int q = 0; q < n; ++q)
      for (size_t i = 0; q != me && i < in[q].size(); ++i)
        if (in[q][i] != byte_at(q, i)) {
          std::printf("rank %d: byte %zu from rank %d differs\n", me, i, q);
          return 4;
        }
    mpi.barrier(Deadline::after(30s));
    std::printf("rank %d of %d ok: %s\n", me, n, p->describe().c_str());
    return 0;
  });
}

TEST_CASE("under mpirun the MPI bootstrap connects the endpoints", "[mpi]") {
  for (std::map<std::string, std::string> env :
       {std::map<std::string, std::string>{{"TRN_FABRIC_PROVIDER", "tcp"}, {"TRN_FABRIC_SHM", "0"}},
        std::map<std::string, std::string>{{"TRN_FABRIC_PROVIDER", "tcp"}, {"TRN_FABRIC_SHM", "1"}}}) {
    env["TRN_LOG_LEVEL"] = std::string("warn");
    for (int np : {2, 3}) {
      auto rs = test::run_all({test::ProcSpec{mpirun(np, "mpi_exchange"), env}}, 90s);
      INFO("np " << np << " shm " << env["TRN_FABRIC_SHM"] << ": " << rs[0].describe());
      CHECK(rs[0].ok());
      for (int r = 0; r < np; ++r) CHECK(rs[0].output.find(fmt::format("rank {} of {} ok", r, np)) != std::string::npos);
    }
  }
}
