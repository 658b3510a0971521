#!/usr/bin/env bash
# The udp provider against the tcp provider, in one run on one machine: `rdmx bench
# write_bw` with 64 KiB messages between two processes (--server and a client), udp with
# the server on 127.0.0.1:4791 and the client on 127.0.0.2:4791 (RDMX_UDP_BIND), tcp over
# 127.0.0.1. Rounds interleave the runs; each figure is the median of ROUNDS. The udp
# provider runs as it opens by default (UDP GSO sends and GRO reads, `sendmmsg`/`recvmmsg`
# batches of 32), then with GSO/GRO off (RDMX_UDP_GSO=0: one datagram per message, still
# batched), then with batching off too (RDMX_UDP_BATCH=1: a system call per datagram), to
# show what each mechanism gives. The anchor is the bare kernel path under it
# (scripts/udp-gso-anchor.c): UDP GSO over loopback with datagrams shaped as the
# provider's 64 KiB WRITEs (runs of 2 and 14), no ICRC and no transport; `udp/anchor` is
# the share of that path the provider keeps. The last line gives the ratios.
#
# Usage: scripts/udp-bench.sh            (ROUNDS=5, N=20000 messages by default; UDP_SERVER
#        and UDP_CLIENT move the udp addresses off 127.0.0.1 and 127.0.0.2, which the udp
#        tests use too)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-5}
N=${N:-20000}
UDP_SERVER=${UDP_SERVER:-127.0.0.1}
UDP_CLIENT=${UDP_CLIENT:-127.0.0.2}
cargo build --release --locked -p rdmx-cli >/dev/null 2>&1
RDMX=${CARGO_TARGET_DIR:-target}/release/rdmx
out=$(mktemp -d)
trap 'rm -rf "$out"; kill $(jobs -p) 2>/dev/null || true' EXIT
cc -O2 -o "$out/anchor" scripts/udp-gso-anchor.c

j() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
pick="d['results'][0].get('bw_avg_mib_s') or d['results'][0]['t_typical_us']"
two() { # provider test size iters [extra...] -> MiB/s or t_typical usec; a failed run
    # prints nothing and is counted (with its error) in $out/failed
    local p=$1 t=$2 s=$3 n=$4 srv; shift 4
    RDMX_UDP_BIND=$UDP_SERVER "$RDMX" bench "$t" --provider "$p" -s "$s" -n "$n" \
        --server --port 5317 "$@" >/dev/null 2>&1 &
    srv=$!
    sleep 0.3
    local to=127.0.0.1
    [ "$p" != udp ] || to=$UDP_SERVER
    if RDMX_UDP_BIND=$UDP_CLIENT "$RDMX" bench "$t" --provider "$p" -s "$s" -n "$n" \
        --port 5317 --json "$@" "$to" >"$out/run.json" 2>"$out/run.err"; then
        j "$pick" <"$out/run.json"
    else
        echo "$p $t $s ${RDMX_UDP_BATCH:+batch=$RDMX_UDP_BATCH }${RDMX_UDP_GSO:+gso=$RDMX_UDP_GSO }$(tail -1 "$out/run.err")" >>"$out/failed"
        kill "$srv" 2>/dev/null || true # its peer is gone; it would wait for it
    fi
    wait "$srv" || true
}
for r in $(seq "$ROUNDS"); do
    two tcp write_bw 65536 "$N" >>"$out/tcp_64k"
    two udp write_bw 65536 "$N" >>"$out/udp_64k"
    "$out/anchor" $((N / 16)) 2,14 5319 >>"$out/anchor_64k"
    RDMX_UDP_GSO=0 two udp write_bw 65536 "$N" >>"$out/udp_64k_nogso"
    RDMX_UDP_GSO=0 RDMX_UDP_BATCH=1 two udp write_bw 65536 "$N" >>"$out/udp_64k_nobatch"
    two tcp write_lat 8 20000 >>"$out/tcp_lat"
    two udp write_lat 8 20000 >>"$out/udp_lat"
    echo "round $r/$ROUNDS done" >&2
done
med() { sort -g "$out/$1" | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
figs=(tcp_64k udp_64k udp_64k_nogso udp_64k_nobatch tcp_lat udp_lat anchor_64k)
printf '%-16s %10s   (median of %s; MiB/s, latency in usec)\n' figure value "$ROUNDS"
args=()
for f in "${figs[@]}"; do
    printf '%-16s %10.3f\n' "$f" "$(med "$f")"
    args+=("$(med "$f")")
done
if [ -s "$out/failed" ]; then
    echo "failed runs (not in the medians):"
    sed 's/^/  /' "$out/failed"
fi
python3 - "${args[@]}" <<'PY'
import sys
t64, u64, u64g0, u64n, tl, ul, a64 = map(float, sys.argv[1:])
print(f"ratio udp/tcp write_bw_64k={u64/t64:.2f} udp_nogso/tcp write_bw_64k={u64g0/t64:.2f} "
      f"udp_nobatch/tcp write_bw_64k={u64n/t64:.2f} gso/nogso={u64/u64g0:.2f} "
      f"batched/unbatched={u64g0/u64n:.2f} udp/tcp write_lat={ul/tl:.2f} "
      f"udp/anchor write_bw_64k={u64/a64:.2f} anchor/tcp={a64/t64:.2f}")
PY
