#include "launcher/client/status_report.h"

#include <fmt/format.h>

#include <cmath>
#include <ctime>

namespace trn::control {

namespace v1 = ::trn::coordinator::v1;

const char* health(int64_t age_ms, const HealthThresholds& t) {
  if (age_ms < 0) return "starting";
  double s = static_cast<double>(age_ms) / 1000.0;
  if (s >= t.dead_s) return "dead";
  if (s >= t.stuck_s) return "stuck";
  if (s >= t.late_s) return "late";
  return "healthy";
}

const char* health(const v1::WorkerStatus& w, const HealthThresholds& t) {
  return w.heartbeat_unknown() ? "unknown" : health(w.heartbeat_age_ms(), t);
}

const char* health(const v1::NodeStatus& n, const HealthThresholds& t) {
  if (n.finished()) return "finished";
  return n.heartbeat_unknown() ? "unknown" : health(n.heartbeat_age_ms(), t);
}

static int64_t unhealthy(const v1::HealthCounts& c) { return c.late() + c.stuck() + c.dead() + c.unknown(); }

bool job_healthy(const v1::JobStatus& job, const HealthThresholds& t) {
  if (job.state() == "completed" || job.state() == "stopped") return true;
  if (job.state() != "running") return false;
  // The coordinator's summary counts every rank and node, with the thresholds the request gave.
  if (job.has_rank_health() || job.has_node_health())
    return unhealthy(job.rank_health()) == 0 && unhealthy(job.node_health()) == 0;
  for (const auto& n : job.nodes()) {
    std::string h = health(n, t);
    if (h != "healthy" && h != "finished") return false;
  }
  for (const auto& w : job.workers()) {
    std::string h = health(w, t);
    if (h != "healthy" && h != "starting") return false;
  }
  return true;
}

// A rank not heard from since the coordinator started (or its generation began) has reported no
// pid, step, loss or rate: shown as "-" (JSON null), never as zeros.
static bool reported(const v1::WorkerStatus& w) { return w.heartbeats() > 0; }

// "dp/tp/pp", or "-" when the rank reported no coordinates.
static std::string grid(const v1::WorkerStatus& w) {
  if (!w.has_coordinates()) return "-";
  const auto& c = w.coordinates();
  return fmt::format("{}/{}/{}", c.dp_rank(), c.tp_rank(), c.pp_rank());
}

static std::string grid_json(const v1::WorkerStatus& w) {
  if (!w.has_coordinates()) return "null";
  const auto& c = w.coordinates();
  return fmt::format("{{\"dp\": {}, \"tp\": {}, \"pp\": {}}}", c.dp_rank(), c.tp_rank(), c.pp_rank());
}

std::string json_quote(const std::string& s) {
  std::string o = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': o += "\\\""; break;
      case '\\': o += "\\\\"; break;
      case '\n': o += "\\n"; break;
      case '\r': o += "\\r"; break;
      case '\t': o += "\\t"; break;
      default:
        if (c < 0x20) o += fmt::format("\\u{:04x}", c);
        else o.push_back(static_cast<char>(c));
    }
  }
  return o + "\"";
}

static std::string json_num(double v) { return std::isfinite(v) ? fmt::format("{}", v) : "null"; }

static std::string age(int64_t ms, bool unknown = false) {
  if (unknown) return "unknown";
  if (ms < 0) return "never";
  if (ms < 60000) return fmt::format("{:.1f}s", ms / 1000.0);
  return fmt::format("{}m{:02}s", ms / 60000, (ms / 1000) % 60);
}

static std::string when(int64_t unix_ms) {
  std::time_t t = static_cast<std::time_t>(unix_ms / 1000);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
  return fmt::format("{}.{:03}Z", buf, unix_ms % 1000);
}

static std::string last_checkpoint(const v1::JobStatus& job) {
  if (job.last_committed_step() < 0) return "none";
  for (const auto& c : job.checkpoints())
    if (c.step() == job.last_committed_step())
      return fmt::format("step {} (generation {}, {})", c.step(), c.generation(), when(c.committed_unix_ms()));
  return fmt::format("step {}", job.last_committed_step());
}

