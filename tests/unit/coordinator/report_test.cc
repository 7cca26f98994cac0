// What trnctl and /metrics show of a job's in-place recoveries, rendered from status and gauges
// alone (no server): the status line and JSON, the RECOVERED event line, and the Prometheus
// families, per job and only for jobs that reported.
#include <catch2/catch.hpp>

#include <regex>
#include <sstream>

#include "launcher/client/status_report.h"
#include "launcher/server/metrics.h"

using namespace trn;
using namespace trn::control;

namespace {

v1::RecoveryStatus report(int64_t count) {
  v1::RecoveryStatus r;
  r.set_recoveries(count);
  r.set_detect_to_generation_s(0.12);
  r.set_detect_to_restored_s(0.3);
  r.set_detect_to_first_step_s(0.45);
  r.set_restored_step(1200);
  r.set_steps_lost(0);
  r.set_steps_lost_total(4);
  r.set_replaced(1);
  r.set_goodput(0.965);
  return r;
}

v1::GetStatusResponse one_job(const std::optional<v1::RecoveryStatus>& r) {
  v1::GetStatusResponse s;
  auto* job = s.add_jobs();
  job->set_job_id("train");
  job->set_state("running");
  job->set_generation(3);
  job->set_last_committed_step(-1);
  if (r) *job->mutable_recovery() = *r;
  return s;
}

}  // namespace

TEST_CASE("trnctl status: a recovery line under a job that reported one, none otherwise") {
  HealthThresholds t;
  auto table = status_table(one_job(report(3)), t);
  CHECK_THAT(table, Catch::Contains("\n  recoveries 3 (last: 0.45 s to the next step, 0 steps lost, 1 process replaced; "
                                    "restored step 1200, new generation 0.12 s, state restored 0.30 s) | steps lost 4 | "
                                    "goodput 96.5%\n"));
  CHECK_THAT(status_table(one_job(std::nullopt), t), !Catch::Contains("recoveries"));

  // Before the first recovery (a report of 0) and with goodput unknown: counts only.
  auto none = report(0);
  none.clear_goodput();
  CHECK(recovery_summary(none) == "recoveries 0 | steps lost 4 | goodput -");
  auto two = report(2);
  two.set_steps_lost(1);
  two.set_replaced(2);
  CHECK(recovery_last(two) == "0.45 s to the next step, 1 step lost, 2 processes replaced");
}

TEST_CASE("trnctl status --json: the job's recovery object, or null") {
  HealthThresholds t;
  CHECK_THAT(status_json(one_job(report(3)), t),
             Catch::Contains("\"recovery\": {\"recoveries\": 3, \"detect_to_generation_s\": 0.12, "
                             "\"detect_to_restored_s\": 0.3, \"detect_to_first_step_s\": 0.45, \"restored_step\": 1200, "
                             "\"steps_lost\": 0, \"steps_lost_total\": 4, \"replaced\": 1, \"goodput\": 0.965}"));
  auto unknown = report(1);
  unknown.clear_goodput();
  CHECK_THAT(status_json(one_job(unknown), t), Catch::Contains("\"replaced\": 1, \"goodput\": null}"));
  CHECK_THAT(status_json(one_job(std::nullopt), t), Catch::Contains("\"recovery\": null"));
}

TEST_CASE("trnctl watch: a RECOVERED event reads as its kind and detail") {
  v1::Event ev;
  ev.set_job_id("train");
  ev.set_generation(3);
  ev.set_kind(v1::Event::RECOVERED);
  ev.set_detail("recovery 2 in generation 3: 0.45 s to the next step, 0 steps lost, 1 process replaced");
  ev.set_step(1200);
  CHECK_THAT(event_line(ev), Catch::EndsWith(" train gen 3 RECOVERED recovery 2 in generation 3: 0.45 s to the next "
                                             "step, 0 steps lost, 1 process replaced\n"));
  CHECK_THAT(event_json(ev), Catch::Contains("\"kind\": \"RECOVERED\"") && Catch::Contains("\"step\": 1200"));
}

