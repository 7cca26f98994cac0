#!/bin/bash
# All-reduce over one rail against two, on a test bed whose rails are capped NICs (root only).
#   bench/rails_allreduce.sh [BIN_DIR]            (default build/release/bin)
#   REPS=3 RATE=400mbit SIZES="16M 64M" ALGO=auto RAW=rows.txt bench/rails_allreduce.sh
# 2 hosts x 2 ranks on a bed with 2 rails per host (tests/multihost/testbed.sh --rails 2: an
# interface per rail on a switch of its own, each link capped at RATE both ways by tc tbf).
# trn-collbench runs under mpirun with TRN_FABRIC_RAILS=eth0 (one rail) and eth0,eth1 (two:
# messages to the other host spread over both by tag, large ones striped), REPS launches each,
# alternating which goes first. Prints the median busbw of each size (from the median time,
# busbw = size / time * 2(n-1)/n), two rails' over one's, and the bytes each rail carried
# (tx_bytes of each host's eth0 and eth1, summed over the launches of each side). RAW keeps
# every launch's rows (rails rep bytes us).
set -euo pipefail
BIN=$(cd "${1:-build/release/bin}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TB=$ROOT/tests/multihost/testbed.sh
RSH=$ROOT/tests/multihost/trn-rsh
REPS=${REPS:-3}
RATE=${RATE:-400mbit}
SIZES=${SIZES:-"16M 32M 64M"}
ALGO=${ALGO:-auto}
[[ $(id -u) == 0 ]] || { echo "rails_allreduce.sh: needs root (test-bed namespaces)" >&2; exit 2; }
export TESTBED_OWNER=$$ TRN_NETDELAY=$BIN/trn-netdelay
name=rb$((RANDOM % 100000))
out=$(mktemp -d)
trap '"$TB" down "$name" >/dev/null 2>&1 || true; [[ -z ${RAW:-} ]] || cp "$out/rows" "$RAW"; rm -rf "$out"' EXIT

tx() {  # host iface -> bytes sent so far (/proc/net/dev follows the namespace)
  "$TB" exec "$name" "$1" cat /proc/net/dev | awk -v d="$2:" '$1 == d { print $10 }'
}

run() {  # rails rep
  local rails=$1 rep=$2 s
  local before=() after=()
  for k in 0 1; do for i in eth0 eth1; do before+=("$(tx $k $i)"); done; done
  for s in $SIZES; do
    "$TB" exec "$name" 0 mpirun --allow-run-as-root --oversubscribe --mca plm_rsh_agent "$RSH" \
      --hostfile "$out/hosts" -np 4 --map-by slot -x TRN_LOG_LEVEL=warn -x TRN_FABRIC_PROVIDER=tcp \
      -x TRN_FABRIC_RAILS="$rails" "$BIN/trn-collbench" -b "$s" -e "$s" -n 3 -w 1 -a "$ALGO" 2>&1 |
      awk -v r="$rails" -v p="$rep" '/^  / { print r, p, $1, $6 }' >>"$out/rows"
  done
  for k in 0 1; do for i in eth0 eth1; do after+=("$(tx $k $i)"); done; done
  for j in 0 1 2 3; do echo "$rails $j $((after[j] - before[j]))" >>"$out/bytes"; done
}

"$TB" up "$name" 2 --rails 2 --rate "$RATE"
printf '%s slots=2\n' "$name-h0" "$name-h1" >"$out/hosts"
: >"$out/bytes"
for ((rep = 0; rep < REPS; ++rep)); do
  if ((rep % 2 == 0)); then run eth0 "$rep"; run eth0,eth1 "$rep"
  else run eth0,eth1 "$rep"; run eth0 "$rep"; fi
done

echo "# $(uname -n), $(nproc) cores, load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# 2 hosts x 2 ranks, 2 rails per host capped at $RATE each way, algorithm $ALGO, $REPS launches per side"
/usr/bin/python3 - "$out/rows" "$out/bytes" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    rails, rep, size, us = line.split()
    runs[(int(size), rails)].append(float(us))
print("| size | one rail busbw GB/s | two rails busbw GB/s | two / one | launches |")
print("|---|---|---|---|---|")
for size in sorted({k[0] for k in runs}):
    one, two = runs.get((size, "eth0"), []), runs.get((size, "eth0,eth1"), [])
    if not one or not two:
        continue
    a, b = (size / statistics.median(x) / 1e3 * 2 * 3 / 4 for x in (one, two))
    print(f"| {size >> 20} MiB | {a:.3g} | {b:.3g} | {b / a:.2f} | {len(one)} + {len(two)} |")
sent = collections.defaultdict(int)
for line in open(sys.argv[2]):
    rails, j, n = line.split()
    sent[(rails, int(j))] += int(n)
print()
print("| rails | host 0 eth0 MB | host 0 eth1 MB | host 1 eth0 MB | host 1 eth1 MB |")
print("|---|---|---|---|---|")
for rails in ("eth0", "eth0,eth1"):
    print(f"| {rails} | " + " | ".join(f"{sent[(rails, j)] / 1e6:.1f}" for j in range(4)) + " |")
PY