static std::string count(int64_t n, const char* one, const char* many) {
  return fmt::format("{} {}", n, n == 1 ? one : many);
}

std::string recovery_last(const v1::RecoveryStatus& r) {
  return fmt::format("{:.2f} s to the next step, {} lost, {} replaced", r.detect_to_first_step_s(),
                     count(r.steps_lost(), "step", "steps"), count(r.replaced(), "process", "processes"));
}

std::string recovery_summary(const v1::RecoveryStatus& r) {
  std::string o = fmt::format("recoveries {}", r.recoveries());
  if (r.recoveries() > 0)
    o += fmt::format(" (last: {}; restored step {}, new generation {:.2f} s, state restored {:.2f} s)",
                     recovery_last(r), r.restored_step(), r.detect_to_generation_s(), r.detect_to_restored_s());
  o += fmt::format(" | steps lost {} | goodput {}", r.steps_lost_total(),
                   r.has_goodput() ? fmt::format("{:.1f}%", 100 * r.goodput()) : "-");
  return o;
}

static std::string recovery_json(const v1::JobStatus& job) {
  if (!job.has_recovery()) return "null";
  const auto& r = job.recovery();
  return fmt::format(
      "{{\"recoveries\": {}, \"detect_to_generation_s\": {}, \"detect_to_restored_s\": {}, "
      "\"detect_to_first_step_s\": {}, \"restored_step\": {}, \"steps_lost\": {}, \"steps_lost_total\": {}, "
      "\"replaced\": {}, \"goodput\": {}}}",
      r.recoveries(), json_num(r.detect_to_generation_s()), json_num(r.detect_to_restored_s()),
      json_num(r.detect_to_first_step_s()), r.restored_step(), r.steps_lost(), r.steps_lost_total(),
      r.replaced(), r.has_goodput() ? json_num(r.goodput()) : "null");
}

// "99998 healthy, 2 dead": the states with a count, in order of health.
static std::string counts_line(const v1::HealthCounts& c) {
  std::string o;
  auto add = [&](int64_t n, const char* what) {
    if (n == 0) return;
    o += fmt::format("{}{} {}", o.empty() ? "" : ", ", n, what);
  };
  add(c.healthy(), "healthy");
  add(c.starting(), "starting");
  add(c.late(), "late");
  add(c.stuck(), "stuck");
  add(c.dead(), "dead");
  add(c.unknown(), "unknown");
  add(c.finished(), "finished");
  return o.empty() ? "none" : o;
}

static std::string counts_json(const v1::HealthCounts& c) {
  return fmt::format(
      "{{\"healthy\": {}, \"starting\": {}, \"late\": {}, \"stuck\": {}, \"dead\": {}, \"unknown\": {}, "
      "\"finished\": {}}}",
      c.healthy(), c.starting(), c.late(), c.stuck(), c.dead(), c.unknown(), c.finished());
}

static std::string progress_json(const v1::JobStatus& job) {
  const auto& p = job.progress();
  if (p.reporting() == 0) return "null";
  return fmt::format(
      "{{\"reporting\": {}, \"min_step\": {}, \"max_step\": {}, \"mean_loss\": {}, "
      "\"tokens_per_s\": {}}}",
      p.reporting(), p.min_step(), p.max_step(), json_num(p.mean_loss()), json_num(p.tokens_per_s()));
}

static void node_rows(std::string& o, const google::protobuf::RepeatedPtrField<v1::NodeStatus>& nodes,
                      const HealthThresholds& t) {
  if (nodes.empty()) return;
  o += fmt::format("  {:<5} {:<20} {:<24} {:>5} {:<11} {:>9} {}\n", "NODE", "HOST", "NODE_ID", "PROCS",
                   "RANKS", "LAST_HB", "STATE");
  for (const auto& n : nodes) {
    const auto& m = n.member();
    o += fmt::format("  {:<5} {:<20} {:<24} {:>5} {:<11} {:>9} {}\n", m.node_rank(), m.host(), m.node_id(),
                     m.nproc(), fmt::format("{}-{}", m.rank_offset(), m.rank_offset() + m.nproc() - 1),
                     age(n.heartbeat_age_ms(), n.heartbeat_unknown()), health(n, t));
  }
}

