#include "collectives/bootstrap/mpi_bootstrap.h"

#include <mpi.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <thread>

#include "collectives/core/error.h"
#include "collectives/core/log.h"

namespace trn::mpi {
namespace {

// Polls a non-blocking MPI request until it completes or the deadline passes.
void wait_request(MPI_Request* req, Deadline deadline, const char* what) {
  auto nap = std::chrono::microseconds(20);
  for (;;) {
    int done = 0;
    MPI_Test(req, &done, MPI_STATUS_IGNORE);
    if (done) return;
    if (deadline.expired())
      throw timeout_error("MPI bootstrap: {} did not complete by the deadline: did every rank reach it?", what);
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::microseconds(5000));
  }
}

void put_u32(std::string& s, uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); }
uint32_t get_u32(const std::string& s, size_t* off) {
  uint32_t v;
  if (*off + 4 > s.size()) throw internal_error("MPI bootstrap: truncated exchange record");
  std::memcpy(&v, s.data() + *off, 4);
  *off += 4;
  return v;
}

}  // namespace

bool launched_by_mpirun() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(v)) return true;
  return false;
}

void ExchangeStore::set(const std::string& key, const std::string& value) {
  known_[key] = value;
  pending_[key] = value;
}

std::string ExchangeStore::get(const std::string& key, Deadline deadline) {
  auto it = known_.find(key);
  if (it != known_.end()) return it->second;
  std::string mine;
  for (const auto& [k, v] : pending_) {
    put_u32(mine, static_cast<uint32_t>(k.size()));
    mine += k;
    put_u32(mine, static_cast<uint32_t>(v.size()));
    mine += v;
  }
  pending_.clear();
  for (const std::string& theirs : allgather(mine, deadline)) {
    size_t off = 0;
    while (off < theirs.size()) {
      uint32_t kl = get_u32(theirs, &off);
      std::string k = theirs.substr(off, kl);
      off += kl;
      uint32_t vl = get_u32(theirs, &off);
      known_[k] = theirs.substr(off, vl);
      off += vl;
    }
  }
  it = known_.find(key);
  if (it == known_.end())
    throw usage_error("MPI bootstrap: key '{}' was not set by any rank before the exchange", key);
  return it->second;
}

int64_t ExchangeStore::add(const std::string& key, int64_t) {
  throw usage_error("MPI bootstrap store: add('{}') is not supported (it only exchanges addresses); use "
                    "TRN_STORE_DIR or the coordinator for counters", key);
}

std::vector<std::string> ExchangeStore::allgather(const std::string& mine, Deadline deadline) {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int len = static_cast<int>(mine.size());
  std::vector<int> lens(size), offsets(size);
  MPI_Request req;
  MPI_Iallgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, MPI_COMM_WORLD, &req);
  wait_request(&req, deadline, "the address-length exchange (MPI_Iallgather)");
  int total = 0;
  for (int i = 0; i < size; ++i) {
    offsets[i] = total;
    total += lens[i];
  }
  std::string all(static_cast<size_t>(total), '\0');
  MPI_Iallgatherv(mine.data(), len, MPI_CHAR, all.data(), lens.data(), offsets.data(), MPI_CHAR,
                  MPI_COMM_WORLD, &req);
  wait_request(&req, deadline, "the address exchange (MPI_Iallgatherv)");
  std::vector<std::string> out(size);
  for (int i = 0; i < size; ++i) out[i] = all.substr(offsets[i], lens[i]);
  return out;
}

Bootstrap::Bootstrap() {
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited) {
    int provided = 0;
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
      throw usage_error("MPI_Init failed: run the program under mpirun, or bootstrap with TRN_STORE_DIR");
    initialised_here_ = true;
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
  log::set_rank(rank_);
  log::debug(log::Subsys::kInit, "MPI bootstrap: rank {} of {}", rank_, size_);
}

Bootstrap::~Bootstrap() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!initialised_here_ || finalized) return;
  // MPI_Finalize waits for every rank to reach it. A rank leaving on an error (unwinding an
  // exception) must not: the others may be blocked in a collective it left, and none would
  // ever exit. It exits without finalising, and mpirun, seeing a non-zero exit, ends the job.
  if (std::uncaught_exceptions() > 0) {
    log::debug(log::Subsys::kInit, "MPI bootstrap: leaving on an error without MPI_Finalize");
    return;
  }
  MPI_Finalize();
}

std::shared_ptr<PointToPoint> Bootstrap::connect(const fabric::Options& opts) {
  return fabric::connect(store_, rank_, size_, opts);
}

void Bootstrap::barrier(Deadline deadline) {
  MPI_Request req;
  MPI_Ibarrier(MPI_COMM_WORLD, &req);
  wait_request(&req, deadline, "MPI_Ibarrier");
}

}  // namespace trn::mpi
