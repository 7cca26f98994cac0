// Bootstrapping under mpirun: rank and size come from MPI_COMM_WORLD and the fabric addresses
// travel by MPI_Allgather, so the same binaries run under `mpirun -np N` with no coordinator and
// no shared directory. Nothing here runs unless a program asks: the library never calls MPI on
// its own, and this header does not include <mpi.h>.
//
//   trn::mpi::Bootstrap mpi;                  // MPI_Init unless the program already did
//   auto p2p = mpi.connect();                 // fabric::connect over mpi.store()
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "collectives/bootstrap/store.h"
#include "collectives/fabric/fabric.h"

namespace trn::mpi {

// True when this process was started by an MPI launcher (Open MPI's mpirun, or a PMI one).
bool launched_by_mpirun();

// A Store for the exchange pattern every bootstrap uses: each rank set()s its own keys, then
// get()s the others'. A get() of a key not seen yet runs one collective exchange in which every
// rank contributes all it set since the last one (MPI_Iallgather + MPI_Iallgatherv, polled
// until the deadline). Every rank must therefore reach its first such get() — they all do in
// fabric::connect. add() has no collective meaning and is a usage error: use FileStore or the
// coordinator's store where counters are needed.
class ExchangeStore : public Store {
 public:
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, Deadline deadline) override;
  int64_t add(const std::string& key, int64_t delta) override;

  // Every rank's string, in rank order (one collective).
  static std::vector<std::string> allgather(const std::string& mine, Deadline deadline);

 private:
  std::map<std::string, std::string> known_;
  std::map<std::string, std::string> pending_;
};

class Bootstrap {
 public:
  // Initialises MPI (MPI_THREAD_FUNNELED) unless already initialised; a usage error when MPI
  // cannot start.
  Bootstrap();
  // Finalises MPI only when this object initialised it, and not while an exception unwinds
  // (MPI_Finalize would wait for ranks that may never come; mpirun ends the job on the exit).
  ~Bootstrap();
  Bootstrap(const Bootstrap&) = delete;
  Bootstrap& operator=(const Bootstrap&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  Store& store() { return store_; }

  // fabric::connect(store(), rank(), size(), opts).
  std::shared_ptr<PointToPoint> connect(const fabric::Options& opts = fabric::Options::from_environment());

  // MPI_Barrier, polled until the deadline.
  void barrier(Deadline deadline);

 private:
  bool initialised_here_ = false;
  int rank_ = 0, size_ = 1;
  ExchangeStore store_;
};

}  // namespace trn::mpi
