// trnrun: starts and supervises this node's workers of a trn job (see launcher/agent/options.h
// for the command line and launcher/agent/agent.h for what the agent does).
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "collectives/core/main.h"
#include "launcher/agent/agent.h"
#include "launcher/agent/embedded_coordinator.h"
#include "launcher/agent/plan.h"

namespace {

using namespace trn::launch;

std::string read_token(const std::string& path) {
  if (path.empty()) return "";
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string token = ss.str();
  while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) token.pop_back();
  if (token.empty()) throw trn::usage_error("--token-file {} is empty; put the coordinator's token in it", path);
  return token;
}

int trnrun(int argc, char** argv) {
  LaunchOptions options = parse_launch_options(std::vector<std::string>(argv + 1, argv + argc), process_env());
  if (options.help) return 0;  // the parse printed it
  if (options.dry_run) {
    fmt::print("{}", format_dry_run(options));
    return 0;
  }
  remove_stale_run_dirs();  // what SIGKILLed trnruns left behind
  trn::control::ClientOptions client;
  client.token = read_token(options.token_file);
  client.tls_ca_file = options.tls_ca;
  client.tls_cert_file = options.tls_cert;
  client.tls_key_file = options.tls_key;
  client.rpc_timeout = std::chrono::seconds(10);
  if (!options.log_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(options.log_dir, ec);
    if (ec) throw trn::usage_error("--log-dir {}: cannot create it: {}", options.log_dir, ec.message());
    if (::access(options.log_dir.c_str(), W_OK | X_OK) != 0)
      throw trn::usage_error("--log-dir {} is not writable by this user; pick another directory", options.log_dir);
  }

  SignalWatcher signals;  // before anything starts, so a Ctrl-C from here on is handled
  std::unique_ptr<EmbeddedCoordinator> embedded;
  client.address = options.coordinator;
  if (client.address.empty()) {
    embedded = std::make_unique<EmbeddedCoordinator>(
        own_bin_dir() + "/trn-coordinator", options.token_file,
        options.log_dir.empty() ? "" : options.log_dir + "/coordinator.log", trn::Deadline::after(std::chrono::seconds(30)));
    client.address = embedded->address();
  }
  auto control = coordinator_control_plane(client);
  Agent agent(options, *control, client.address, signals, embedded ? embedded->dir() : "");
  if (embedded) agent.watch_coordinator([&] { return embedded->lost(); });
  AgentResult result = agent.run();
  if (!result.message.empty()) fmt::print(stderr, "trnrun: {}\n", result.message);
  if (agent.abandoned_call()) {
    // Interrupted during rendezvous: a call is still in flight on another thread; end now.
    if (embedded) embedded->stop(std::chrono::seconds(2));
    std::fflush(stdout);
    std::fflush(stderr);
    _exit(result.exit_code);
  }
  return result.exit_code;
}

}  // namespace

int main(int argc, char** argv) {
  return trn::run_main("trnrun", [&] { return trnrun(argc, argv); });
}
