// TLS files loaded and checked before anything dials or listens (launcher/client/tls_files.h).
#include "launcher/client/tls_files.h"

#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <fstream>

#include "collectives/core/error.h"
#include "tests/support/process.h"
#include "tests/support/tls_certs.h"

using namespace trn::control;

namespace {

std::string usage_message(const std::function<void()>& f) {
  try {
    f();
  } catch (const trn::Error& e) {
    CHECK(e.kind() == trn::ErrorKind::kUsage);
    CHECK(std::string(e.what()).find('\n') == std::string::npos);
    return e.what();
  }
  FAIL("accepted");
  return "";
}

}  // namespace

TEST_CASE("TLS files: a FIFO, a directory or a missing file is refused without opening it for reading") {
  trn::test::TempDir dir;
  const std::string d = dir.path();
  REQUIRE(::mkfifo((d + "/fifo").c_str(), 0600) == 0);  // no writer: a blocking open would wait for ever
  CHECK(usage_message([&] { read_regular_file(d + "/fifo", "--tls-ca"); }) ==
        "--tls-ca " + d + "/fifo is a FIFO, not a regular file; give a file");
  CHECK_THAT(usage_message([&] { read_regular_file(d, "--tls-ca"); }), Catch::Contains("is a directory"));
  CHECK_THAT(usage_message([&] { read_regular_file(d + "/missing", "--tls-ca"); }),
             Catch::Contains("cannot read --tls-ca " + d + "/missing: No such file or directory"));
  CHECK_THAT(usage_message([&] { read_regular_file("/dev/null", "--tls-ca"); }),
             Catch::Contains("/dev/null is a character device, not a regular file"));
  std::ofstream(d + "/t") << "abc";
  CHECK(read_regular_file(d + "/t", "--token-file") == "abc");
}

TEST_CASE("TLS files: each fault of a CA, certificate or key is one line naming the flag and the file") {
  trn::test::TempDir dir;
  const std::string d = dir.path();
  trn::test::make_test_certs(d);
  std::ofstream(d + "/x.pem") << "not a certificate\n";
  std::ofstream(d + "/empty.pem") << "\n";
  std::ofstream(d + "/bad-block.pem") << "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n";
  // The good ones load, a chain's text whole.
  const TlsPem ok = load_tls_files({d + "/ca.pem", d + "/client.pem", d + "/client.key"});
  CHECK_THAT(ok.ca, Catch::StartsWith("-----BEGIN CERTIFICATE-----"));
  CHECK_THAT(ok.key, Catch::Contains("PRIVATE KEY-----"));
  CHECK(load_tls_files({}).ca.empty());
  const TlsNames env{"TRN_TLS_CA", "TRN_TLS_CERT", "TRN_TLS_KEY"};
  for (const auto& [given, message] : std::vector<std::pair<TlsFiles, std::string>>{
           {{d + "/x.pem", "", ""}, "TRN_TLS_CA " + d + "/x.pem: not PEM (no '-----BEGIN' line)"},
           {{d + "/empty.pem", "", ""}, "TRN_TLS_CA " + d + "/empty.pem: the file is empty"},
           {{d + "/server.key", "", ""}, "TRN_TLS_CA " + d + "/server.key: no certificate in it"},
           {{d + "/bad-block.pem", "", ""}, "TRN_TLS_CA " + d + "/bad-block.pem: PEM block 1 is malformed"},
           {{"", d + "/client.pem", ""}, "TRN_TLS_CERT and TRN_TLS_KEY go together; give both"},
           {{"", d + "/client.key", d + "/client.key"}, "TRN_TLS_CERT " + d + "/client.key: no certificate in it"},
           {{"", d + "/client.pem", d + "/client.pem"}, "TRN_TLS_KEY " + d + "/client.pem: no private key in it"},
           {{"", d + "/client.pem", d + "/server.key"},
            "TRN_TLS_KEY " + d + "/server.key: the key does not match the certificate in TRN_TLS_CERT " + d +
                "/client.pem"},
           // Every file is read before any is parsed: the missing one is named first.
           {{d + "/x.pem", d + "/client.pem", d + "/missing.key"}, "cannot read TRN_TLS_KEY " + d + "/missing.key"},
       }) {
    INFO(message);
    const TlsFiles& files = given;  // a lambda captures a variable, not a structured binding (C++17)
    CHECK_THAT(usage_message([&] { load_tls_files(files, env); }), Catch::StartsWith(message));
  }
  // An encrypted key: nothing could ask for its passphrase.
  auto r = trn::test::run_all(
               {{{"/bin/sh", "-c",
                  "openssl pkey -in '" + d + "/client.key' -aes256 -passout pass:x -out '" + d + "/enc.key' 2>&1"},
                 {}}},
               std::chrono::seconds(30))
               .at(0);
  REQUIRE(r.ok());
  CHECK_THAT(usage_message([&] { load_tls_files({"", d + "/client.pem", d + "/enc.key"}); }),
             Catch::StartsWith("--tls-key " + d + "/enc.key: the private key is encrypted"));
}