static void rank_rows(std::string& o, const google::protobuf::RepeatedPtrField<v1::WorkerStatus>& workers,
                      const HealthThresholds& t) {
  if (workers.empty()) return;
  o += fmt::format("  {:<5} {:<20} {:>8} {:<9} {:>9} {:<8} {:>10} {:>10} {:>12} {:>10}\n", "RANK", "HOST",
                   "PID", "STATE", "LAST_HB", "DP/TP/PP", "STEP", "LOSS", "TOKENS/S", "VAL_LOSS");
  for (const auto& w : workers) {
    bool r = reported(w);
    o += fmt::format("  {:<5} {:<20} {:>8} {:<9} {:>9} {:<8} {:>10} {:>10} {:>12} {:>10}\n", w.rank(),
                     w.host(), r ? std::to_string(w.pid()) : "-", health(w, t),
                     age(w.heartbeat_age_ms(), w.heartbeat_unknown()), grid(w),
                     r ? std::to_string(w.step()) : "-", r ? fmt::format("{:.4f}", w.loss()) : "-",
                     r ? fmt::format("{:.0f}", w.tokens_per_s()) : "-",
                     w.has_val_loss() ? fmt::format("{:.4f}", w.val_loss()) : "-");
  }
}

bool lists_complete(const v1::JobStatus& job) {
  return job.workers_size() >= (job.state() == "forming" ? 0 : job.world_size()) &&
         job.nodes_size() >= job.nnodes();
}

std::string status_table(const v1::GetStatusResponse& status, const HealthThresholds& t) {
  std::string o;
  if (status.jobs_size() == 0) return "no jobs\n";
  for (const auto& job : status.jobs()) {
    if (!o.empty()) o += "\n";
    // A job its user stopped is neither healthy nor unhealthy: it is over, by intent.
    const char* verdict = job.state() == "stopped" ? "" : job_healthy(job, t) ? "  HEALTHY" : "  UNHEALTHY";
    o += fmt::format("job {}  generation {}  {}{}  world size {}  nodes {}  restarts {}\n", job.job_id(),
                     job.generation(), job.state(), verdict, job.world_size(),
                     std::max(job.nnodes(), job.nodes_size()), job.restarts());
    if (!job.run_id().empty()) o += fmt::format("  run: {}\n", job.run_id());
    if (job.state() == "stopped") o += fmt::format("  stopped by its user: {}\n", job.reason());
    if (job.state() == "failed" && !job.reason().empty()) o += fmt::format("  failed: {}\n", job.reason());
    o += fmt::format("  last committed checkpoint: {}\n", last_checkpoint(job));
    if (job.restart_history_size() > 0) {
      const auto& r = job.restart_history(job.restart_history_size() - 1);
      o += fmt::format("  last restart: generation {} at {}: {}\n", r.generation(), when(r.unix_ms()), r.cause());
    }
    if (job.has_recovery()) o += "  " + recovery_summary(job.recovery()) + "\n";
    if (job.state() == "forming")
      o += fmt::format("  rendezvous: {} nodes waiting (min {}, max {})\n", job.pending_joiners(),
                       job.min_nodes(), job.max_nodes());
    if (job.has_rank_health() || job.has_node_health()) {
      o += fmt::format("  nodes: {}\n", counts_line(job.node_health()));
      o += fmt::format("  ranks: {}\n", counts_line(job.rank_health()));
    }
    if (const auto& p = job.progress(); p.reporting() > 0)
      o += fmt::format("  progress: step {}{}, mean loss {:.4f}, {:.0f} tokens/s ({} ranks reporting)\n",
                       p.min_step(), p.max_step() != p.min_step() ? fmt::format("..{}", p.max_step()) : "",
                       p.mean_loss(), p.tokens_per_s(), p.reporting());
    if (lists_complete(job)) {
      node_rows(o, job.nodes(), t);
      rank_rows(o, job.workers(), t);
      continue;
    }
    // A large job: the members needing attention, the longest silent first, not every rank.
    const int64_t nodes_bad = unhealthy(job.node_health()), ranks_bad = unhealthy(job.rank_health());
    if (nodes_bad + ranks_bad == 0) {
      o += "  no node or rank needs attention\n";
    } else {
      // "3 nodes, 10 of 1200 ranks": how many are listed of how many need attention.
      auto part = [](int64_t listed, int64_t bad, const char* what) {
        if (bad == 0) return std::string();
        return listed == bad ? fmt::format("{} {}", bad, what)
                             : fmt::format("{} of {} {}", listed, bad, what);
      };
      std::string n = part(job.attention_nodes_size(), nodes_bad, "nodes"),
                  r = part(job.attention_ranks_size(), ranks_bad, "ranks");
      o += fmt::format("  needing attention (the longest silent first): {}{}{}\n", n,
                       n.empty() || r.empty() ? "" : ", ", r);
      node_rows(o, job.attention_nodes(), t);
      rank_rows(o, job.attention_ranks(), t);
    }
    o += fmt::format("  every node and rank: trnctl status --ranks {}\n", job.job_id());
  }
  return o;
}

