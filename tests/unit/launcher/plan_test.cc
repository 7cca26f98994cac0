#include <catch2/catch.hpp>

#include <cstdlib>

#include "launcher/agent/plan.h"

using namespace trn::launch;

TEST_CASE("plan: each local worker gets its global rank and the job's TRN_* variables") {
  LaunchOptions o;
  o.nproc_per_node = 3;
  o.job_id = "job";
  o.token_file = "/tok";
  o.log_dir = "/logs";
  o.command = {"/bin/prog", "--x"};
  trn::control::JoinResult j;
  j.generation = 2;
  j.node_rank = 1;
  j.nnodes = 2;
  j.world_size = 6;
  j.rank_offset = 3;
  auto specs = plan_workers(o, j, "h:5");
  REQUIRE(specs.size() == 3);
  for (int i = 0; i < 3; ++i) {
    const auto& s = specs[i];
    CHECK(s.rank == 3 + i);
    CHECK(s.local_rank == i);
    CHECK(s.argv == o.command);
    CHECK(s.env.at("TRN_RANK") == std::to_string(3 + i));
    CHECK(s.env.at("TRN_LOCAL_RANK") == std::to_string(i));
    CHECK(s.env.at("TRN_WORLD_SIZE") == "6");
    CHECK(s.env.at("TRN_LOCAL_WORLD_SIZE") == "3");
    CHECK(s.env.at("TRN_NODE_RANK") == "1");
    CHECK(s.env.at("TRN_GENERATION") == "2");
    CHECK(s.env.at("TRN_COORDINATOR") == "h:5");
    CHECK(s.env.at("TRN_JOB_ID") == "job");
    CHECK(s.env.at("TRN_TOKEN_FILE") == "/tok");
    CHECK(s.sink.prefix == "[rank " + std::to_string(3 + i) + "] ");
    CHECK_FALSE(s.sink.console);
    CHECK(s.sink.log_path == "/logs/rank" + std::to_string(3 + i) + ".gen2.log");
  }
  o.tee = true;
  CHECK(plan_workers(o, j, "h:5")[0].sink.console);
  CHECK(plan_workers(o, j, "h:5")[0].env.count("TRN_TLS_CA") == 0);
}

TEST_CASE("plan: workers get the job's token file instead of --token-file, and trnrun's TLS files") {
  LaunchOptions o;
  o.nproc_per_node = 2;
  o.job_id = "job";
  o.token_file = "/admin-token";
  o.tls_ca = "/ca.pem";
  o.tls_cert = "/client.pem";
  o.tls_key = "/client.key";
  o.command = {"/bin/prog"};
  trn::control::JoinResult j;
  j.world_size = 2;
  for (const auto& s : plan_workers(o, j, "h:5", "", "/run/job-token")) {
    CHECK(s.env.at("TRN_TOKEN_FILE") == "/run/job-token");
    CHECK(s.env.at("TRN_TLS_CA") == "/ca.pem");
    CHECK(s.env.at("TRN_TLS_CERT") == "/client.pem");
    CHECK(s.env.at("TRN_TLS_KEY") == "/client.key");
  }
  o.coordinator = "10.0.0.1:29500";
  std::string text = format_dry_run(o);
  CHECK_THAT(text, Catch::Contains("TRN_TOKEN_FILE=TRNRUN_DIR/job-token"));
  CHECK_THAT(text, !Catch::Contains("TRN_TOKEN_FILE=/admin-token"));
  CHECK_THAT(text, Catch::Contains("TRN_TLS_CA=/ca.pem"));
}

TEST_CASE("plan: the dry run names nodes, ranks, environment and command") {
  LaunchOptions o;
  o.min_nodes = o.max_nodes = 2;
  o.node_rank_hint = 1;
  o.nproc_per_node = 2;
  o.coordinator = "10.0.0.1:29500";
  o.job_id = "dry";
  o.command = {"/bin/echo", "hello world"};
  std::string text = format_dry_run(o);
  CHECK_THAT(text, Catch::Contains("nothing started"));
  CHECK_THAT(text, Catch::Contains("ranks 2..3 of world size 4"));
  CHECK_THAT(text, Catch::Contains("/bin/echo 'hello world'"));
  CHECK_THAT(text, Catch::Contains("rank 3: TRN_COORDINATOR=10.0.0.1:29500"));
  CHECK_THAT(text, Catch::Contains("TRN_LOCAL_RANK=1"));
  CHECK_THAT(text, Catch::Contains("10.0.0.1:29500"));
}

TEST_CASE("plan: --recovery in-place gives every worker TRN_RECOVERY=in-place, and the dry run says so") {
  LaunchOptions o;
  o.nproc_per_node = 2;
  o.job_id = "job";
  o.command = {"/bin/prog"};
  trn::control::JoinResult j;
  j.world_size = 2;
  if (!std::getenv("TRN_RECOVERY")) {
    for (const auto& s : plan_workers(o, j, "h:5")) CHECK(s.env.count("TRN_RECOVERY") == 0);
    CHECK_THAT(format_dry_run(o), Catch::Contains("recovery:      restart"));
  }
  o.recovery = Recovery::kInPlace;
  for (const auto& s : plan_workers(o, j, "h:5")) CHECK(s.env.at("TRN_RECOVERY") == "in-place");
  CHECK_THAT(format_dry_run(o), Catch::Contains("recovery:      in-place"));
  CHECK_THAT(format_dry_run(o), Catch::Contains("TRN_RECOVERY=in-place"));
}
