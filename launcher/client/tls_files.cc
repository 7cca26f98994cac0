#include "launcher/client/tls_files.h"

#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <vector>

#include "collectives/core/error.h"

namespace trn::control {
namespace {

// Larger than any certificate bundle or token; a bigger file is a wrong path, not read whole.
constexpr off_t kMaxFileBytes = 16 << 20;

const char* kind_of(mode_t m) {
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a plain file";  // the words runtime/io/input_file.cc uses for the same refusals
}

// A file named by a flag: its path, the flag, its text.
struct Named {
  const std::string& path;
  const std::string& what;
  std::string text;
};

template <typename... Args>
Error bad_file(const Named& f, fmt::format_string<Args...> why, Args&&... args) {
  return usage_error("{} {}: {}", f.what, f.path, fmt::format(why, std::forward<Args>(args)...));
}

// OpenSSL's reason for the newest error in its queue, and the queue emptied.
std::string ssl_reason() {
  const unsigned long e = ERR_peek_last_error();
  const char* r = e ? ERR_reason_error_string(e) : nullptr;
  ERR_clear_error();
  return r ? r : "unknown reason";
}

using Bio = std::unique_ptr<BIO, decltype(&BIO_free)>;
using Cert = std::unique_ptr<X509, decltype(&X509_free)>;
using Key = std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)>;

Bio memory_bio(const std::string& text) {
  return Bio(BIO_new_mem_buf(text.data(), static_cast<int>(text.size())), BIO_free);
}

// A usage error unless the text has a PEM block at all.
void require_pem(const Named& f, const char* give) {
  if (f.text.find_first_not_of(" \t\r\n") == std::string::npos) throw bad_file(f, "the file is empty; give {}", give);
  if (f.text.find("-----BEGIN ") == std::string::npos)
    throw bad_file(f, "not PEM (no '-----BEGIN' line); give {}", give);
}

// The certificates in f, in order: every CERTIFICATE block, each parsed; a usage error for a
// malformed block, a certificate that does not parse, or none at all.
std::vector<Cert> certificates(const Named& f, const char* give) {
  require_pem(f, give);
  std::vector<Cert> out;
  Bio bio = memory_bio(f.text);
  ERR_clear_error();
  for (int block = 1;; ++block) {
    char *name = nullptr, *header = nullptr;
    unsigned char* data = nullptr;
    long len = 0;
    if (PEM_read_bio(bio.get(), &name, &header, &data, &len) != 1) {
      if (ERR_GET_REASON(ERR_peek_last_error()) == PEM_R_NO_START_LINE) break;  // no more blocks
      throw bad_file(f, "PEM block {} is malformed ({}); give {}", block, ssl_reason(), give);
    }
    const std::string kind = name;
    const unsigned char* p = data;
    Cert cert(kind == "CERTIFICATE" || kind == "X509 CERTIFICATE"
                  ? d2i_X509(nullptr, &p, len)
                  : kind == "TRUSTED CERTIFICATE" ? d2i_X509_AUX(nullptr, &p, len) : nullptr,
              X509_free);
    const bool is_cert = kind.find("CERTIFICATE") != std::string::npos && kind.find("REQUEST") == std::string::npos;
    OPENSSL_free(name);
    OPENSSL_free(header);
    OPENSSL_free(data);
    if (is_cert && !cert) throw bad_file(f, "certificate {} in it does not parse ({}); give {}", out.size() + 1, ssl_reason(), give);
    if (cert) out.push_back(std::move(cert));
  }
  ERR_clear_error();
  if (out.empty()) throw bad_file(f, "no certificate in it (no '-----BEGIN CERTIFICATE' block); give {}", give);
  return out;
}

// Never asks: gRPC could not ask for a passphrase either.
int no_passphrase(char*, int, int, void*) { return -1; }

// The private key in f; a usage error when there is none, it is encrypted, or it does not parse.
Key private_key(const Named& f) {
  const char* give = "the certificate's private key in PEM";
  require_pem(f, give);
  if (f.text.find("PRIVATE KEY-----") == std::string::npos)
    throw bad_file(f, "no private key in it (no '-----BEGIN ... PRIVATE KEY' block); give {}", give);
  if (f.text.find("ENCRYPTED") != std::string::npos)
    throw bad_file(f, "the private key is encrypted; give it unencrypted (nothing can ask for its passphrase)");
  Bio bio = memory_bio(f.text);
  ERR_clear_error();
  Key key(PEM_read_bio_PrivateKey(bio.get(), nullptr, no_passphrase, nullptr), EVP_PKEY_free);
  if (!key) throw bad_file(f, "its private key does not parse ({}); give {}", ssl_reason(), give);
  return key;
}

}  // namespace

std::string read_regular_file(const std::string& path, const std::string& what) {
  // O_NONBLOCK: opening a FIFO with no writer returns at once; fstat then refuses it. Checking
  // the open descriptor leaves no window for the path to change in between.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    const int err = errno;
    struct stat st;
    if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode))
      throw usage_error("{} {} is {}, not a regular file; give a file", what, path, kind_of(st.st_mode));
    throw usage_error("cannot read {} {}: {}; check the path", what, path, std::strerror(err));
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) throw usage_error("cannot read {} {}: {}", what, path, std::strerror(errno));
  if (S_ISDIR(st.st_mode)) throw usage_error("{} {} is a directory; give a file", what, path);
  if (!S_ISREG(st.st_mode))
    throw usage_error("{} {} is {}, not a regular file; give a file", what, path, kind_of(st.st_mode));
  if (st.st_size > kMaxFileBytes)
    throw usage_error("{} {}: {} bytes, too large for this file (at most {}); check the path", what, path,
                      st.st_size, kMaxFileBytes);
  std::string text;
  char buf[8192];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw usage_error("cannot read {} {}: {}", what, path, std::strerror(errno));
    if (n == 0) return text;
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > static_cast<size_t>(kMaxFileBytes))
      throw usage_error("{} {}: too large for this file (more than {} bytes); check the path", what, path,
                        kMaxFileBytes);
  }
}

TlsPem load_tls_files(const TlsFiles& files, const TlsNames& names) {
  if (files.cert.empty() != files.key.empty())
    throw usage_error("{} and {} go together; give both", names.cert, names.key);
  Named ca{files.ca, names.ca, ""}, cert{files.cert, names.cert, ""}, key{files.key, names.key, ""};
  for (Named* f : {&ca, &cert, &key})
    if (!f->path.empty()) f->text = read_regular_file(f->path, f->what);
  if (!ca.path.empty()) certificates(ca, "the CA certificate(s) in PEM");
  if (!cert.path.empty()) {
    const auto chain = certificates(cert, "the certificate in PEM (its chain may follow it)");
    const Key k = private_key(key);
    ERR_clear_error();
    if (X509_check_private_key(chain.front().get(), k.get()) != 1) {
      ERR_clear_error();
      throw bad_file(key, "the key does not match the certificate in {} {}; give the key that certificate was made for",
                     cert.what, cert.path);
    }
  }
  return {std::move(ca.text), std::move(cert.text), std::move(key.text)};
}

}  // namespace trn::control
