#include <catch2/catch.hpp>

#include <fstream>

#include "collectives/core/error.h"
#include "launcher/agent/options.h"
#include "tests/support/process.h"

using namespace trn::launch;

namespace {

// Replaces a value (assigning a literal through operator[] trips a GCC 12 -Wrestrict false positive).
void put(std::map<std::string, std::string>& m, const std::string& k, const std::string& v) {
  m.erase(k);
  m.emplace(k, v);
}

EnvLookup plain_env(std::map<std::string, std::string> extra = {}) {
  extra.emplace("PATH", "/usr/bin:/bin");
  return map_env(extra);
}

LaunchOptions parse(std::vector<std::string> args, std::map<std::string, std::string> env = {}) {
  return parse_launch_options(args, plain_env(std::move(env)));
}

std::string usage_message(std::vector<std::string> args, std::map<std::string, std::string> env = {}) {
  try {
    parse(std::move(args), std::move(env));
  } catch (const trn::Error& e) {
    CHECK(e.kind() == trn::ErrorKind::kUsage);
    return e.what();
  }
  FAIL("expected a usage error");
  return "";
}

}  // namespace

TEST_CASE("trnrun options: defaults, torchrun spellings, and the worker command") {
  auto o = parse({"--nproc-per-node", "3", "--max_restarts=2", "--tee", "--log-dir", "/tmp/x", "sh", "-c",
                  "echo --nnodes"});
  CHECK(o.nproc_per_node == 3);
  CHECK(o.max_restarts == 2);
  CHECK(o.min_nodes == 1);
  CHECK(o.max_nodes == 1);
  CHECK(o.tee);
  CHECK(o.command == std::vector<std::string>{"/usr/bin/sh", "-c", "echo --nnodes"});
  CHECK(o.job_id.rfind("trn-", 0) == 0);
  CHECK(o.node_rank_hint == -1);
  CHECK(o.coordinator.empty());

  auto d = parse({"--nnodes=2:4", "--coordinator", "10.0.0.1:29500", "--grace-period", "0.5", "--", "/bin/true"});
  CHECK(d.min_nodes == 2);
  CHECK(d.max_nodes == 4);
  CHECK(d.grace_period == std::chrono::milliseconds(500));
  CHECK(d.command == std::vector<std::string>{"/bin/true"});
  CHECK(parse({"--dry-run", "true"}).dry_run);
  CHECK(parse({"--help"}).help);
  CHECK(generate_job_id() != generate_job_id());
}

TEST_CASE("trnrun options: every mistake is one usage error naming the problem") {
  CHECK_THAT(usage_message({"--nproc-per-node", "0", "true"}), Catch::Contains("--nproc-per-node 0"));
  CHECK_THAT(usage_message({"--nproc-per-node", "two", "true"}), Catch::Contains("expected an integer"));
  CHECK_THAT(usage_message({"--nproc-per-node"}), Catch::Contains("needs a value"));
  CHECK_THAT(usage_message({"--nproc-per-node", "2"}), Catch::Contains("no program to run"));
  CHECK_THAT(usage_message({"--frobnicate", "true"}), Catch::Contains("unknown option --frobnicate"));
  CHECK_THAT(usage_message({"no-such-program-xyz"}), Catch::Contains("no-such-program-xyz not found on PATH"));
  CHECK_THAT(usage_message({"./missing/prog"}), Catch::Contains("not an executable file"));
  trn::test::TempDir dir;
  std::string script = dir.path() + "/train.py";
  std::ofstream(script) << "print(1)\n";
  CHECK_THAT(usage_message({script}), Catch::Contains("chmod +x it or run it through its interpreter"));
  CHECK_THAT(usage_message({"--nnodes", "3:2", "true"}), Catch::Contains("MIN <= MAX"));
  CHECK_THAT(usage_message({"--nnodes", "2", "true"}), Catch::Contains("need --coordinator"));
  CHECK_THAT(usage_message({"--coordinator", "nohost", "true"}), Catch::Contains("HOST:PORT"));
  CHECK_THAT(usage_message({"--coordinator", "h:70000", "true"}), Catch::Contains("HOST:PORT"));
  CHECK_THAT(usage_message({"--node-rank", "1", "true"}), Catch::Contains("out of range"));
  CHECK_THAT(usage_message({"--tee", "true"}), Catch::Contains("--tee needs --log-dir"));
  CHECK_THAT(usage_message({"--token-file", "/no/such/token", "true"}), Catch::Contains("not a readable file"));
  CHECK_THAT(usage_message({"--coordinator", "h:1", "--tls-ca", "/no/such/ca.pem", "true"}),
             Catch::Contains("--tls-ca /no/such/ca.pem: not a readable file"));
  CHECK_THAT(usage_message({"--coordinator", "h:1", "--tls-key", script, "true"}),
             Catch::Contains("--tls-cert and --tls-key go together"));
  CHECK_THAT(usage_message({"--tls-ca", script, "true"}), Catch::Contains("--tls-ca needs --coordinator"));
  CHECK_THAT(usage_message({"--monitor-interval", "0", "true"}), Catch::Contains("positive"));
  CHECK_THAT(usage_message({"--dry-run=yes", "true"}), Catch::Contains("takes no value"));
}