std::string status_json(const v1::GetStatusResponse& status, const HealthThresholds& t) {
  std::string o = fmt::format("{{\"heartbeat_timeout_s\": {}, \"jobs\": [",
                              json_num(status.heartbeat_timeout_ms() / 1000.0));
  for (int i = 0; i < status.jobs_size(); ++i) {
    const auto& job = status.jobs(i);
    o += i ? ", " : "";
    o += fmt::format(
        "{{\"job_id\": {}, \"generation\": {}, \"state\": {}, \"healthy\": {}, \"world_size\": {}, "
        "\"restarts\": {}, \"last_committed_step\": {}, \"pending_joiners\": {}, \"min_nodes\": {}, "
        "\"max_nodes\": {}, \"run_id\": {}, \"reason\": {}, \"recovery\": {}, \"node_health\": {}, "
        "\"rank_health\": {}, \"progress\": {}, \"nodes\": [",
        json_quote(job.job_id()), job.generation(), json_quote(job.state()),
        job_healthy(job, t) ? "true" : "false", job.world_size(), job.restarts(), job.last_committed_step(),
        job.pending_joiners(), job.min_nodes(), job.max_nodes(),
        job.run_id().empty() ? "null" : json_quote(job.run_id()),
        job.reason().empty() ? "null" : json_quote(job.reason()), recovery_json(job),
        counts_json(job.node_health()), counts_json(job.rank_health()), progress_json(job));
    for (int k = 0; k < job.nodes_size(); ++k) {
      const auto& n = job.nodes(k);
      const auto& m = n.member();
      o += fmt::format(
          "{}{{\"node_rank\": {}, \"node_id\": {}, \"host\": {}, \"nproc\": {}, \"rank_offset\": {}, "
          "\"heartbeat_age_s\": {}, \"finished\": {}, \"state\": {}}}",
          k ? ", " : "", m.node_rank(), json_quote(m.node_id()), json_quote(m.host()), m.nproc(), m.rank_offset(),
          n.heartbeat_age_ms() < 0 ? "null" : json_num(n.heartbeat_age_ms() / 1000.0), n.finished() ? "true" : "false",
          json_quote(health(n, t)));
    }
    o += "], \"workers\": [";
    for (int k = 0; k < job.workers_size(); ++k) {
      const auto& w = job.workers(k);
      o += fmt::format(
          "{}{{\"rank\": {}, \"host\": {}, \"pid\": {}, \"state\": {}, \"heartbeat_age_s\": {}, "
          "\"coordinates\": {}, \"step\": {}, \"loss\": {}, \"tokens_per_s\": {}, \"val_loss\": {}, "
          "\"heartbeats\": {}}}",
          k ? ", " : "", w.rank(), json_quote(w.host()), reported(w) ? std::to_string(w.pid()) : "null",
          json_quote(health(w, t)), w.heartbeat_age_ms() < 0 ? "null" : json_num(w.heartbeat_age_ms() / 1000.0),
          grid_json(w), reported(w) ? std::to_string(w.step()) : "null", reported(w) ? json_num(w.loss()) : "null",
          reported(w) ? json_num(w.tokens_per_s()) : "null", w.has_val_loss() ? json_num(w.val_loss()) : "null",
          w.heartbeats());
    }
    o += "], \"restart_history\": [";
    for (int k = 0; k < job.restart_history_size(); ++k) {
      const auto& r = job.restart_history(k);
      o += fmt::format("{}{{\"generation\": {}, \"cause\": {}, \"time\": {}}}", k ? ", " : "", r.generation(),
                       json_quote(r.cause()), json_quote(when(r.unix_ms())));
    }
    o += "], \"checkpoints\": " + checkpoints_json(job) + "}";
  }
  return o + "]}\n";
}

