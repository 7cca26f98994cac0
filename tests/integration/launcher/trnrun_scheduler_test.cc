// trnrun and workers under Slurm and Open MPI: node count, node rank, ranks and job id come from
// the scheduler's environment (set by hand here, or by a real mpirun).
#include <catch2/catch.hpp>

#include <fstream>
#include <set>
#include <regex>
#include <thread>

#include "tests/integration/launcher/launcher_children.h"

using namespace trn::test;
using namespace trn::test::launch;
using namespace std::chrono_literals;

namespace {

const std::map<std::string, std::string> kSlurmNode = {{"SLURM_JOB_ID", "88"}, {"SLURM_STEP_ID", "0"},
                                                        {"SLURM_NNODES", "2"},  {"SLURM_NTASKS", "2"}};

std::vector<std::string> mpirun(std::vector<std::string> rest) {
  std::vector<std::string> argv = {"mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"};
  argv.insert(argv.end(), rest.begin(), rest.end());
  return argv;
}

// results: one per node, in node order (or one holding both nodes' output, as from mpirun).
void check_two_nodes(const std::vector<ProcResult>& results, const std::string& job_id) {
  std::map<int, std::map<std::string, std::string>> all;
  for (size_t node = 0; node < results.size(); ++node) {
    const auto& r = results[node];
    INFO(r.describe());
    REQUIRE(r.ok());
    for (auto& [rank, env] : env_reports(r.output)) {
      // The node's rank is the one the scheduler gave it.
      if (results.size() == 2) CHECK(rank / 2 == static_cast<int>(node));
      all[rank] = env;
    }
  }
  REQUIRE(all.size() == 4);
  std::set<std::string> node_ranks;
  for (int rank = 0; rank < 4; ++rank) {
    auto& env = all.at(rank);
    CHECK(env.at("world_size") == "4");
    CHECK(env.at("local_world_size") == "2");
    CHECK(env.at("job_id") == job_id);
    CHECK(std::stoi(env.at("rank")) == rank);
    CHECK(std::stoi(env.at("local_rank")) == rank % 2);
    CHECK(env.at("node_rank") == std::to_string(rank / 2));
  }
}

}  // namespace

TEST_CASE("trnrun under Slurm: two nodes (two trnruns) take node count and job id from SLURM_*") {
  Coordinator coordinator;
  std::vector<ProcSpec> nodes;
  for (int node : {1, 0}) {  // node 1 starts first (lower pid): only SLURM_NODEID makes it rank 1
    auto env = kSlurmNode;
    env["SLURM_NODEID"] = std::to_string(node);
    env["SLURM_PROCID"] = std::to_string(node);
    nodes.push_back({trnrun_argv({"--nproc-per-node", "2", "--coordinator", coordinator.address}, "env_report"), env});
  }
  auto results = run_all(nodes, 60s);
  check_two_nodes({results[1], results[0]}, "slurm-88.0");
}

TEST_CASE("trnrun under Open MPI environment variables: one node, job id from the MPI job") {
  auto r = run_all({{trnrun_argv({"--nproc-per-node", "2"}, "env_report"),
                     {{"OMPI_COMM_WORLD_SIZE", "1"}, {"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_MCA_ess_base_jobid", "5"}}}},
                   60s)[0];
  INFO(r.describe());
  REQUIRE(r.ok());
  auto reports = env_reports(r.output);
  REQUIRE(reports.size() == 2);
  CHECK(reports.at(1).at("job_id") == "ompi-5");
  CHECK(reports.at(1).at("world_size") == "2");
}

TEST_CASE("workers find their identity from trnrun, Slurm or Open MPI variables") {
  auto results = run_all(
      {ProcSpec{trnrun_argv({"--nproc-per-node", "2"}, "identity_report"), {}},
       child("identity_report", {},
             {{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"}, {"SLURM_NODEID", "1"},
              {"SLURM_TASKS_PER_NODE", "2(x2)"}, {"SLURM_JOB_ID", "9"}}),
       child("identity_report", {},
             {{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
              {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"OMPI_MCA_ess_base_jobid", "6"}})},
      60s);
  for (auto& r : results) {
    INFO(r.describe());
    REQUIRE(r.ok());
  }
  CHECK(results[0].output.find("[rank 1] identity source=trnrun rank=1 world_size=2 local_rank=1") != std::string::npos);
  CHECK(results[1].output.find("identity source=slurm rank=3 world_size=4 local_rank=1 local_world_size=2 "
                               "node_rank=1 job_id=slurm-9") != std::string::npos);
  CHECK(results[2].output.find("identity source=openmpi rank=1 world_size=2 local_rank=1 local_world_size=2 "
                               "node_rank=0 job_id=ompi-6") != std::string::npos);
}

TEST_CASE("mpirun -np 2 trnrun: each MPI process is one node of the job", "[mpi]") {
  Coordinator coordinator;
  auto r = run_all({{mpirun(trnrun_argv({"--nproc-per-node", "2", "--coordinator", coordinator.address}, "env_report")),
                     {}}},
                   120s)[0];
  INFO(r.describe());
  REQUIRE(r.ok());
  auto reports = env_reports(r.output);
  std::smatch m;
  REQUIRE(std::regex_search(r.output, m, std::regex(R"(job_id=(ompi-\d+))")));
  check_two_nodes({r}, m[1].str());
}

TEST_CASE("mpirun -np 2 of a worker: identity_from_environment reads Open MPI's ranks", "[mpi]") {
  auto r = run_all({{mpirun({self_exe(), "--trn-child", "identity_report"}), {}}}, 120s)[0];
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK(r.output.find("identity source=openmpi rank=0 world_size=2") != std::string::npos);
  CHECK(r.output.find("identity source=openmpi rank=1 world_size=2") != std::string::npos);
}
