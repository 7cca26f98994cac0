// Certificates for TLS tests, made with the openssl command line in a test's folder:
//   ca.pem, ca.key              a CA
//   server.pem, server.key      signed by ca, for 127.0.0.1 and localhost
//   client.pem, client.key      signed by ca (mTLS)
//   other-ca.pem, other-ca.key  a second CA that signed nothing here (a wrong --tls-ca)
// P-256 keys: as good as RSA for a test, and made in milliseconds.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

#include "tests/support/process.h"

namespace trn::test {

inline void make_test_certs(const std::string& dir) {
  const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  const std::string script = fmt::format(
      "set -e; cd '{0}'; "
      "openssl req -x509 {1} -days 1 -subj /CN=trn-test-ca -keyout ca.key -out ca.pem; "
      "openssl req -x509 {1} -days 1 -subj /CN=trn-other-ca -keyout other-ca.key -out other-ca.pem; "
      "openssl req {1} -subj /CN=localhost -keyout server.key -out server.csr; "
      "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost' > san.ext; "
      "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 -extfile san.ext "
      "-out server.pem; "
      "openssl req {1} -subj /CN=trn-worker -keyout client.key -out client.csr; "
      "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 -out client.pem",
      dir, key);
  auto r = run_all({{{"/bin/sh", "-c", script + " 2>&1"}, {}}}, std::chrono::seconds(60)).at(0);
  if (!r.ok()) throw std::runtime_error("making test certificates failed: " + r.describe());
}

}  // namespace trn::test
