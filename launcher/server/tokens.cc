#include "launcher/server/tokens.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/sha.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "collectives/core/error.h"

namespace trn::control {

static std::string to_hex(const unsigned char* p, size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    out[2 * i] = kDigits[p[i] >> 4];
    out[2 * i + 1] = kDigits[p[i] & 15];
  }
  return out;
}

std::string random_hex(size_t n) {
  std::vector<unsigned char> buf(n);
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::getrandom(buf.data() + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) throw internal_error("getrandom failed: {}", std::strerror(errno));
    got += static_cast<size_t>(r);
  }
  return to_hex(buf.data(), n);
}

std::string derive_job_token(const std::string& admin_token, const std::string& job_id,
                             const std::string& nonce) {
  std::string message = "trn job token v1";
  message.push_back('\0');
  message += job_id;
  message.push_back('\0');
  message += nonce;
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), admin_token.data(), static_cast<int>(admin_token.size()),
            reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac, &len))
    throw internal_error("HMAC-SHA256 failed");
  return to_hex(mac, len);
}

std::string token_digest(const std::string& token) {
  unsigned char d[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(), d);
  return std::string(reinterpret_cast<const char*>(d), sizeof d);
}

}  // namespace trn::control
