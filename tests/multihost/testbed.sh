#!/usr/bin/env bash
# A cluster of "hosts" on one machine, for trn's multi-host tests and benchmarks (root only).
#
# Host k of bed NAME is a network namespace NAME-hk with its own UTS namespace (hostname NAME-hk)
# and one interface, eth0, at 10.213.S.(k+1)/24 (S: a subnet per bed, so beds can coexist). The
# hosts' eth0 are veth pairs whose other ends sit on a bridge inside a switch namespace NAME-sw:
# no interface of the caller's namespace is touched and no traffic leaves the machine. trn sees
# different hostnames, so ranks in different hosts take the network paths (no shm, no pulls);
# ranks in one host share its hostname and take the same-host paths.
#
#   testbed.sh up NAME H [--rails R] [--rate RATE]
#                                   make H hosts (replaces a stale bed of that name); with
#                                   --rails, each host has R interfaces eth0..eth(R-1), rail r on a
#                                   switch (bridge) of its own at 10.(213+r).S.(k+1)/24, as the NICs
#                                   of a rail-optimised cluster; --rate caps every rail link, each
#                                   way, at RATE (tc tbf, e.g. 500mbit) so it behaves as a NIC of
#                                   that speed
#   testbed.sh down NAME            remove the bed, killing whatever still runs in it
#   testbed.sh exec NAME K CMD...   run CMD in host K (its network and hostname), same filesystem
#   testbed.sh addr NAME K [R]      host K's address (on rail R, default 0)
#   testbed.sh hosts NAME           the hostnames, one per line
#   testbed.sh netem NAME K ARGS [R]
#                                   tc netem on host K's link of rail R (default 0), both directions
#                                   ("delay 1ms", "loss 100%", "" to clear); not on a --rate bed
#   testbed.sh kill NAME K          SIGKILL every process in host K (the host "dies")
#   testbed.sh sweep                remove beds whose creator process has exited
#
# State lives in /run/trn-testbed/NAME/ (subnet, host count, creator pid, UTS namespace files).
set -euo pipefail

root=/run/trn-testbed
die() { echo "testbed.sh: $*" >&2; exit 2; }
need_root() { [[ $(id -u) == 0 ]] || die "needs root (network namespaces)"; }
bed_dir() { echo "$root/$1"; }
check_name() { [[ $1 =~ ^[a-z0-9]{1,8}$ ]] || die "bed name '$1' must be 1-8 of [a-z0-9]"; }
hosts_of() { cat "$(bed_dir "$1")/hosts" 2>/dev/null || die "no bed named '$1'"; }
check_host() {
  local n; n=$(hosts_of "$1")
  [[ $2 =~ ^[0-9]+$ && $2 -lt $n ]] || die "bed '$1' has hosts 0..$((n - 1)), not '$2'"
}

down() {
  local name=$1 dir; dir=$(bed_dir "$name")
  local n=0; [[ -f $dir/hosts ]] && n=$(cat "$dir/hosts")
  for ((k = 0; k < n; ++k)); do
    local pids; pids=$(ip netns pids "$name-h$k" 2>/dev/null || true)
    [[ -n $pids ]] && kill -9 $pids 2>/dev/null || true
  done
  for ((k = 0; k < n; ++k)); do
    ip netns del "$name-h$k" 2>/dev/null || true
    umount "$dir/h$k.uts" 2>/dev/null || true
  done
  ip netns del "$name-sw" 2>/dev/null || true
  rm -rf "$dir"
}

