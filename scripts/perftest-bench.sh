#!/usr/bin/env bash
# rdmx's udp provider against Linux Soft-RoCE, measured with stock perftest: in one
# `rxe-vm.sh run2 --b-no-rxe` session, `rdmx bench TEST --perftest` on udp in VM b (the
# client) against the stock ib_TEST server on rxe0 in VM a; in a second session (both VMs
# with rxe), the stock client on rxe0 in VM b against the same server: the anchor. Each
# session runs ROUNDS rounds of write_bw and write_lat, the sessions alternate SESSIONS
# times, and the medians of the clients' figures (BW average, t_typical) are printed with
# their ratios. rdmx keeps at most 128 packets unacknowledged (RDMX_UDP_WINDOW), as rxe's own
# requester does (RXE_MAX_UNACKED_PSNS), so both senders run with the same window (the
# interop checks keep 32).
#
# Usage: scripts/perftest-bench.sh [--release] [--rounds N] [--sessions N] [--iters N]
#                                  [--window PACKETS]
#   (builds `rdmx` first: --release for an optimized build, as the figures want)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=3 sessions=2 iters=1000 profile=debug window=128
while [ $# -gt 0 ]; do
    case $1 in
    --release) profile=release; shift ;;
    --rounds) rounds=$2; shift 2 ;;
    --sessions) sessions=$2; shift 2 ;;
    --iters) iters=$2; shift 2 ;;
    --window) window=$2; shift 2 ;;
    *) echo "usage: scripts/perftest-bench.sh [--release] [--rounds N] [--sessions N] [--iters N] [--window PACKETS]" >&2; exit 2 ;;
    esac
done
flag=()
[ "$profile" = debug ] || flag=(--release)
cargo build --locked "${flag[@]}" -p rdmx-cli --bin rdmx
rdmx=$PWD/target/$profile/rdmx
[ -z "${CARGO_TARGET_DIR:-}" ] || rdmx=$CARGO_TARGET_DIR/$profile/rdmx
tmp=$(mktemp -d "${TMPDIR:-/tmp}/perftest-bench.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# Every run of a session on its own port; the clients wait for their server.
server="port=18800; for r in \$(seq $rounds); do for t in write_bw write_lat; do \
    timeout 300 ib_\$t -d \$RXE_DEV -x \$RXE_GID_INDEX -F -u 18 -n $iters -p \$port; \
    port=\$((port + 1)); done; done"
client() { # the client command: CMD with \$t and \$port
    echo "port=18800; for r in \$(seq $rounds); do for t in write_bw write_lat; do \
        rxe-retry 60 $1 -u 18 -n $iters -p \$port \$RXE_PEER | sed \"s/^/RESULT \$t /\"; \
        port=\$((port + 1)); done; done"
}
udp="env RDMX_UDP_BIND=\$RXE_IP RDMX_UDP_VERIFY_ICRC=0 RDMX_UDP_WINDOW=$window timeout 300 $rdmx bench \$t --perftest --provider udp"
rxe="timeout 300 ib_\$t -d \$RXE_DEV -x \$RXE_GID_INDEX -F"
for s in $(seq "$sessions"); do
    echo "== session $s: rdmx (udp, VM b) -> ib_TEST (rxe0, VM a)"
    RXE_VM_KERNEL_ARGS=${RXE_VM_KERNEL_ARGS:-noapic} scripts/rxe-vm.sh run2 --b-no-rxe --timeout 900 \
        --a "$server" --b "$(client "$udp")" | tee -a "$tmp/udp.log" | grep 'RESULT' || true
    echo "== session $s: ib_TEST (rxe0, VM b) -> ib_TEST (rxe0, VM a)"
    RXE_VM_KERNEL_ARGS=${RXE_VM_KERNEL_ARGS:-noapic} scripts/rxe-vm.sh run2 --timeout 900 \
        --a "$server" --b "$(client "$rxe")" | tee -a "$tmp/rxe.log" | grep 'RESULT' || true
done
# The client's result row: "#bytes #iterations ..." then the figures; BW average is the
# 4th number of a bandwidth row, t_typical the 5th of a latency row.
median() { sort -g | awk '{v[NR] = $1} END {if (NR == 0) print "nan"; else if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
figures() { # LOG TEST COLUMN
    grep -a "RESULT $2 " "$1" | tr -d '\r' | awk -v c="$3" '$4 ~ /^[0-9]+$/ && $5 ~ /^[0-9]+$/ && NF >= c + 3 {print $(c + 3)}'
}
echo "== medians over $((rounds * sessions)) runs each (-n $iters; write_bw 65536 B, write_lat 2 B)"
for t in write_bw:4:MiB/s write_lat:5:us; do
    IFS=: read -r name col unit <<<"$t"
    u=$(figures "$tmp/udp.log" "$name" "$col" | median)
    r=$(figures "$tmp/rxe.log" "$name" "$col" | median)
    n=$(figures "$tmp/udp.log" "$name" "$col" | wc -l)
    m=$(figures "$tmp/rxe.log" "$name" "$col" | wc -l)
    echo "$name: rdmx udp $u $unit ($n runs), rxe $r $unit ($m runs), ratio udp/rxe $(awk -v a="$u" -v b="$r" 'BEGIN {printf "%.2f", a / b}')"
done
