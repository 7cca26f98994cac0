// trnrun's command line: `trnrun [options] [--] PROGRAM [ARGS...]`, parsed and validated into
// LaunchOptions. Options stop at the first argument that is not an option (or at `--`); what
// follows is the worker command, passed on verbatim. Every mistake is a usage error (exit 2)
// naming the option and the fix. The flags are one table (collectives/core/flags.h), which --help
// prints.
//
// Under a scheduler, defaults come from its environment (explicit options always win):
//  - Slurm (SLURM_JOB_ID and SLURM_NNODES set, as under `srun`): one trnrun per node;
//    --nnodes = SLURM_NNODES, --node-rank = SLURM_NODEID, --job-id = slurm-JOBID[.STEPID], and
//    --nproc-per-node = SLURM_NTASKS_PER_NODE when the allocation set it (--ntasks-per-node).
//    When srun starts several trnrun tasks per node (SLURM_NTASKS > SLURM_NNODES), each task is
//    its own agent: --nnodes = SLURM_NTASKS, --node-rank = SLURM_PROCID.
//  - Open MPI (OMPI_COMM_WORLD_SIZE set, as under `mpirun`): one trnrun per MPI process;
//    --nnodes = OMPI_COMM_WORLD_SIZE, --node-rank = OMPI_COMM_WORLD_RANK,
//    --job-id = ompi-OMPI_MCA_ess_base_jobid.
#pragma once

#include <string>
#include <vector>

#include "collectives/core/deadline.h"
#include "launcher/agent/agent_state.h"
#include "launcher/agent/binding.h"
#include "launcher/agent/env_lookup.h"

namespace trn::launch {

struct LaunchOptions {
  int min_nodes = 1;
  int max_nodes = 1;
  int nproc_per_node = 1;
  int node_rank_hint = -1;      // -1: the coordinator assigns
  std::string coordinator;      // HOST:PORT; empty: start an embedded one (one node only)
  std::string job_id;           // never empty after parsing
  std::string token_file;       // absolute path or empty
  // TLS to --coordinator (absolute paths or empty), for the agent and its workers alike: the CA
  // that verifies the coordinator's certificate, and a client certificate and key for mTLS.
  std::string tls_ca, tls_cert, tls_key;
  int max_restarts = 0;
  Bind bind = Bind::kAuto;      // --bind: each worker on its own CPUs (binding.h)
  Recovery recovery = Recovery::kRestart;  // --recovery: what a failure does to the survivors
  std::string log_dir;          // empty: console only
  bool tee = false;             // with log_dir: console as well
  bool dry_run = false;
  Duration monitor_interval = std::chrono::milliseconds(100);
  Duration grace_period = std::chrono::seconds(10);
  Duration join_timeout = std::chrono::seconds(300);  // default TRN_TIMEOUT
  std::string scheduler;        // "slurm", "openmpi" or "" (what the defaults came from)
  std::vector<std::string> command;  // command[0] resolved to an executable path
  bool help = false;            // -h or --help: the parse printed usage(); exit 0
};

// Parses args (without argv[0]). env supplies the scheduler's variables and PATH.
LaunchOptions parse_launch_options(const std::vector<std::string>& args, const EnvLookup& env);

// The --help text.
std::string usage();

// PROGRAM as an executable path: a name with '/' must exist and be executable, a bare name is
// looked up on PATH. A usage error otherwise.
std::string resolve_program(const std::string& program, const std::string& path_var);

// A fresh job id: "trn-" + 12 hex digits.
std::string generate_job_id();

}  // namespace trn::launch
