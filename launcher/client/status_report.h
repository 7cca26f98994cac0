// What trnctl prints: a job's status as a table or as JSON, events as lines, checkpoints. The
// health of a member comes from the age of its last heartbeat, with thresholds the caller sets.
#pragma once

#include <string>

#include "collectives/core/deadline.h"
#include "trn/coordinator/v1/coordinator.pb.h"

namespace trn::control {

struct HealthThresholds {
  double late_s = 3;    // no heartbeat for this long: late
  double stuck_s = 10;  // ... stuck
  double dead_s = 30;   // ... dead (the coordinator ends the generation at its own timeout)
};

// "healthy", "late", "stuck", "dead", or "starting" (never heard from; age_ms < 0).
const char* health(int64_t age_ms, const HealthThresholds& t);
// The same for one rank or node, and "unknown" when the coordinator restarted and has not heard
// from it since.
const char* health(const coordinator::v1::WorkerStatus& w, const HealthThresholds& t);
const char* health(const coordinator::v1::NodeStatus& n, const HealthThresholds& t);

// True when the job is completed, or running with every node and every heard-from worker healthy
// (an unknown heartbeat age is not healthy).
bool job_healthy(const coordinator::v1::JobStatus& job, const HealthThresholds& t);

// The newest recovery in words: "0.45 s to the next step, 0 steps lost, 1 process replaced".
std::string recovery_last(const coordinator::v1::RecoveryStatus& r);
// The status line of a job's recoveries: "recoveries 3 (last: 0.45 s to the next step, 0 steps
// lost, 1 process replaced; restored step 1200, new generation 0.12 s, state restored 0.30 s) |
// steps lost 0 | goodput 96.5%" (no "last" part before the first recovery, "goodput -" unknown).
std::string recovery_summary(const coordinator::v1::RecoveryStatus& r);

// True when the job's workers and nodes lists hold every rank and node (GetStatus pages them).
bool lists_complete(const coordinator::v1::JobStatus& job);

// Each job's header, its counts by health and progress; then its node and rank tables when the
// lists are complete, or else the nodes and ranks needing attention (a large job on one screen).
std::string status_table(const coordinator::v1::GetStatusResponse& status, const HealthThresholds& t);
std::string status_json(const coordinator::v1::GetStatusResponse& status, const HealthThresholds& t);
std::string event_line(const coordinator::v1::Event& ev);
std::string event_json(const coordinator::v1::Event& ev);
std::string checkpoints_table(const coordinator::v1::JobStatus& job);
std::string checkpoints_json(const coordinator::v1::JobStatus& job);

// A JSON string literal (quoted, escaped).
std::string json_quote(const std::string& s);

}  // namespace trn::control
