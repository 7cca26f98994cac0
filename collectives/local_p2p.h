// An in-process PointToPoint: n endpoints in one process (one per thread) that exchange
// messages by memcpy. It serves a world of size 1 and unit tests of the algorithms; real
// processes use the fabric (collectives/fabric/fabric.h).
//
// Semantics match the fabric's: messages match by (source, tag) in posting order; a send
// completes only once a receive has taken its data (rendezvous), so an algorithm that relies on
// sends completing before the matching receive is posted deadlocks here too, and is caught.
// Waits block on a condition variable (no spinning).
#pragma once

#include <memory>
#include <vector>

#include "collectives/p2p.h"

namespace trn {

// hosts: the host index each rank reports through host_of (tests of host-aware algorithms);
// empty: all on host 0.
std::vector<std::shared_ptr<PointToPoint>> make_local_group(int size, std::vector<int> hosts = {});

}  // namespace trn
