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

std::string status_table(const coordinator::v1::GetStatusResponse& status, const HealthThresholds& t);
std::string status_json(const coordinator::v1::GetStatusResponse& status, const HealthThresholds& t);
std::string event_line(const coordinator::v1::Event& ev);
std::string event_json(const coordinator::v1::Event& ev);
std::string checkpoints_table(const coordinator::v1::JobStatus& job);
std::string checkpoints_json(const coordinator::v1::JobStatus& job);

// A JSON string literal (quoted, escaped).
std::string json_quote(const std::string& s);

}  // namespace trn::control
