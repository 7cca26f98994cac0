// What trn-coordinator does with the addresses and paths it is given: a port another server
// holds is one clear error (gRPC would share it), every bad path is one line and exit 2 before
// anything starts, and /metrics answers while idle connections sit on it.
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>

#include "tests/integration/coordinator/helpers.h"
#include "tests/support/tls_certs.h"

using namespace trn;
using namespace std::chrono_literals;

namespace {

test::ProcResult run(const std::string& cmd) { return test::run_all({{{"/bin/sh", "-c", cmd}, {}}}, 30s)[0]; }

void check_one_line_exit_2(const test::ProcResult& r, const std::string& program, const std::string& needle) {
  INFO(r.describe());
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::StartsWith(program + ": error: ") && Catch::Contains(needle));
  CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
  CHECK_THAT(r.output, !Catch::Contains("terminate called"));
}

}  // namespace

TEST_CASE("a second trn-coordinator on a port in use fails at start with one line, exit 2") {
  test::TempDir dir;
  test::CoordinatorProcess first(dir.path(), {});
  auto r = run(test::bin("trn-coordinator") + " --listen 127.0.0.1:" + std::to_string(first.port()));
  check_one_line_exit_2(r, "trn-coordinator", "in use");
  REQUIRE(first.running());

  // The same for --metrics-listen.
  test::TempDir dir2;
  int mport = test::free_port();
  test::CoordinatorProcess metered(dir2.path(), {"--metrics-listen", fmt::format("127.0.0.1:{}", mport)});
  auto m = run(test::bin("trn-coordinator") + fmt::format(" --metrics-listen 127.0.0.1:{}", mport));
  check_one_line_exit_2(m, "trn-coordinator", "in use");
  CHECK(metered.running());
}

TEST_CASE("a scrape of /metrics succeeds while ten idle connections are open") {
  test::TempDir dir;
  int mport = test::free_port();
  test::CoordinatorProcess coord(dir.path(), {"--metrics-listen", fmt::format("127.0.0.1:{}", mport)});
  std::vector<int> idle;
  for (int i = 0; i < 10; ++i) idle.push_back(test::connect_loopback(mport));  // connected, never send a byte
  auto page = test::http_get(mport, "/metrics", 5s);
  CHECK_THAT(page, Catch::StartsWith("HTTP/1.1 200 OK"));
  CHECK_THAT(page, Catch::Contains("trn_coordinator_jobs 0\n"));
  for (int fd : idle) ::close(fd);
  REQUIRE(coord.running());
}

TEST_CASE("every bad path given to trn-coordinator is one line and exit 2, before it starts") {
  test::TempDir dir;
  const std::string d = dir.path();
  std::ofstream(d + "/file") << "x";
  std::filesystem::create_directory(d + "/folder");
  std::string c = test::bin("trn-coordinator") + " --listen 127.0.0.1:0 ";
  struct Case {
    std::string args, needle;
  };
  for (const auto& k : std::vector<Case>{
           {"--port-file " + d + "/missing/port", "does not exist"},
           {"--port-file " + d + "/folder", "is a directory"},
           {"--port-file " + d + "/file/port", "is not a directory"},
           {"--state-dir " + d + "/file", "is not a directory"},
           {"--token-file " + d + "/missing", "cannot read"},
           {"--token-file " + d + "/folder", "is a directory"},
           {"--tls-cert " + d + "/missing.pem --tls-key " + d + "/file", "cannot read"},
           {"--tls-cert " + d + "/file --tls-key " + d + "/folder", "is a directory"},
           {"--tls-cert " + d + "/file --tls-key " + d + "/file --tls-client-ca " + d + "/missing", "cannot read"},
       }) {
    INFO(k.args);
    check_one_line_exit_2(run(c + k.args), "trn-coordinator", k.needle);
  }
  // Nothing was left behind by the refused starts.
  CHECK_FALSE(std::filesystem::exists(d + "/folder/state.log"));
}

