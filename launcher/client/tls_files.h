// TLS files, loaded and checked before anything dials or listens. gRPC takes any text as PEM and
// only fails later, and in words that mislead: a client retries a handshake it can never make
// until its deadline ("unreachable ... is trn-coordinator running there?"), a server "cannot
// listen there". So every program that takes TLS files (trnrun, trnctl, trn-coordinator and its
// etcd client, trn-train through TRN_TLS_*) reads them here first, and a bad one is one usage
// line naming the flag (or variable), the file and what is wrong with it: not a regular file,
// unreadable, not PEM, no certificate in it, no private key in it (or an encrypted one), or a key
// that does not match the certificate. The checks use OpenSSL (linked for tls_probe.h and the
// coordinator's tokens already), the library gRPC's own TLS is built on here.
#pragma once

#include <string>

namespace trn::control {

// The whole of the file at `path`, which `what` (a flag or variable, "--token-file") names. It
// is opened without blocking and must be a regular file, so a FIFO or a device given by mistake
// is refused instead of waited on. A usage error when it is missing, unreadable, a directory or
// not a regular file, worded as runtime/io/input_file.h words them ("WHAT PATH is a FIFO, not a
// regular file; give a file").
std::string read_regular_file(const std::string& path, const std::string& what);

// Where one side's TLS files are: a CA bundle (a client's --tls-ca, the coordinator's
// --tls-client-ca), and a certificate chain with its private key (--tls-cert and --tls-key).
// Empty: not given.
struct TlsFiles {
  std::string ca, cert, key;
};

// How a program names those files in errors: its flags, or the environment variables.
struct TlsNames {
  std::string ca = "--tls-ca", cert = "--tls-cert", key = "--tls-key";
};

// Their PEM texts, checked: the CA holds one or more certificates, each of which parses; the
// certificate file starts with a certificate that parses; the key file holds an unencrypted
// private key that parses and matches that certificate. A certificate goes with a key: both or
// neither. Every file is read before any is parsed, so a missing file is named before a
// malformed one. A usage error naming the flag, the file and what is wrong otherwise.
struct TlsPem {
  std::string ca, cert, key;  // empty for a file not given
};
TlsPem load_tls_files(const TlsFiles& files, const TlsNames& names = {});

}  // namespace trn::control
