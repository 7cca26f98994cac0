// From options and a rendezvous result to the exact workers this node starts (ranks, TRN_*
// environment, command, output), and the --dry-run text describing them.
#pragma once

#include <string>
#include <vector>

#include "launcher/agent/options.h"
#include "launcher/agent/worker_group.h"
#include "launcher/client/coordinator_client.h"

namespace trn::launch {

// The workers of this node for the generation in `joined`. coordinator: the address workers use;
// agent_socket: where they hand their heartbeats (TRN_AGENT_SOCKET; empty: to the coordinator);
// token_file: the file holding the job's own token (TRN_TOKEN_FILE; empty: --token-file, for a
// coordinator that hands out no job token).
std::vector<WorkerSpec> plan_workers(const LaunchOptions& options, const control::JoinResult& joined,
                                     const std::string& coordinator, const std::string& agent_socket = "",
                                     const std::string& token_file = "");

// The name of the job token's file in trnrun's private folder.
inline constexpr const char* kJobTokenFile = "job-token";

// Where rank's output goes in generation: DIR/rank<R>.gen<G>.log.
std::string log_path(const std::string& log_dir, int rank, int64_t generation);

// The plan --dry-run prints. Without a coordinator to ask, it assumes every node has
// --nproc-per-node workers and this node gets --node-rank (or 0).
std::string format_dry_run(const LaunchOptions& options);

}  // namespace trn::launch
