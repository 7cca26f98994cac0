#include <catch2/catch.hpp>

#include "collectives/core/error.h"
#include "launcher/agent/worker_env.h"

using namespace trn::launch;

namespace {

// Replaces a value (assigning a literal through operator[] trips a GCC 12 -Wrestrict false positive).
void put(std::map<std::string, std::string>& m, const std::string& k, const std::string& v) {
  m.erase(k);
  m.emplace(k, v);
}
std::string usage_message(std::map<std::string, std::string> env) {
  try {
    identity_from(map_env(std::move(env)));
  } catch (const trn::Error& e) {
    CHECK(e.kind() == trn::ErrorKind::kUsage);
    return e.what();
  }
  FAIL("expected a usage error");
  return "";
}
}  // namespace

TEST_CASE("worker identity: TRN_* round-trips through worker_env_vars") {
  WorkerIdentity id;
  id.rank = 5;
  id.local_rank = 1;
  id.world_size = 6;
  id.local_world_size = 2;
  id.node_rank = 2;
  id.generation = 3;
  // Moved in rather than assigned from literals: GCC 12 -Wrestrict misjudges the latter here.
  id.job_id = std::string("j");
  id.coordinator = std::string("127.0.0.1:9");
  id.token_file = std::string("/t");
  auto vars = worker_env_vars(id);
  CHECK(vars.at("TRN_RANK") == "5");
  CHECK(vars.at("TRN_TOKEN_FILE") == "/t");
  auto back = identity_from(map_env(vars));
  CHECK(back.source == IdentitySource::kTrnrun);
  CHECK(back.rank == 5);
  CHECK(back.local_rank == 1);
  CHECK(back.world_size == 6);
  CHECK(back.local_world_size == 2);
  CHECK(back.node_rank == 2);
  CHECK(back.generation == 3);
  CHECK(back.job_id == "j");
  CHECK(back.coordinator == "127.0.0.1:9");
  CHECK(back.token_file == "/t");
  id.token_file.clear();
  CHECK(worker_env_vars(id).count("TRN_TOKEN_FILE") == 0);
  CHECK(worker_env_vars(id).count("TRN_TLS_CA") == 0);
  auto tls = identity_from(map_env({{"TRN_RANK", "0"},
                                    {"TRN_WORLD_SIZE", "1"},
                                    {"TRN_TLS_CA", "/ca.pem"},
                                    {"TRN_TLS_CERT", "/c.pem"},
                                    {"TRN_TLS_KEY", "/c.key"}}));
  CHECK(tls.tls_ca == "/ca.pem");
  CHECK(tls.tls_cert == "/c.pem");
  CHECK(tls.tls_key == "/c.key");
  auto tls_vars = worker_env_vars(tls);
  CHECK(tls_vars.at("TRN_TLS_CA") == "/ca.pem");
  CHECK(tls_vars.at("TRN_TLS_CERT") == "/c.pem");
  CHECK(tls_vars.at("TRN_TLS_KEY") == "/c.key");
}

TEST_CASE("worker identity: precedence is TRN_*, then Open MPI, then Slurm, then a single process") {
  std::map<std::string, std::string> env = {
      {"OMPI_COMM_WORLD_RANK", "3"},  {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
      {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"OMPI_MCA_ess_base_jobid", "99"},
      {"SLURM_PROCID", "7"},          {"SLURM_NTASKS", "8"},         {"SLURM_LOCALID", "3"},
      {"SLURM_NODEID", "1"},          {"SLURM_TASKS_PER_NODE", "4(x2)"}, {"SLURM_JOB_ID", "12"}};
  auto ompi = identity_from(map_env(env));
  CHECK(ompi.source == IdentitySource::kOpenMpi);
  CHECK(ompi.rank == 3);
  CHECK(ompi.world_size == 4);
  CHECK(ompi.local_rank == 1);
  CHECK(ompi.local_world_size == 2);
  CHECK(ompi.node_rank == 1);
  CHECK(ompi.job_id == "ompi-99");

  put(env, "TRN_RANK", "0");
  put(env, "TRN_WORLD_SIZE", "1");
  auto trn = identity_from(map_env(env));
  CHECK(trn.source == IdentitySource::kTrnrun);
  CHECK(trn.rank == 0);
  CHECK(trn.world_size == 1);

  env.erase("TRN_RANK");
  env.erase("TRN_WORLD_SIZE");
  env.erase("OMPI_COMM_WORLD_RANK");
  put(env, "TRN_JOB_ID", "override");
  put(env, "TRN_GENERATION", "4");
  auto slurm = identity_from(map_env(env));
  CHECK(slurm.source == IdentitySource::kSlurm);
  CHECK(slurm.rank == 7);
  CHECK(slurm.world_size == 8);
  CHECK(slurm.local_rank == 3);
  CHECK(slurm.local_world_size == 4);
  CHECK(slurm.node_rank == 1);
  CHECK(slurm.job_id == "override");
  CHECK(slurm.generation == 4);

  // SLURM_TASKS_PER_NODE with uneven nodes: "3(x2),1" -> node 2 has 1 task.
  auto uneven = identity_from(map_env({{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "7"}, {"SLURM_LOCALID", "0"},
                                       {"SLURM_NODEID", "2"}, {"SLURM_TASKS_PER_NODE", "3(x2),1"},
                                       {"SLURM_JOB_ID", "5"}, {"SLURM_STEP_ID", "0"}}));
  CHECK(uneven.local_world_size == 1);
  CHECK(uneven.job_id == "slurm-5.0");

  auto single = identity_from(map_env({}));
  CHECK(single.source == IdentitySource::kSingle);
  CHECK(single.rank == 0);
  CHECK(single.world_size == 1);
  CHECK(single.job_id == "local");
}

TEST_CASE("worker identity: malformed or inconsistent variables are usage errors naming them") {
  CHECK_THAT(usage_message({{"TRN_RANK", "1"}}), Catch::Contains("TRN_WORLD_SIZE is not set"));
  CHECK_THAT(usage_message({{"TRN_RANK", "2"}, {"TRN_WORLD_SIZE", "2"}}), Catch::Contains("rank 2 is out of range"));
  CHECK_THAT(usage_message({{"TRN_RANK", "-1"}, {"TRN_WORLD_SIZE", "2"}}), Catch::Contains("TRN_RANK=-1"));
  CHECK_THAT(usage_message({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "abc"}}),
             Catch::Contains("OMPI_COMM_WORLD_SIZE=abc"));
  CHECK_THAT(usage_message({{"TRN_RANK", "0"}, {"TRN_WORLD_SIZE", "2"}, {"TRN_LOCAL_RANK", "3"},
                            {"TRN_LOCAL_WORLD_SIZE", "2"}}),
             Catch::Contains("local rank 3"));
}