TEST_CASE("trnrun options: Slurm and Open MPI supply node count, node rank and job id") {
  std::map<std::string, std::string> slurm = {{"SLURM_JOB_ID", "4242"}, {"SLURM_STEP_ID", "3"},
                                              {"SLURM_NNODES", "4"},    {"SLURM_NODEID", "2"},
                                              {"SLURM_NTASKS", "4"},    {"SLURM_PROCID", "2"}};
  auto s = parse({"--coordinator", "h:1", "true"}, slurm);
  CHECK(s.scheduler == "slurm");
  CHECK(s.min_nodes == 4);
  CHECK(s.max_nodes == 4);
  CHECK(s.node_rank_hint == 2);
  CHECK(s.job_id == "slurm-4242.3");
  CHECK(s.nproc_per_node == 1);
  // An allocation with --ntasks-per-node=K and one trnrun per node: K workers per node.
  auto per_node = slurm;
  put(per_node, "SLURM_NTASKS_PER_NODE", "4");
  CHECK(parse({"--coordinator", "h:1", "true"}, per_node).nproc_per_node == 4);
  CHECK(parse({"--coordinator", "h:1", "--nproc-per-node", "2", "true"}, per_node).nproc_per_node == 2);
  // Explicit options win over the scheduler.
  auto e = parse({"--nnodes", "1", "--job-id", "mine", "--node-rank", "0", "true"}, slurm);
  CHECK(e.max_nodes == 1);
  CHECK(e.job_id == "mine");
  // Several trnrun tasks per node: each is its own agent.
  put(slurm, "SLURM_NTASKS", "8");
  put(slurm, "SLURM_PROCID", "5");
  auto t = parse({"--coordinator", "h:1", "true"}, slurm);
  CHECK(t.max_nodes == 8);
  CHECK(t.node_rank_hint == 5);
  // Multi-node without a coordinator names where the node count came from.
  CHECK_THAT(usage_message({"true"}, slurm), Catch::Contains("node count from slurm"));

  auto m = parse({"--coordinator", "h:1", "true"},
                 {{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_MCA_ess_base_jobid", "77"}});
  CHECK(m.scheduler == "openmpi");
  CHECK(m.max_nodes == 2);
  CHECK(m.node_rank_hint == 1);
  CHECK(m.job_id == "ompi-77");
  CHECK_THAT(usage_message({"true"}, {{"OMPI_COMM_WORLD_SIZE", "x"}}), Catch::Contains("OMPI_COMM_WORLD_SIZE=x"));
}

TEST_CASE("trnrun options: numbers and seconds are checked with one line each, in trnrun's wording") {
  CHECK(usage_message({"--nproc-per-node", "two", "true"}) == "--nproc-per-node two: expected an integer");
  CHECK(usage_message({"--nproc-per-node", "1.5", "true"}) == "--nproc-per-node 1.5: expected an integer");
  CHECK(usage_message({"--nproc-per-node", "0", "true"}) == "--nproc-per-node 0: must be at least 1");
  CHECK(usage_message({"--node-rank", "-1", "true"}) == "--node-rank -1: must be at least 0");
  CHECK(usage_message({"--max-restarts=-2", "true"}) == "--max-restarts -2: must be at least 0");
  CHECK(usage_message({"--nnodes", "0", "true"}) == "--nnodes 0: must be at least 1");
  CHECK(usage_message({"--nnodes", "x:2", "true"}) == "--nnodes x: expected an integer");
  CHECK(usage_message({"--nnodes", "4294967296", "true"}) == "--nnodes 4294967296: must be at most 2147483647");
  CHECK(usage_message({"--nproc-per-node", "4294967296", "true"}) ==
        "--nproc-per-node 4294967296: must be at most 2147483647");
  CHECK(usage_message({"--nnodes", "3:2", "true"}) == "--nnodes 3:2: MIN:MAX needs MIN <= MAX");
  CHECK(usage_message({"--monitor-interval", "0", "true"}) ==
        "--monitor-interval 0: expected a positive number of seconds");
  CHECK(usage_message({"--join-timeout", "soon", "true"}) == "--join-timeout soon: expected a positive number of seconds");
  CHECK(usage_message({"--grace-period", "-1", "true"}) ==
        "--grace-period -1: expected a non-negative number of seconds");
  CHECK(usage_message({"--grace-period", "nan", "true"}) ==
        "--grace-period nan: expected a non-negative number of seconds");
  CHECK(usage_message({"--job-id", "", "true"}) == "--job-id must not be empty");
  CHECK(usage_message({"--log-dir=", "true"}) == "--log-dir must not be empty");
  const std::string expected = "; expected HOST:PORT with a port in 1-65535 (HOST: a name, an IPv4 address or [IPv6])";
  CHECK(usage_message({"--coordinator", "h:0", "true"}) == "--coordinator h:0: port 0 is out of range" + expected);
  CHECK(usage_message({"--coordinator", ":1", "true"}) == "--coordinator :1: no host before ':'" + expected);
  CHECK(usage_message({"--max-restarts"}) == "--max-restarts needs a value (see trnrun --help)");
  CHECK(usage_message({"--frobnicate", "true"}) == "unknown option --frobnicate (see trnrun --help)");
  CHECK(usage_message({"--tee=1", "true"}) == "--tee takes no value");
  CHECK(usage_message({"--"}) == "no program to run; usage: trnrun [options] -- PROGRAM [ARGS]");
  auto o = parse({"--grace-period", "0", "--join-timeout=2.5", "--monitor_interval", "0.05", "true"});
  CHECK(o.grace_period == trn::Duration::zero());
  CHECK(o.join_timeout == std::chrono::milliseconds(2500));
  CHECK(o.monitor_interval == std::chrono::milliseconds(50));
}

TEST_CASE("trnrun options: flags stop at the program or at --, and what follows goes to the workers verbatim") {
  auto o = parse({"--max-restarts", "1", "sh", "--max-restarts", "x", "-h"});
  CHECK(o.max_restarts == 1);
  CHECK(o.command == std::vector<std::string>{"/usr/bin/sh", "--max-restarts", "x", "-h"});
  auto d = parse({"--", "sh", "--help"});
  CHECK_FALSE(d.help);
  CHECK(d.command == std::vector<std::string>{"/usr/bin/sh", "--help"});
  CHECK(parse({"-h"}).help);
}

TEST_CASE("trnrun options: --help lists every flag trnrun accepts") {
  const std::string help = usage();
  CHECK(help.rfind("usage: trnrun [options] [--] PROGRAM [ARGS...]\n", 0) == 0);
  trn::test::TempDir dir;
  const std::string token = dir.path() + "/token";
  std::ofstream(token) << "secret\n";
  // One accepted use of each flag; each must parse and be listed.
  const std::vector<std::vector<std::string>> uses = {
      {"--nnodes", "1"},           {"--nproc-per-node", "2"}, {"--node-rank", "0"},
      {"--coordinator", "h:1"},    {"--job-id", "j"},         {"--token-file", token},
      {"--max-restarts", "1"},     {"--log-dir", "/tmp/x"},   {"--tee", "--log-dir", "/tmp/x"},
      {"--dry-run"},               {"--monitor-interval", "1"}, {"--grace-period", "1"},
      {"--join-timeout", "1"},     {"--bind", "none"},
  };
  for (const auto& use : uses) {
    std::vector<std::string> args = use;
    args.push_back("true");
    INFO(use[0]);
    CHECK_NOTHROW(parse(args));
    CHECK_THAT(help, Catch::Contains("\n  " + use[0] + " "));
  }
  CHECK_THAT(help, Catch::Contains("TRN_RANK, TRN_LOCAL_RANK"));
}

TEST_CASE("trnrun options: --recovery is restart (the default) or in-place, anything else a usage error naming both") {
  CHECK(parse({"true"}).recovery == Recovery::kRestart);
  CHECK(parse({"--recovery", "restart", "true"}).recovery == Recovery::kRestart);
  CHECK(parse({"--recovery", "in-place", "--max-restarts", "3", "true"}).recovery == Recovery::kInPlace);
  CHECK(parse({"--recovery=in-place", "true"}).recovery == Recovery::kInPlace);
  CHECK(usage_message({"--recovery", "inplace", "true"}) == "--recovery takes restart or in-place, got 'inplace'");
  CHECK(usage_message({"--recovery", "", "true"}) == "--recovery takes restart or in-place, got ''");
  CHECK_THAT(usage_message({"--recovery"}), Catch::Contains("--recovery needs a value"));
  CHECK_THAT(usage(), Catch::Contains("--recovery restart|in-place"));
}

TEST_CASE("trnrun options: --bind is core (the default) or none; core with more workers than cpus is a usage error") {
  CHECK(parse({"true"}).bind == Bind::kAuto);
  CHECK(parse({"--bind", "core", "true"}).bind == Bind::kCore);
  CHECK(parse({"--bind=none", "true"}).bind == Bind::kNone);
  CHECK_THAT(usage_message({"--bind", "socket", "true"}), Catch::Contains("core") && Catch::Contains("none"));
  const std::string many = std::to_string(allowed_cpus().size() + 1);
  CHECK(parse({"--nproc-per-node", many, "true"}).bind == Bind::kAuto);
  CHECK_THAT(usage_message({"--bind", "core", "--nproc-per-node", many, "true"}),
             Catch::Contains("--bind core: " + many + " workers need at least as many CPUs"));
}
