// CoordinatorStore: trn::Store over the coordinator's per-job key-value store. Keys live in one
// job and generation; a new generation starts empty.
#include <atomic>
#include <random>

#include "launcher/client/rpc.h"

namespace trn::control {

namespace {

double secs(Duration d) { return std::chrono::duration<double>(d).count(); }

class CoordinatorStore final : public Store {
 public:
  CoordinatorStore(std::shared_ptr<CoordinatorClient::Impl> impl, std::string job_id, int64_t generation)
      : impl_(std::move(impl)), job_(std::move(job_id)), gen_(generation) {
    std::random_device rd;
    client_id_ = fmt::format("{:08x}{:08x}", rd(), rd());
  }

  void set(const std::string& key, const std::string& value) override {
    v1::SetRequest req;
    req.set_job_id(job_);
    req.set_generation(gen_);
    req.set_key(key);
    req.set_value(value);
    v1::SetResponse resp;
    impl_->call(&v1::Coordinator::Stub::Set, req, &resp, Deadline::after(impl_->options.rpc_timeout),
                fmt::format("store set of key '{}'", key));
  }

  std::string get(const std::string& key, Deadline deadline) override {
    v1::GetRequest req;
    req.set_job_id(job_);
    req.set_generation(gen_);
    req.set_key(key);
    v1::GetResponse resp;
    auto start = Clock::now();
    try {
      impl_->call_with_retry(
          fmt::format("store get of key '{}'", key), deadline,
          [&](grpc::ClientContext& ctx) {
            req.set_timeout_ms(std::chrono::duration_cast<std::chrono::milliseconds>(deadline.remaining()).count());
            return impl_->stub()->Get(&ctx, req, &resp);
          },
          CoordinatorClient::Impl::kWaitGrace);
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kTimeout && !(e.kind() == ErrorKind::kRemote && deadline.expired())) throw;
      throw timeout_error("store get: waited {:.1f} s for key '{}' (job '{}', generation {}) and it was never "
                          "set: the rank that sets it has not arrived or has died ({}); raise TRN_TIMEOUT "
                          "if it is only slow",
                          secs(Clock::now() - start), key, job_, gen_, e.what());
    }
    return resp.value();
  }

  int64_t add(const std::string& key, int64_t delta) override {
    v1::AddRequest req;
    req.set_job_id(job_);
    req.set_generation(gen_);
    req.set_key(key);
    req.set_delta(delta);
    req.set_request_id(fmt::format("{}-{}", client_id_, next_request_++));
    v1::AddResponse resp;
    impl_->call(&v1::Coordinator::Stub::Add, req, &resp, Deadline::after(impl_->options.rpc_timeout),
                fmt::format("store add to key '{}'", key));
    return resp.value();
  }

  void wait(const std::vector<std::string>& keys, Deadline deadline) override {
    auto start = Clock::now();
    for (size_t i = 0; i < keys.size(); ++i) {
      try {
        get(keys[i], deadline);
      } catch (const Error& e) {
        if (e.kind() != ErrorKind::kTimeout) throw;
        size_t set = i;
        std::string missing;
        for (size_t j = i; j < keys.size(); ++j) {
          bool present = true;
          try {
            get(keys[j], Deadline::after(Duration::zero()));
          } catch (const Error&) {
            present = false;
          }
          if (present) ++set;
          else if (missing.size() < 200) missing += (missing.empty() ? "'" : ", '") + keys[j] + "'";
        }
        throw timeout_error("store wait: waited {:.1f} s for {} keys (job '{}', generation {}): {} of {} set; "
                            "missing: {}",
                            secs(Clock::now() - start), keys.size(), job_, gen_, set, keys.size(), missing);
      }
    }
  }

 private:
  std::shared_ptr<CoordinatorClient::Impl> impl_;
  std::string job_;
  int64_t gen_;
  std::string client_id_;
  std::atomic<uint64_t> next_request_{1};
};

}  // namespace

std::unique_ptr<Store> CoordinatorClient::store(const std::string& job_id, int64_t generation) {
  return std::make_unique<CoordinatorStore>(impl_, job_id, generation);
}

}  // namespace trn::control
