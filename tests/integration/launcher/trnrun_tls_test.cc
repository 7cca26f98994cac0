// trnrun against a coordinator that serves TLS (and requires tokens): the agent and its workers
// verify the coordinator's certificate, present a client certificate where it requires one, and
// the workers hold their job's own token, not the admin token. A wrong CA ends trnrun at once in
// one line. Certificates come from openssl in the test's folder.
#include <fmt/format.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <regex>

#include "launcher/client/coordinator_client.h"
#include "tests/integration/coordinator/coordinator_process.h"
#include "tests/integration/launcher/launcher_children.h"
#include "tests/support/jobs.h"
#include "tests/support/tls_certs.h"

using namespace trn::test;
using namespace trn::test::launch;
using namespace std::chrono_literals;

namespace {

// A coordinator serving TLS with ca's server certificate and the admin token in DIR/admin;
// with mtls, it requires client certificates from ca too.
struct TlsCoordinator {
  TempDir dir;
  std::string d = dir.path();
  std::unique_ptr<CoordinatorProcess> coord;

  explicit TlsCoordinator(bool mtls) {
    make_test_certs(d);
    std::ofstream(d + "/admin") << "the-admin-token\n";
    std::vector<std::string> args = {"--tls-cert",      d + "/server.pem", "--tls-key",
                                     d + "/server.key", "--token-file",    d + "/admin"};
    if (mtls) args.insert(args.end(), {"--tls-client-ca", d + "/ca.pem"});
    coord = std::make_unique<CoordinatorProcess>(d, args);
    // A job of someone else's, which the workers must not read.
    trn::control::ClientOptions o;
    o.address = coord->address();
    o.token = "the-admin-token";
    o.tls_ca_file = d + "/ca.pem";
    if (mtls) {
      o.tls_cert_file = d + "/client.pem";
      o.tls_key_file = d + "/client.key";
    }
    trn::control::CoordinatorClient admin(o);
    trn::control::JoinRequest r;
    r.job_id = "someone-else";
    r.node_id = "n0";
    r.host = "h";
    r.deadline = trn::Deadline::after(20s);
    admin.join(r);
  }
  std::vector<std::string> trnrun_options(const std::string& ca, bool client_cert) const {
    std::vector<std::string> o = {"--nproc-per-node", "2",          "--coordinator", coord->address(),
                                  "--token-file",     d + "/admin", "--tls-ca",      ca};
    if (client_cert) o.insert(o.end(), {"--tls-cert", d + "/client.pem", "--tls-key", d + "/client.key"});
    return o;
  }
};

ProcResult run(const std::vector<std::string>& argv, std::chrono::seconds timeout = 60s) {
  return run_all({ProcSpec{argv, {}}}, timeout).at(0);
}

// Both workers reached the coordinator over TLS with their job's token, met in its store and at
// a barrier, and were refused the other job.
void check_workers(const ProcResult& r, bool client_cert) {
  INFO(r.describe());
  REQUIRE(r.ok());
  for (int rank = 0; rank < 2; ++rank) {
    std::smatch m;
    REQUIRE(
        std::regex_search(r.output, m, std::regex(fmt::format(R"(\[rank {}\] (rank={} .*))", rank, rank))));
    INFO(m[1].str());
    CHECK_THAT(m[1].str(), Catch::Contains("tls_ca=set"));
    CHECK_THAT(m[1].str(), Catch::Contains(client_cert ? "tls_cert=set" : "tls_cert=-"));
    CHECK_THAT(m[1].str(), Catch::Contains("token=job store=here barrier=ok other_job=denied"));
  }
}

void check_one_line(const ProcResult& r, int exit_code, const std::string& start) {
  INFO(r.describe());
  CHECK_FALSE(r.timed_out);
  CHECK(r.exit_code == exit_code);
  CHECK_THAT(r.output, Catch::StartsWith(start));
  CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
}

}  // namespace

TEST_CASE(
    "trnrun over TLS: agent and workers verify the coordinator's certificate, workers hold their job's "
    "token") {
  TlsCoordinator c(false);
  check_workers(run(trnrun_argv(c.trnrun_options(c.d + "/ca.pem", false), "token_worker",
                                {c.d + "/admin", "someone-else"})),
                false);
}

TEST_CASE("trnrun over TLS trains a small data-parallel job with trn-train") {
  TlsCoordinator c(false);
  auto opts = c.trnrun_options(c.d + "/ca.pem", false);
  auto r =
      run(trnrun_cmd(2,
                     {bin("trn-train"), "--model", "tiny", "--steps", "3", "--batch-size", "8", "--seq-len",
                      "64", "--dp", "2", "--log-every", "1", "--metrics-jsonl", c.d + "/m.jsonl"},
                     std::vector<std::string>(opts.begin() + 2, opts.end())),
          120s);
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK(jsonl_losses(c.d + "/m.jsonl").size() == 3);
}

