#include "collectives/algorithms/algorithm.h"
#include "collectives/tag.h"

namespace trn::algo {

RequestPtr Context::isend(int peer, uint64_t step, const void* buf, size_t len) {
  return p2p_.isend(ranks()[peer], tag::collective(comm_id_, seq_, step_base_ + step), buf, len);
}

RequestPtr Context::irecv(int peer, uint64_t step, void* buf, size_t len) {
  return p2p_.irecv(ranks()[peer], tag::collective(comm_id_, seq_, step_base_ + step), buf, len);
}

void Context::wait(const RequestPtr& r) {
  if (r) r->wait(deadline_);
}

void Context::wait_all(std::vector<RequestPtr>& rs) {
  for (auto& r : rs) wait(r);
  rs.clear();
}

}  // namespace trn::algo