TEST_CASE("/metrics: recovery families per job, with HELP and TYPE, only once a job reported") {
  RpcMetrics m;
  RegistryGauges g;
  g.per_job.resize(3);
  g.per_job[0].job_id = "quiet";  // never reported: no series
  g.per_job[1].job_id = "recovered";
  g.per_job[1].recovery = report(3);
  g.per_job[2].job_id = "fresh";  // reported before its first recovery, goodput unknown
  g.per_job[2].recovery = report(0);
  g.per_job[2].recovery->clear_goodput();

  CHECK_THAT(m.render(RegistryGauges{}), !Catch::Contains("recover") && !Catch::Contains("goodput") &&
                                             !Catch::Contains("steps_lost"));
  const std::string page = m.render(g);
  INFO(page);
  CHECK_THAT(page, Catch::Contains("# HELP trn_job_recoveries_total ") &&
                       Catch::Contains("\n# TYPE trn_job_recoveries_total counter\n"
                                       "trn_job_recoveries_total{job=\"recovered\"} 3\n"
                                       "trn_job_recoveries_total{job=\"fresh\"} 0\n"));
  CHECK_THAT(page, Catch::Contains("\n# TYPE trn_job_last_recovery_seconds gauge\n"
                                   "trn_job_last_recovery_seconds{job=\"recovered\"} 0.45\n# HELP"));
  CHECK_THAT(page, Catch::Contains("\n# TYPE trn_job_steps_lost_total counter\n"
                                   "trn_job_steps_lost_total{job=\"recovered\"} 4\n"
                                   "trn_job_steps_lost_total{job=\"fresh\"} 4\n"));
  CHECK_THAT(page, Catch::Contains("\n# TYPE trn_job_goodput_ratio gauge\n"
                                   "trn_job_goodput_ratio{job=\"recovered\"} 0.965\n# HELP"));
  for (const char* name : {"trn_job_recoveries_total", "trn_job_last_recovery_seconds", "trn_job_steps_lost_total",
                           "trn_job_goodput_ratio"})
    CHECK_THAT(page, !Catch::Contains(std::string(name) + "{job=\"quiet\"}"));
  // Per job only: no series of these families has a label but job.
  const std::regex sample(R"(trn_job_(recoveries_total|last_recovery_seconds|steps_lost_total|goodput_ratio)\{([^}]*)\} .*)");
  int samples = 0;
  std::istringstream lines(page);
  for (std::string line; std::getline(lines, line);) {
    std::smatch got;
    if (!std::regex_match(line, got, sample)) continue;
    ++samples;
    CHECK_THAT(got[2].str(), Catch::Matches(R"re(job="(recovered|fresh)")re"));
  }
  CHECK(samples == 6);
  // Every family is declared exactly once, each before its samples.
  for (const char* name : {"trn_job_recoveries_total", "trn_job_last_recovery_seconds", "trn_job_steps_lost_total",
                           "trn_job_goodput_ratio"}) {
    INFO(name);
    const std::string type = std::string("# TYPE ") + name + " ";
    auto at = page.find(type);
    REQUIRE(at != std::string::npos);
    CHECK(page.find(type, at + 1) == std::string::npos);
    CHECK(page.find(std::string("\n") + name + "{") > at);
  }
}

TEST_CASE("/metrics: MoE families of rank 0's newest step, per job and layer, none for a dense model") {
  RpcMetrics m;
  RegistryGauges g;
  g.per_job.resize(2);
  g.per_job[0].job_id = "dense";  // reported no MoE figures: no series
  g.per_job[0].val_loss = 2.5;
  g.per_job[1].job_id = "mixture";
  v1::MoeStatus moe;
  moe.set_aux_loss(2.0625);
  for (double v : {1.5, 3.25, 1.0}) moe.add_max_mean(v);
  for (int d : {0, 2, 1}) moe.add_dead_experts(d);
  moe.set_dropped(17);
  g.per_job[1].moe = moe;

  // Without an MoE job the families are not on the page at all.
  CHECK_THAT(m.render(RegistryGauges{}), !Catch::Contains("trn_job_moe_"));
  RegistryGauges only_dense = g;
  only_dense.per_job.pop_back();
  CHECK_THAT(m.render(only_dense), !Catch::Contains("trn_job_moe_"));

  const std::string page = m.render(g);
  INFO(page);
  CHECK_THAT(page, Catch::Contains("\n# HELP trn_job_moe_aux_loss ") &&
                       Catch::Contains("\n# TYPE trn_job_moe_aux_loss gauge\n"
                                       "trn_job_moe_aux_loss{job=\"mixture\"} 2.0625\n# HELP"));
  CHECK_THAT(page, Catch::Contains("\n# TYPE trn_job_moe_max_mean gauge\n"
                                   "trn_job_moe_max_mean{job=\"mixture\",layer=\"0\"} 1.5\n"
                                   "trn_job_moe_max_mean{job=\"mixture\",layer=\"1\"} 3.25\n"
                                   "trn_job_moe_max_mean{job=\"mixture\",layer=\"2\"} 1\n# HELP"));
  CHECK_THAT(page, Catch::Contains("\n# TYPE trn_job_moe_dead_experts gauge\n"
                                   "trn_job_moe_dead_experts{job=\"mixture\",layer=\"0\"} 0\n"
                                   "trn_job_moe_dead_experts{job=\"mixture\",layer=\"1\"} 2\n"
                                   "trn_job_moe_dead_experts{job=\"mixture\",layer=\"2\"} 1\n# HELP"));
  CHECK_THAT(page, Catch::Contains("\n# TYPE trn_job_moe_dropped gauge\n"
                                   "trn_job_moe_dropped{job=\"mixture\"} 17\n# HELP"));
  CHECK_THAT(page, !Catch::Contains("job=\"dense\",layer") && !Catch::Contains("trn_job_moe_aux_loss{job=\"dense\"}") &&
                       !Catch::Contains("trn_job_moe_dropped{job=\"dense\"}"));
  // Every family has a HELP and a TYPE line, once, before its samples.
  for (const char* name :
       {"trn_job_moe_aux_loss", "trn_job_moe_max_mean", "trn_job_moe_dead_experts", "trn_job_moe_dropped"}) {
    INFO(name);
    const std::string help = std::string("# HELP ") + name + " ", type = std::string("# TYPE ") + name + " gauge\n";
    auto at = page.find(type);
    REQUIRE(at != std::string::npos);
    CHECK(page.find(type, at + 1) == std::string::npos);
    CHECK(page.find(help) < at);
    CHECK(page.find(std::string("\n") + name + "{") > at);
  }
}