TEST_CASE("every bad path given to trnctl is one line and exit 2") {
  test::TempDir dir;
  const std::string d = dir.path();
  std::filesystem::create_directory(d + "/folder");
  std::ofstream(d + "/file") << "x";
  std::string c = test::bin("trnctl") + " --coordinator 127.0.0.1:1 ";
  for (const auto& [args, needle] : std::vector<std::pair<std::string, std::string>>{
           {"--token-file " + d + "/missing status", "cannot read"},
           {"--token-file " + d + "/folder status", "is a directory"},
           {"--tls-ca " + d + "/missing status", "cannot read"},
           {"--tls-ca " + d + "/folder status", "is a directory"},
           {"--tls-ca " + d + "/file --tls-cert " + d + "/missing --tls-key " + d + "/file status", "cannot read"},
       }) {
    INFO(args);
    auto r = run(c + args);
    check_one_line_exit_2(r, "trnctl", needle);
  }
  auto env = test::run_all({{{test::bin("trnctl"), "--coordinator", "127.0.0.1:1", "status"},
                             {{"TRN_TOKEN_FILE", d + "/folder"}}}},
                           30s)[0];
  check_one_line_exit_2(env, "trnctl", "is a directory");
}

TEST_CASE(
    "a TLS file that is a FIFO, not PEM, holds no certificate or a key of another certificate is one line "
    "naming it, before trn-coordinator listens or trnctl dials") {
  test::TempDir dir;
  const std::string d = dir.path();
  test::make_test_certs(d);
  std::ofstream(d + "/x.pem") << "not a certificate\n";
  REQUIRE(::mkfifo((d + "/fifo.pem").c_str(), 0600) == 0);  // opened blocking, it would wait for a writer
  const std::string coordinator = test::bin("trn-coordinator") + " --listen 127.0.0.1:0 ";
  const std::string pair = "--tls-cert " + d + "/server.pem --tls-key " + d + "/server.key ";
  for (const auto& [args, needle] : std::vector<std::pair<std::string, std::string>>{
           {"--tls-cert " + d + "/server.pem --tls-key " + d + "/client.key",
            "--tls-key " + d + "/client.key: the key does not match the certificate in --tls-cert " + d +
                "/server.pem"},
           {"--tls-cert " + d + "/x.pem --tls-key " + d + "/server.key", "--tls-cert " + d + "/x.pem: not PEM"},
           {"--tls-cert " + d + "/server.key --tls-key " + d + "/server.key",
            "--tls-cert " + d + "/server.key: no certificate in it"},
           {pair + "--tls-client-ca " + d + "/fifo.pem", "--tls-client-ca " + d + "/fifo.pem is a FIFO, not a regular file"},
           {"--store etcd://127.0.0.1:1 --advertise 127.0.0.1:7000 --etcd-tls-ca " + d + "/x.pem",
            "--etcd-tls-ca " + d + "/x.pem: not PEM"},
       }) {
    INFO(args);
    check_one_line_exit_2(run(coordinator + args), "trn-coordinator", needle);
  }
  // --timeout bounds a trnctl that would dial with the file, so a regression fails in seconds.
  const std::string trnctl = test::bin("trnctl") + " --coordinator 127.0.0.1:1 --timeout 3 ";
  for (const auto& [args, needle] : std::vector<std::pair<std::string, std::string>>{
           {"--tls-ca " + d + "/x.pem", "--tls-ca " + d + "/x.pem: not PEM"},
           {"--tls-ca " + d + "/fifo.pem", "--tls-ca " + d + "/fifo.pem is a FIFO, not a regular file"},
           {"--tls-ca " + d + "/ca.pem --tls-cert " + d + "/client.pem --tls-key " + d + "/server.key",
            "--tls-key " + d + "/server.key: the key does not match the certificate in --tls-cert " + d +
                "/client.pem"},
       }) {
    INFO(args);
    check_one_line_exit_2(run(trnctl + args + " status"), "trnctl", needle);
  }
}
