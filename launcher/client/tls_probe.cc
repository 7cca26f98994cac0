#include "launcher/client/tls_probe.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <memory>

#include "launcher/client/address.h"

namespace trn::control {
namespace {

int64_t ms(Duration d) {
  return std::max<int64_t>(1, std::chrono::duration_cast<std::chrono::milliseconds>(d).count());
}

// A TCP connection to HOST:PORT ([V6]:PORT) made within timeout, blocking with send and receive
// timeouts of `io`; -1 when there is none. *host: HOST without brackets.
int connect_to(const std::string& address, Duration timeout, Duration io, std::string* host) {
  if (!address_problem(address, PortUse::kDial).empty()) return -1;  // the client checked it already
  const HostPort hp = parse_address(address, "coordinator address");
  *host = hp.host;
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (::getaddrinfo(hp.host.c_str(), std::to_string(hp.port).c_str(), &hints, &found) != 0) return -1;
  int fd = -1;
  for (addrinfo* ai = found; ai && fd < 0; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) continue;
    int r = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
    if (r != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      int err = -1;
      socklen_t len = sizeof err;
      if (::poll(&p, 1, static_cast<int>(ms(timeout))) == 1)
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      r = err == 0 ? 0 : -1;
    }
    if (r != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  if (fd < 0) return -1;
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  timeval tv{static_cast<time_t>(ms(io) / 1000), static_cast<suseconds_t>(ms(io) % 1000 * 1000)};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  return fd;
}

// OpenSSL's reasons for the last failure, "a; b", and its queue emptied.
std::string ssl_errors() {
  std::string out;
  while (unsigned long e = ERR_get_error()) {
    const char* r = ERR_reason_error_string(e);
    std::string why = r ? r : fmt::format("error {:#x}", e);
    if (out.find(why) == std::string::npos) out += (out.empty() ? "" : "; ") + why;
  }
  return out;
}

bool has(const std::string& s, const char* what) { return s.find(what) != std::string::npos; }

// Notes a CertificateRequest from the server: it wants a client certificate (mTLS).
void on_message(int write_p, int, int content_type, const void* buf, size_t len, SSL*, void* arg) {
  if (!write_p && content_type == SSL3_RT_HANDSHAKE && len > 0 &&
      static_cast<const unsigned char*>(buf)[0] == SSL3_MT_CERTIFICATE_REQUEST)
    *static_cast<bool*>(arg) = true;
}

}  // namespace

std::string diagnose_tls(const std::string& address, const ClientOptions& o, Duration timeout) {
  const bool tls = !o.tls_ca_file.empty() || !o.tls_cert_file.empty();
  std::string host;
  const int fd = connect_to(address, timeout, std::min<Duration>(timeout, std::chrono::seconds(1)), &host);
  if (fd < 0) return "";  // not reachable: retrying is the remedy
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  ERR_clear_error();
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(SSL_CTX_new(TLS_client_method()), SSL_CTX_free);
  if (!ctx) return "";
  const std::string ca =
      o.tls_ca_file.empty() ? std::string("the system's CAs") : "the CA in " + o.tls_ca_file;
  if (tls) {
    SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, nullptr);
    if (!o.tls_ca_file.empty() ? SSL_CTX_load_verify_locations(ctx.get(), o.tls_ca_file.c_str(), nullptr) != 1
                               : SSL_CTX_set_default_verify_paths(ctx.get()) != 1)
      return fmt::format("{} holds no CA certificate ({}); give a PEM CA (--tls-ca, TRN_TLS_CA)",
                         o.tls_ca_file, ssl_errors());
    if (!o.tls_cert_file.empty() &&
        (SSL_CTX_use_certificate_chain_file(ctx.get(), o.tls_cert_file.c_str()) != 1 ||
         SSL_CTX_use_PrivateKey_file(ctx.get(), o.tls_key_file.c_str(), SSL_FILETYPE_PEM) != 1))
      return fmt::format(
          "the client certificate {} or its key {} cannot be used ({}); give a PEM certificate and "
          "its key (--tls-cert and --tls-key, TRN_TLS_CERT and TRN_TLS_KEY)",
          o.tls_cert_file, o.tls_key_file, ssl_errors());
  } else {
    SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_NONE, nullptr);
  }
  std::unique_ptr<SSL, decltype(&SSL_free)> ssl(SSL_new(ctx.get()), SSL_free);
  if (!ssl) return "";
  SSL_set_fd(ssl.get(), fd);
  static const unsigned char kAlpn[] = {2, 'h', '2'};  // what gRPC offers, and its servers require
  SSL_set_alpn_protos(ssl.get(), kAlpn, sizeof kAlpn);
  unsigned char ip[sizeof(in6_addr)];
  const bool literal =
      ::inet_pton(AF_INET, host.c_str(), ip) == 1 || ::inet_pton(AF_INET6, host.c_str(), ip) == 1;
  if (tls) {
    // The name the certificate must carry is the one dialled, as gRPC checks it.
    X509_VERIFY_PARAM* param = SSL_get0_param(ssl.get());
    if (literal) {
      X509_VERIFY_PARAM_set1_ip_asc(param, host.c_str());
    } else {
      X509_VERIFY_PARAM_set1_host(param, host.c_str(), 0);
      SSL_set_tlsext_host_name(ssl.get(), host.c_str());
    }
  }
  bool cert_requested = false;
  SSL_set_msg_callback(ssl.get(), on_message);
  SSL_set_msg_callback_arg(ssl.get(), &cert_requested);
  const bool shook = SSL_connect(ssl.get()) == 1;
  std::string why = shook ? "" : ssl_errors();
  bool closed = false;  // the coordinator hung up after the handshake, without a word
  if (shook) {
    // Under TLS 1.3 the coordinator judges a client certificate after the handshake: one it
    // accepts gets its HTTP/2 settings, one it refuses (or none) an alert or a closed connection.
    char byte;
    if (int r = SSL_peek(ssl.get(), &byte, 1); r <= 0) {
      const int e = SSL_get_error(ssl.get(), r);
      why = ssl_errors();
      closed = e == SSL_ERROR_ZERO_RETURN || has(why, "unexpected eof");
    }
  }
  const bool cert_required = has(why, "certificate required") || (closed && cert_requested);
  if (!tls) {
    if (shook || cert_required)
      return "the coordinator serves TLS and this client connects in plaintext; give the CA that signed its "
             "certificate (--tls-ca, or TRN_TLS_CA for workers)";
    return "";
  }
  if (!shook) {
    const long verified = SSL_get_verify_result(ssl.get());
    if (verified != X509_V_OK)
      return fmt::format(
          "the coordinator's certificate cannot be verified with {}: {}; give the CA that signed it "
          "(--tls-ca, TRN_TLS_CA), for a certificate that names {}",
          ca, X509_verify_cert_error_string(verified), host);
    if (has(why, "wrong version number") || has(why, "packet length too long") || has(why, "http request"))
      return "the coordinator does not speak TLS (it serves plaintext: no --tls-cert); connect without "
             "--tls-ca "
             "(TRN_TLS_CA), or start it with --tls-cert and --tls-key";
  }
  if (cert_required && o.tls_cert_file.empty())
    return "the coordinator requires a client certificate (mTLS); give one signed by its --tls-client-ca "
           "(--tls-cert and --tls-key, or TRN_TLS_CERT and TRN_TLS_KEY)";
  if (cert_required ||
      (has(why, "alert") && (has(why, "unknown ca") || has(why, "bad certificate") ||
                             has(why, "certificate unknown") || has(why, "handshake failure"))))
    return fmt::format(
        "the coordinator does not accept {} ({}); give a client certificate signed by its "
        "--tls-client-ca (--tls-cert and --tls-key, or TRN_TLS_CERT and TRN_TLS_KEY)",
        o.tls_cert_file.empty() ? std::string("this client without a certificate")
                                : "the client certificate " + o.tls_cert_file,
        closed ? std::string("it closed the connection after the handshake") : why);
  // Anything else (a handshake cut short by a restart, one slower than the probe waits) may pass
  // on the next try.
  return "";
}

}  // namespace trn::control
