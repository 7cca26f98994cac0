// What a gRPC failure says in trn's error lines: never an empty reason.
#include <catch2/catch.hpp>

#include "launcher/client/rpc.h"

using namespace trn;

TEST_CASE("launcher: a gRPC status without a message is named by its code, never an empty reason") {
  CHECK(control::status_text(grpc::Status(grpc::StatusCode::UNAVAILABLE, "connection refused")) ==
        "connection refused");
  CHECK(control::status_text(grpc::Status(grpc::StatusCode::CANCELLED, "")) == "CANCELLED (no message)");
  CHECK(control::status_text(grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "")) ==
        "UNAUTHENTICATED (no message)");
  // The error a caller sees carries it too.
  const Error e = control::to_error(grpc::Status(grpc::StatusCode::INTERNAL, ""), "join of job j", "h:1");
  CHECK(std::string(e.what()).find("join of job j: INTERNAL (no message)") != std::string::npos);
}
