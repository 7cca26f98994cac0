#include "launcher/client/heartbeat_datagram.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>

#include <cstring>
#include <memory>

namespace trn::control {

namespace {

constexpr char kMagic[4] = {'T', 'R', 'N', 'H'};
constexpr uint8_t kVersion = 1;

void put_le(char* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

uint64_t get_le(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

// One HMAC-SHA256 context per thread, its digest fetched once: OpenSSL's one-shot HMAC() fetches
// the algorithms on every call, which cost as much as the rest of a datagram's handling.
struct MacContext {
  EVP_MAC* mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  EVP_MAC_CTX* ctx = mac ? EVP_MAC_CTX_new(mac) : nullptr;
  bool ready = false;
  MacContext() {
    char digest[] = "SHA256";
    OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                           OSSL_PARAM_construct_end()};
    ready = ctx && EVP_MAC_CTX_set_params(ctx, params) == 1;
  }
  ~MacContext() {
    EVP_MAC_CTX_free(ctx);
    EVP_MAC_free(mac);
  }
};

bool hmac(const std::string& key, std::string_view message, std::string_view bound,
          unsigned char out[kDatagramMac]) {
  thread_local MacContext m;
  size_t len = 0;
  return m.ready &&
         EVP_MAC_init(m.ctx, reinterpret_cast<const unsigned char*>(key.data()), key.size(), nullptr) == 1 &&
         EVP_MAC_update(m.ctx, reinterpret_cast<const unsigned char*>(message.data()), message.size()) == 1 &&
         EVP_MAC_update(m.ctx, reinterpret_cast<const unsigned char*>(bound.data()), bound.size()) == 1 &&
         EVP_MAC_final(m.ctx, out, &len, kDatagramMac) == 1 && len == kDatagramMac;
}

}  // namespace

std::optional<std::string> encode_datagram(DatagramType type, uint64_t seq, uint64_t epoch,
                                           std::string_view payload, const std::string& key,
                                           std::string_view bound) {
  const size_t total = kDatagramHeader + payload.size() + (key.empty() ? 0 : kDatagramMac);
  if (total > kMaxDatagram) return std::nullopt;
  std::string out(kDatagramHeader, '\0');
  std::memcpy(out.data(), kMagic, 4);
  out[4] = static_cast<char>(kVersion);
  out[5] = static_cast<char>(type);
  out[6] = key.empty() ? 0 : 1;
  put_le(out.data() + 8, seq, 8);
  put_le(out.data() + 16, epoch, 8);
  put_le(out.data() + 24, payload.size(), 4);
  out.append(payload);
  if (!key.empty()) {
    unsigned char mac[kDatagramMac];
    if (!hmac(key, out, bound, mac)) return std::nullopt;
    out.append(reinterpret_cast<const char*>(mac), kDatagramMac);
  }
  return out;
}

std::optional<Datagram> parse_datagram(std::string_view bytes, std::string* why) {
  auto no = [&](const char* reason) -> std::optional<Datagram> {
    if (why) *why = reason;
    return std::nullopt;
  };
  if (bytes.size() < kDatagramHeader) return no("shorter than the header");
  if (bytes.size() > kMaxDatagram) return no("longer than the largest datagram");
  if (std::memcmp(bytes.data(), kMagic, 4) != 0) return no("not a heartbeat datagram (bad magic)");
  if (static_cast<uint8_t>(bytes[4]) != kVersion) return no("unknown version");
  const auto type = static_cast<uint8_t>(bytes[5]);
  if (type != static_cast<uint8_t>(DatagramType::kRequest) &&
      type != static_cast<uint8_t>(DatagramType::kReply))
    return no("unknown type");
  const auto mac = static_cast<uint8_t>(bytes[6]);
  if (mac > 1) return no("unknown MAC kind");
  if (bytes[7] != 0) return no("reserved byte is not 0");
  Datagram d;
  d.type = static_cast<DatagramType>(type);
  d.seq = get_le(bytes.data() + 8, 8);
  if (d.seq == 0) return no("sequence 0");
  d.epoch = get_le(bytes.data() + 16, 8);
  const uint64_t n = get_le(bytes.data() + 24, 4);
  const size_t mac_bytes = mac ? kDatagramMac : 0;
  if (bytes.size() < kDatagramHeader + mac_bytes || n != bytes.size() - kDatagramHeader - mac_bytes)
    return no("length does not match the header");
  d.payload = bytes.substr(kDatagramHeader, n);
  d.signed_bytes = bytes.substr(0, kDatagramHeader + n);
  if (mac) d.mac = bytes.substr(kDatagramHeader + n, kDatagramMac);
  return d;
}

bool datagram_mac_ok(const Datagram& d, const std::string& key, std::string_view bound) {
  if (key.empty()) return d.mac.empty();
  if (d.mac.size() != kDatagramMac) return false;
  unsigned char want[kDatagramMac];
  if (!hmac(key, d.signed_bytes, bound, want)) return false;
  return CRYPTO_memcmp(want, d.mac.data(), kDatagramMac) == 0;
}

std::string_view mac_of(std::string_view datagram, bool keyed) {
  if (!keyed || datagram.size() < kDatagramHeader + kDatagramMac) return {};
  return datagram.substr(datagram.size() - kDatagramMac);
}

}  // namespace trn::control