TEST_CASE(
    "trnrun given the wrong CA fails at once, in one line: the coordinator's certificate cannot be "
    "verified") {
  TlsCoordinator c(false);
  auto r = run(trnrun_argv(c.trnrun_options(c.d + "/other-ca.pem", false), "touch", {c.d + "/ran"}), 30s);
  check_one_line(r, 2, "trnrun: error: ");
  CHECK_THAT(r.output, Catch::Contains("the coordinator's certificate cannot be verified"));
  CHECK_FALSE(std::ifstream(c.d + "/ran").good());
}

TEST_CASE(
    "trnrun with mTLS: agent and workers present the client certificate; without one trnrun fails in one "
    "line") {
  TlsCoordinator c(true);
  check_workers(run(trnrun_argv(c.trnrun_options(c.d + "/ca.pem", true), "token_worker",
                                {c.d + "/admin", "someone-else"})),
                true);
  auto r = run(trnrun_argv(c.trnrun_options(c.d + "/ca.pem", false), "touch", {c.d + "/ran"}), 30s);
  check_one_line(r, 2, "trnrun: error: ");
  CHECK_THAT(r.output, Catch::Contains("client certificate"));
  CHECK_FALSE(std::ifstream(c.d + "/ran").good());
}

TEST_CASE("trnrun's TLS flags: each mistake is one line and exit 2") {
  TempDir dir;
  const std::string d = dir.path();
  std::ofstream(d + "/x.pem") << "not a certificate\n";
  for (const auto& [args, message] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--tls-ca", d + "/x.pem", "true"},
            "trnrun: error: --tls-ca needs --coordinator HOST:PORT: the embedded coordinator serves "
            "plaintext on "
            "loopback only"},
           {{"--coordinator", "127.0.0.1:1", "--tls-cert", d + "/x.pem", "true"},
            "trnrun: error: --tls-cert and --tls-key go together; give both"},
           {{"--coordinator", "127.0.0.1:1", "--tls-ca", d + "/missing.pem", "true"},
            "trnrun: error: --tls-ca " + d + "/missing.pem: not a readable file"},
           {{"--coordinator", "127.0.0.1:1", "--tls-ca", d, "true"},
            "trnrun: error: --tls-ca " + d + ": not a readable file"},
       }) {
    std::vector<std::string> argv = {bin("trnrun")};
    argv.insert(argv.end(), args.begin(), args.end());
    check_one_line(run(argv, 30s), 2, message);
  }
}

TEST_CASE(
    "trnrun and its workers refuse a TLS file that is not PEM, holds no certificate or a key of another "
    "certificate: one line naming it, before anything dials") {
  TlsCoordinator c(false);
  const std::string& d = c.d;
  std::ofstream(d + "/x.pem") << "not a certificate\n";
  const std::string addr = c.coord->address();
  // --join-timeout bounds a trnrun that would dial with the file, so a regression fails in
  // seconds, as "unreachable", instead of at the test's deadline.
  const std::vector<std::string> base = {"--coordinator", addr, "--token-file", d + "/admin", "--join-timeout", "5"};
  for (const auto& [flags, message] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--tls-ca", d + "/x.pem"}, "--tls-ca " + d + "/x.pem: not PEM"},
           {{"--tls-ca", d + "/server.key"}, "--tls-ca " + d + "/server.key: no certificate in it"},
           {{"--tls-ca", d + "/ca.pem", "--tls-cert", d + "/client.pem", "--tls-key", d + "/server.key"},
            "--tls-key " + d + "/server.key: the key does not match the certificate in --tls-cert " + d +
                "/client.pem"},
           {{"--tls-ca", d + "/ca.pem", "--tls-cert", d + "/client.pem", "--tls-key", d + "/client.pem"},
            "--tls-key " + d + "/client.pem: no private key in it"},
       }) {
    std::vector<std::string> argv = {bin("trnrun")};
    argv.insert(argv.end(), base.begin(), base.end());
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.insert(argv.end(), {"touch", d + "/ran"});
    check_one_line(run(argv, 60s), 2, "trnrun: error: " + message);
  }
  CHECK_FALSE(std::ifstream(d + "/ran").good());

  // A worker reads its TLS files from TRN_TLS_*, and names them so.
  auto w = run_all({ProcSpec{{bin("trn-train"), "--model", "tiny", "--steps", "1", "--batch-size", "2", "--seq-len",
                              "16"},
                             {{"TRN_COORDINATOR", addr},
                              {"TRN_JOB_ID", "w"},
                              {"TRN_RANK", "0"},
                              {"TRN_WORLD_SIZE", "1"},
                              {"TRN_TIMEOUT", "5"},
                              {"TRN_TLS_CA", d + "/x.pem"}}}},
                   60s)
               .at(0);
  check_one_line(w, 2, "trn-train: error: TRN_TLS_CA " + d + "/x.pem: not PEM");
}
