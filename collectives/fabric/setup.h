// The phases of connect() that agree with the other ranks on rails and rings. Internal to
// collectives/fabric; connect.cc runs them, setup_rails.cc and setup_rings.cc hold them.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "collectives/bootstrap/store.h"
#include "collectives/core/deadline.h"
#include "collectives/fabric/endpoint.h"
#include "collectives/fabric/fabric.h"
#include "collectives/fabric/messages.h"
#include "collectives/fabric/router.h"

namespace trn::fabric {

// "a, b, c", or "none".
std::string join(const std::vector<std::string>& v);

// The rails TRN_FABRIC_RAILS names for the main provider prov: empty for one rail (the main
// endpoint as TRN_FABRIC_IFACE chose it).
std::vector<std::string> rail_names(const Options& o, const std::string& prov);
// The NUMA node of a rail's device (an efa device or a network interface), -1 when sysfs does
// not say (virtual interfaces have no device).
int numa_of_rail(const std::string& name);
// The NUMA node all of this process's CPUs are on, -1 when they span several or sysfs has none.
int numa_of_this_process();
// This process's affinity mask as AddressRecord::cpus holds it ("" when it cannot be read).
std::string cpus_of_this_process();

// Leaves out the rails that do not reach every host, by every rank alike: each says through the
// store which of its rails reach, and all keep the rails every rank found up. Rewrites every
// rank's record as if it had only those (so own rails and addresses follow) and closes the
// endpoints of the others; returns the names of the rails kept (empty: rail 0 alone is left).
std::vector<std::string> agree_on_rails(Store& store, const Options& opts, int rank, Deadline deadline,
                                        int liveness_fd, const std::vector<std::string>& names,
                                        std::vector<AddressRecord>& all, std::vector<std::unique_ptr<Endpoint>>& rails);

// trn's rings between the ranks of this host that reach each other through shm (ring_channel.h):
// fills each such peer's RingPeer and returns the segments the rings lie in.
std::vector<RingSegment> setup_rings(Store& store, const Options& opts, int rank,
                                     const std::vector<AddressRecord>& all, std::vector<Peer>& peers,
                                     Deadline deadline);

// Maps the pages of [at, at + len) of a shared mapping into this process's page tables now
// (madvise MADV_POPULATE_WRITE: writable), then touches each of them once from this thread:
// written when write (an atomic add of zero to the range's first byte in each page, which leaves
// the bytes as they are), read otherwise. False when the kernel cannot populate (before Linux
// 5.14); the touches then fault the pages in. setup_rings does this for each ring a rank writes
// (write) or reads: a ring restarts at its front whenever its reader caught up, so its deeper
// pages are otherwise first touched whenever a backlog first reaches them, in the middle of some
// operation, and a first touch costs a page fault (15-20 us on the development VM) and, under a
// hypervisor that shadows page tables, an exit to it even once populated (about 7 us a page
// there; bench/results/2026-12-07-small-collectives-spread.md).
bool map_pages(char* at, size_t len, bool write);

}  // namespace trn::fabric
