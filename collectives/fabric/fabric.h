// The fabric: trn::PointToPoint over libfabric (DESIGN.md layer 1). The only fabric header code
// above this layer includes; libfabric itself stays inside collectives/fabric.
//
//   trn::FileStore store(dir);                       // or the coordinator's store, or MPI's
//   auto p2p = trn::fabric::connect(store, rank, size);
//   auto r = p2p->irecv(peer, tag, buf, len);  ...  r->wait(trn::Deadline::from_default_timeout());
//
// One reliable-datagram endpoint (FI_EP_RDM, FI_TAGGED | FI_MSG, FI_AV_TABLE) per provider:
// the main one (efa, else tcp;ofi_rxm, or what TRN_FABRIC_PROVIDER names) reaches every rank;
// an optional shm endpoint carries traffic to ranks on the same host.
//
// Guarantees:
//  - Every method of the returned object is safe to call from any thread (one internal mutex,
//    never held while a thread sleeps waiting for completions). The intended use is one
//    communication thread posting and waiting, and any thread calling abort().
//  - Waiting spins on the completion queues for Options::spin (unless the waits of this thread
//    found that the peer shares its core: waiters.h), then keeps polling for Options::yield
//    while yielding the core between polls, then sleeps on the queues' wait fds (epoll) or, for
//    providers without one (shm), in short growing naps; a long wait does not burn a core.
//  - Messages of any length; above the provider's max_msg_size they are split (fabric/tag.h).
//    Receives match by (peer, tag) in posting order, before or after the send is posted.
//  - A wait that passes its deadline throws a timeout Error naming the peer rank, its host and
//    the tag. A lost peer (an operation still awaited with it failed because of it: a broken
//    connection, a probe finding its process gone, its same-host process ended) fails every
//    pending and later operation with every peer, with a remote Error naming it; the rank tells
//    the other ranks, which fail the same way (peer_watch.h).
//  - abort() fails every outstanding and future operation at once and closes the endpoints, so
//    no buffer of an aborted operation is touched after abort() returns.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "collectives/bootstrap/store.h"
#include "collectives/core/deadline.h"
#include "collectives/p2p.h"

namespace trn::fabric {

struct Options {
  // auto | efa | tcp | shm | sockets. auto: efa when fi_getinfo finds it, else tcp;ofi_rxm with
  // a warning.
  std::string provider = "auto";
  // Use an shm endpoint for peers on this host: -1 when several ranks share a host (and shm
  // exists), 0 never, 1 always (an error when shm is absent).
  int shm = -1;
  // Interface name (eth0) or address the tcp provider binds; empty: the provider's choice.
  std::string iface;
  // The rails (TRN_FABRIC_RAILS): empty or "1" for one endpoint (iface's); "auto" for every
  // device of the provider where it has several NICs (efa), one elsewhere; a count N for the
  // provider's first N domains; or names of interfaces or devices, comma-separated. Each rail is
  // an endpoint of the main provider; every rank must have as many. A message to another host
  // takes one of the sender's NUMA-near rails chosen by its tag (rails.h); messages of
  // stripe_min bytes or more to another host are striped over every rail.
  std::string rails;
  size_t stripe_min = 262144;
  // Store keys are "<prefix>/..."; connects with different prefixes never collide (use one per
  // generation / communicator world).
  std::string prefix = "fabric";
  // Deadline for connect() (store exchange and handshake).
  Duration connect_timeout = std::chrono::seconds(300);
  // Split messages into pieces of at most this many bytes; 0: the provider's max_msg_size.
  size_t max_piece = 0;
  // How long a wait polls the completion queues before it sleeps (TRN_FABRIC_SPIN_US). Short:
  // on a busy host a spinning waiter steals the core its peer or the compute thread needs.
  Duration spin = std::chrono::microseconds(10);
  // Unless TRN_FABRIC_SPIN_US is set: no spin when more ranks share this host than the CPUs
  // their affinity masks allow together, and each waiting thread's spin governor (waiters.h)
  // skips the spin while the peer shares its core. A rank spinning for a peer that is not
  // running only delays it; it goes straight to yielding instead
  // (bench/results/2026-11-30-fabric-spin.md, bench/results/2026-12-07-small-collectives.md).
  bool spin_auto = true;
  // Then how long it keeps polling, yielding the core between polls, before it sleeps
  // (TRN_FABRIC_YIELD_US). An answer usually arrives within it; a sleeper pays a wake-up (on a
  // virtual machine whose vCPU halted, longer than a small message takes;
  // bench/results/2026-11-29-fabric-waits.md), while a yielding poller lets the peer rank or the
  // compute thread run on a shared core.
  Duration yield = std::chrono::microseconds(500);
  // Give same-host peers reached through shm trn's own shared-memory rings (TRN_FABRIC_RING).
  bool ring = true;
  // Messages up to this many bytes travel inside the ring; longer ones only announce themselves
  // there (TRN_FABRIC_RING_EAGER; at most 1 MiB).
  size_t ring_eager = 262144;
  // The receiver of a longer message copies it straight from the sender's memory
  // (process_vm_readv), where connect finds the kernel allows it (TRN_FABRIC_PULL); otherwise
  // its bytes take libfabric's shm single-copy path.
  bool pull = true;
  // Register every buffer as if the provider asked for FI_MR_LOCAL (TRN_FABRIC_MR_LOCAL: the
  // registration path EFA takes, on providers that do not need it).
  bool force_mr_local = false;

  // TRN_FABRIC_PROVIDER, TRN_FABRIC_SHM, TRN_FABRIC_IFACE, TRN_FABRIC_RAILS,
  // TRN_FABRIC_STRIPE_MIN, TRN_FABRIC_SPIN_US,
  // TRN_FABRIC_YIELD_US, TRN_FABRIC_RING, TRN_FABRIC_RING_EAGER, TRN_FABRIC_PULL,
  // TRN_FABRIC_MR_LOCAL, TRN_TIMEOUT,
  // TRN_GENERATION (prefix "fabric/g<generation>").
  static Options from_environment();
};

// Opens the endpoints, publishes this rank's addresses under opts.prefix, reads every other
// rank's, and checks with a ring handshake that messages flow. Every rank of the world calls it
// with the same size, prefix and provider choice. Usage errors: bad rank/size, an unknown or
// absent provider (the message lists those present).
std::shared_ptr<PointToPoint> connect(Store& store, int rank, int size,
                                      const Options& opts = Options::from_environment());

// Names of the libfabric providers that offer reliable tagged messaging on this host, e.g.
// {"shm", "sockets", "tcp;ofi_rxm"}.
std::vector<std::string> available_providers();

}  // namespace trn::fabric