free_subnet() {
  local used=" "
  for f in "$root"/*/subnet; do [[ -f $f ]] && used+="$(cat "$f") "; done
  for ((s = 1; s < 255; ++s)); do [[ $used != *" $s "* ]] && { echo $s; return; }; done
  die "no free subnet: remove old beds (testbed.sh sweep)"
}

up() {
  local name=$1 n=$2 rails=1 rate=""
  [[ $n =~ ^[0-9]+$ && $n -ge 1 && $n -le 64 ]] || die "host count '$n' must be 1..64"
  shift 2
  while [[ $# -gt 0 ]]; do
    case $1 in
      --rails) [[ ${2:-} =~ ^([1-9]|1[0-6])$ ]] || die "--rails takes 1..16, not '${2:-}'"
               rails=$2; shift 2 ;;
      --rate) [[ ${2:-} =~ ^[1-9][0-9]*(k|m|g)?bit$ ]] || die "--rate takes a tc rate such as 500mbit, not '${2:-}'"
              rate=$2; shift 2 ;;
      *) die "up: unknown option '$1' (--rails R, --rate RATE)" ;;
    esac
  done
  check_name "$name"
  [[ $n =~ ^[0-9]+$ && $n -ge 1 && $n -le 64 ]] || die "host count '$n' must be 1..64"
  need_root
  down "$name"
  mkdir -p "$root"
  local dir; dir=$(bed_dir "$name")
  mkdir -p "$dir"
  # The subnet is claimed under a lock so that two beds made at once never share one.
  exec 9>"$root/.lock"
  flock 9
  local s; s=$(free_subnet)
  echo "$s" >"$dir/subnet"
  flock -u 9
  echo "$n" >"$dir/hosts"
  echo "$rails" >"$dir/rails"
  [[ -z $rate ]] || echo "$rate" >"$dir/rate"
  echo "${TESTBED_OWNER:-$PPID}" >"$dir/owner"
  ip netns add "$name-sw"
  ip -n "$name-sw" link set lo up
  for ((r = 0; r < rails; ++r)); do
    ip -n "$name-sw" link add "br$r" type bridge
    ip -n "$name-sw" link set "br$r" up
  done
  for ((k = 0; k < n; ++k)); do
    local ns="$name-h$k"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    for ((r = 0; r < rails; ++r)); do
      # Rail 0's switch port keeps the name h<k> it had before there were rails.
      local port="h$k"; ((r == 0)) || port="h${k}r$r"
      ip link add "eth$r" netns "$ns" type veth peer name "$port" netns "$name-sw"
      ip -n "$name-sw" link set "$port" master "br$r" up
      ip -n "$ns" addr add "10.$((213 + r)).$s.$((k + 1))/24" dev "eth$r"
      ip -n "$ns" link set "eth$r" up
      if [[ -n $rate ]]; then
        # Both ends shape what they send: the host's eth<r> its egress, the switch port the
        # host's ingress.
        tc -n "$ns" qdisc add dev "eth$r" root tbf rate "$rate" burst 256kb latency 100ms ||
          die "--rate: this kernel cannot shape with tc tbf"
        tc -n "$name-sw" qdisc add dev "$port" root tbf rate "$rate" burst 256kb latency 100ms
      fi
    done
    touch "$dir/h$k.uts"
    unshare --uts="$dir/h$k.uts" hostname "$ns"
  done
}

run_in() {
  local name=$1 k=$2; shift 2
  check_host "$name" "$k"
  exec nsenter --net="/run/netns/$name-h$k" --uts="$(bed_dir "$name")/h$k.uts" -- "$@"
}

# Link settings use tc netem where the kernel has qdiscs. Kernels built without them
# (CONFIG_NET_SCHED off) get the same two settings from netfilter in the host's namespace: loss
# as a random DROP, delay as an NFQUEUE served by trn-netdelay (tests/multihost/netdelay).
netem() {
  local name=$1 k=$2 args=${3:-} rail=${4:-0}
  check_host "$name" "$k"
  [[ $rail =~ ^[0-9]+$ ]] || die "netem: rail '$rail' is not a number"
  local rails; rails=$(cat "$(bed_dir "$name")/rails" 2>/dev/null || echo 1)
  ((rail < rails)) || die "netem: bed '$name' has $rails rail(s), no rail $rail"
  # netem would replace a rail's --rate shaping: not both on one bed.
  [[ ! -f $(bed_dir "$name")/rate ]] || die "netem: bed '$name' shapes its links with --rate; make it without --rate to use netem"
  local port="h$k"
  ((rail == 0)) || port="h${k}r$rail"
  # The probe runs on the host's own interface, never on an interface of the caller's namespace.
  if tc -n "$name-h$k" qdisc replace dev "eth$rail" root netem delay 0ms 2>/dev/null; then
    for side in "-n $name-h$k eth$rail" "-n $name-sw $port"; do
      set -- $side
      tc "$1" "$2" qdisc del dev "$3" root 2>/dev/null || true
      [[ -z $args ]] || tc "$1" "$2" qdisc add dev "$3" root netem $args
    done
    return 0
  fi
  local delay_ms="" loss=""
  set -- $args
  while [[ $# -gt 0 ]]; do
    case $1 in
      delay) [[ ${2:-} =~ ^([0-9.]+)ms$ ]] || die "netem: delay takes <N>ms, not '${2:-}'"
             delay_ms=${BASH_REMATCH[1]}; shift 2 ;;
      loss) [[ ${2:-} =~ ^([0-9.]+)%$ ]] || die "netem: loss takes <P>%, not '${2:-}'"
            loss=${BASH_REMATCH[1]}; shift 2 ;;
      *) die "netem: this kernel has no qdiscs; only 'delay <N>ms' and 'loss <P>%' are emulated, not '$1'" ;;
    esac
  done
  [[ -z $delay_ms || $rail == 0 ]] || die "netem: this kernel has no qdiscs, and trn-netdelay delays rail 0 only"
  local dir; dir=$(bed_dir "$name")
  local in_host=(nsenter "--net=/run/netns/$name-h$k" --)
  if [[ $rail == 0 && -f $dir/h$k.netdelay ]]; then
    kill "$(cat "$dir/h$k.netdelay")" 2>/dev/null || true
    rm -f "$dir/h$k.netdelay"
  fi
  local chain=TRNLINK dev=eth$rail
  ((rail == 0)) || chain=TRNLINK$rail
  "${in_host[@]}" iptables -w -N "$chain" 2>/dev/null || true
  "${in_host[@]}" iptables -w -F "$chain"
  "${in_host[@]}" iptables -w -C INPUT -i "$dev" -j "$chain" 2>/dev/null ||
    "${in_host[@]}" iptables -w -A INPUT -i "$dev" -j "$chain"
  "${in_host[@]}" iptables -w -C OUTPUT -o "$dev" -j "$chain" 2>/dev/null ||
    "${in_host[@]}" iptables -w -A OUTPUT -o "$dev" -j "$chain"
  if [[ -n $loss ]]; then
    local p; p=$(awk -v l="$loss" 'BEGIN { printf "%.6f", l / 100 }')
    if [[ $p == 1.000000 ]]; then "${in_host[@]}" iptables -w -A "$chain" -j DROP
    else "${in_host[@]}" iptables -w -A "$chain" -m statistic --mode random --probability "$p" -j DROP; fi
  fi
  if [[ -n $delay_ms ]]; then
    local tool=${TRN_NETDELAY:-$(cd "$(dirname "$0")/../.." && pwd)/build/release/bin/trn-netdelay}
    [[ -x $tool ]] || die "netem: delay needs trn-netdelay ($tool); build it or set TRN_NETDELAY"
    "${in_host[@]}" "$tool" --queue 7 --delay-ms "$delay_ms" </dev/null >"$dir/h$k.netdelay.log" 2>&1 &
    echo $! >"$dir/h$k.netdelay"
    # The queue must have its reader before packets are sent to it.
    sleep 0.2
    kill -0 "$(cat "$dir/h$k.netdelay")" 2>/dev/null || die "netem: trn-netdelay failed: $(cat "$dir/h$k.netdelay.log")"
    "${in_host[@]}" iptables -w -A TRNLINK -j NFQUEUE --queue-num 7 --queue-bypass
  fi
  return 0
}

cmd=${1:-}; shift || true
case $cmd in
  up) [[ $# -ge 2 ]] || die "usage: up NAME H [--rails R] [--rate RATE]"; up "$@" ;;
  down) [[ $# == 1 ]] || die "usage: down NAME"; need_root; down "$1" ;;
  exec) [[ $# -ge 3 ]] || die "usage: exec NAME K CMD..."; run_in "$@" ;;
  addr) [[ $# == 2 || $# == 3 ]] || die "usage: addr NAME K [R]"; check_host "$1" "$2"
        rail=${3:-0}; rails=$(cat "$(bed_dir "$1")/rails" 2>/dev/null || echo 1)
        [[ $rail =~ ^[0-9]+$ && $rail -lt $rails ]] || die "bed '$1' has rails 0..$((rails - 1)), not '$rail'"
        echo "10.$((213 + rail)).$(cat "$(bed_dir "$1")/subnet").$(($2 + 1))" ;;
  hosts) [[ $# == 1 ]] || die "usage: hosts NAME"; n=$(hosts_of "$1")
         for ((k = 0; k < n; ++k)); do echo "$1-h$k"; done ;;
  netem) [[ $# -ge 2 ]] || die "usage: netem NAME K ARGS [RAIL]"; netem "$1" "$2" "${3:-}" "${4:-0}" ;;
  kill) [[ $# == 2 ]] || die "usage: kill NAME K"; check_host "$1" "$2"
        pids=$(ip netns pids "$1-h$2" || true); [[ -n $pids ]] && kill -9 $pids 2>/dev/null; true ;;
  sweep) need_root
         for d in "$root"/*/; do
           [[ -d $d ]] || continue
           owner=$(cat "$d/owner" 2>/dev/null || echo 0)
           kill -0 "$owner" 2>/dev/null || down "$(basename "$d")"
         done ;;
  *) die "unknown command '${cmd}' (up, down, exec, addr, hosts, netem, kill, sweep)" ;;
esac