std::string event_line(const v1::Event& ev) {
  return fmt::format("{} {} gen {} {} {}\n", when(ev.unix_ms()), ev.job_id(), ev.generation(),
                     v1::Event::Kind_Name(ev.kind()), ev.detail());
}

std::string event_json(const v1::Event& ev) {
  return fmt::format("{{\"seq\": {}, \"time\": {}, \"job_id\": {}, \"generation\": {}, \"kind\": {}, \"detail\": {}{}}}\n",
                     ev.seq(), json_quote(when(ev.unix_ms())), json_quote(ev.job_id()), ev.generation(),
                     json_quote(v1::Event::Kind_Name(ev.kind())), json_quote(ev.detail()),
                     ev.step() >= 0 ? fmt::format(", \"step\": {}", ev.step()) : "");
}

std::string checkpoints_table(const v1::JobStatus& job) {
  if (job.checkpoints_size() == 0) return fmt::format("job {}: no committed checkpoints\n", job.job_id());
  std::string o = fmt::format("job {}: {} committed checkpoints, last step {}\n", job.job_id(),
                              job.checkpoints_size(), job.last_committed_step());
  o += fmt::format("  {:>10} {:>10} {:<25} {:>6} {:>14}  {}\n", "STEP", "GENERATION", "COMMITTED", "SHARDS", "BYTES",
                   "FIRST_SHARD");
  for (const auto& c : job.checkpoints()) {
    // A coordinator that predates shard_count sends every shard.
    uint64_t bytes = c.total_bytes();
    if (c.shard_count() == 0)
      for (const auto& s : c.shards()) bytes += s.bytes();
    o += fmt::format("  {:>10} {:>10} {:<25} {:>6} {:>14}  {}\n", c.step(), c.generation(),
                     when(c.committed_unix_ms()), std::max(c.shard_count(), c.shards_size()), bytes,
                     c.shards_size() ? c.shards(0).path() : "");
  }
  return o;
}

std::string checkpoints_json(const v1::JobStatus& job) {
  std::string o = "[";
  for (int i = 0; i < job.checkpoints_size(); ++i) {
    const auto& c = job.checkpoints(i);
    // "shards" lists what the reply carried: every shard (trnctl checkpoints --json), or rank 0's.
    o += fmt::format(
        "{}{{\"step\": {}, \"generation\": {}, \"committed\": {}, \"shard_count\": {}, \"total_bytes\": {}, "
        "\"shards\": [",
        i ? ", " : "", c.step(), c.generation(), json_quote(when(c.committed_unix_ms())),
        std::max(c.shard_count(), c.shards_size()), c.total_bytes());
    for (int k = 0; k < c.shards_size(); ++k) {
      const auto& s = c.shards(k);
      o += fmt::format("{}{{\"rank\": {}, \"path\": {}, \"bytes\": {}, \"sha256\": {}}}", k ? ", " : "", s.rank(),
                       json_quote(s.path()), s.bytes(), json_quote(s.sha256()));
    }
    o += "]}";
  }
  return o + "]";
}

}  // namespace trn::control
