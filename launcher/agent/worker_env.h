// Who a worker is in its job: rank, world size, node, generation, coordinator. trnrun hands this
// to each worker as TRN_* variables (worker_env_vars); a worker reads it back with
// identity_from_environment(), which also understands Open MPI and Slurm, so the same program
// runs under `trnrun`, `mpirun -np N` and `srun -n N`.
//
// Precedence (the first that is present wins):
//  1. TRN_RANK (trnrun, or set by hand): TRN_RANK, TRN_WORLD_SIZE (required with TRN_RANK),
//     TRN_LOCAL_RANK, TRN_LOCAL_WORLD_SIZE, TRN_NODE_RANK, TRN_GENERATION.
//  2. OMPI_COMM_WORLD_RANK (mpirun): OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE; the node
//     rank is rank / local size (block mapping, mpirun's default).
//  3. SLURM_PROCID with SLURM_NTASKS (srun): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
//     SLURM_NODEID; the local world size from SLURM_NTASKS_PER_NODE, else SLURM_TASKS_PER_NODE.
//  4. None: a single process, rank 0 of 1.
// TRN_JOB_ID, TRN_COORDINATOR, TRN_TOKEN_FILE, TRN_TLS_CA, TRN_TLS_CERT, TRN_TLS_KEY and
// TRN_GENERATION are read in every case; without TRN_JOB_ID the
// job id comes from the launcher ("ompi-JOBID", "slurm-JOBID[.STEP]") or is "local".
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "launcher/agent/env_lookup.h"

namespace trn::launch {

enum class IdentitySource { kTrnrun, kOpenMpi, kSlurm, kSingle };
const char* to_string(IdentitySource source);

struct WorkerIdentity {
  int rank = 0;
  int local_rank = 0;
  int world_size = 1;
  int local_world_size = 1;
  int node_rank = 0;
  int64_t generation = 0;
  std::string job_id = "local";
  std::string coordinator;  // HOST:PORT, empty when none
  std::string token_file;   // empty when none
  std::string tls_ca, tls_cert, tls_key;  // PEM paths for TLS to the coordinator; empty when none
  IdentitySource source = IdentitySource::kSingle;
};

// The identity described by env; a usage error naming the variable when one is malformed or
// inconsistent (rank >= world size, TRN_RANK without TRN_WORLD_SIZE, ...).
WorkerIdentity identity_from(const EnvLookup& env);
// The identity of this process (TRN_* through the settings registry, the rest from getenv).
WorkerIdentity identity_from_environment();

// The TRN_* variables that give a worker this identity (TRN_TOKEN_FILE and TRN_TLS_* only when
// set).
std::map<std::string, std::string> worker_env_vars(const WorkerIdentity& id);

}  // namespace trn::launch
