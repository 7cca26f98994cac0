// The one HOST:PORT parser every trn program uses (launcher/client/address.h).
#include "launcher/client/address.h"

#include <catch2/catch.hpp>

#include "collectives/core/error.h"

using trn::control::address_problem;
using trn::control::parse_address;
using trn::control::parse_address_list;
using trn::control::PortUse;

TEST_CASE("addresses: names, IPv4 and bracketed IPv6 hosts with a port in range are accepted") {
  for (const char* ok : {"127.0.0.1:1", "localhost:65535", "coord-a.example.com:29400", "coord_a:7", "host.:80",
                         "[::1]:7000", "[fe80::1%eth0]:7000", "[2001:db8::1]:443", "10.0.0.1:080"}) {
    INFO(ok);
    CHECK(address_problem(ok, PortUse::kDial) == "");
  }
  const auto hp = parse_address("[::1]:7000", "--x");
  CHECK(hp.host == "::1");
  CHECK(hp.port == 7000);
  CHECK(hp.ipv6);
  CHECK(hp.str() == "[::1]:7000");
  CHECK(parse_address("10.0.0.1:080", "--x").str() == "10.0.0.1:80");
  // Listening: port 0 picks a free one, and an empty host is every interface.
  CHECK(parse_address(":0", "--listen", PortUse::kListen).port == 0);
  CHECK(parse_address("[::]:0", "--listen", PortUse::kListen).host == "::");
}

TEST_CASE("addresses: a port out of range is refused, never wrapped, and each fault is named") {
  for (const auto& [bad, why] : std::vector<std::pair<std::string, std::string>>{
           {"127.0.0.1:99999", "port 99999 is out of range"},
           {"127.0.0.1:65536", "port 65536 is out of range"},
           {"127.0.0.1:0", "port 0 is out of range"},
           {"127.0.0.1:18446744073709551617", "out of range"},
           {"127.0.0.1:-1", "is not a number"},
           {"127.0.0.1:+80", "is not a number"},
           {"127.0.0.1: 80", "is not a number"},
           {"127.0.0.1:", "no port after ':'"},
           {"127.0.0.1", "no :PORT"},
           {":80", "no host before ':'"},
           {"::1:80", "an IPv6 host goes in brackets"},
           {"[::1]", "no :PORT after the ']'"},
           {"[::1:80", "'[' without ']'"},
           {"[zz]:80", "[zz] is not an IPv6 address"},
           {"[fe80::1%]:80", "zone"},
           {"10.0.0.256:80", "10.0.0.256 is not an IPv4 address"},
           {"1.2.3:80", "1.2.3 is not an IPv4 address"},
           {"bad host:80", "'bad host' is not a host name"},
           {"-lead.example:80", "is not a host name"},
           {"a..b:80", "is not a host name"},
           {"http://h:80", "without a scheme"},
       }) {
    INFO(bad);
    CHECK_THAT(address_problem(bad, PortUse::kDial), Catch::Contains(why));
  }
  CHECK_THAT(address_problem("h:65536", PortUse::kListen), Catch::Contains("out of range"));
}

TEST_CASE("addresses: the usage line names the flag, the value, the fault and the range") {
  try {
    parse_address("127.0.0.1:99999", "--coordinator");
    FAIL("accepted");
  } catch (const trn::Error& e) {
    CHECK(e.kind() == trn::ErrorKind::kUsage);
    CHECK(std::string(e.what()) ==
          "--coordinator 127.0.0.1:99999: port 99999 is out of range; expected HOST:PORT with a port in 1-65535 "
          "(HOST: a name, an IPv4 address or [IPv6])");
  }
  try {
    parse_address("h:70000", "--listen", PortUse::kListen);
    FAIL("accepted");
  } catch (const trn::Error& e) {
    CHECK_THAT(e.what(), Catch::StartsWith("--listen h:70000: ") && Catch::Contains("a port in 0-65535"));
  }
  CHECK(parse_address_list(" a:1 , [::1]:2", "TRN_COORDINATOR").size() == 2);
  for (const char* bad : {"a:1,", "a:1,,b:2", "a:1,b:99999"}) {
    INFO(bad);
    try {
      parse_address_list(bad, "TRN_COORDINATOR");
      FAIL("accepted");
    } catch (const trn::Error& e) {
      CHECK(e.kind() == trn::ErrorKind::kUsage);
      CHECK_THAT(e.what(), Catch::StartsWith("TRN_COORDINATOR ") && Catch::Contains("1-65535"));
    }
  }
}
